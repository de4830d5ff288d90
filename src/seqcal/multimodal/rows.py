"""seqcal's own route for images and audio: raw rows through the model's processor and chat template.

A row takes this route when it holds images or audio not yet mapped through a processor:

- chat ``messages`` whose content holds ``{"type": "image", "image": path | URL | PIL image}`` or
  ``{"type": "audio", "audio": path | array}`` items (``"url"`` or ``"path"`` may name the file instead);
- an ``image`` / ``images`` or ``audio`` column beside the text (``text_column``, optional for speech).

Each row's media are loaded first (``media``), so a missing file is an error naming it and the row (the JSON
lines file's line) before anything is calibrated; paths are absolute or relative to the JSON lines file.
``batches`` renders the text (the processor's chat template for messages, and for a media column when the
processor has one) and calls the processor on ``batch_size`` rows at a time.

Example:
    >>> rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
    ...                                                     {"type": "text", "text": "What is it?"}]}]}]
    >>> any(is_media_row(r) for r in rows)
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from seqcal.data.args import CalibrationDataError
from seqcal.multimodal.media import Loaded

# Content item type -> the keys that may hold its value, in the order read.
ITEM_KEYS: dict[str, tuple[str, ...]] = {"image": ("image", "url", "path"), "audio": ("audio", "url", "path")}
# Row columns that hold media beside the text -> the kind of media.
MEDIA_COLUMNS: dict[str, str] = {"image": "image", "images": "image", "audio": "audio"}


@dataclasses.dataclass
class MediaRow:
    """One row with its media loaded.

    Args:
        where: the row's place for messages (``file:line`` or ``the Dataset, row i``).
        messages: the chat (media items reduced to their type) or None.
        text: the plain text (no chat) or None.
        images: PIL images in the order they appear.
        audios: 1-D float32 arrays at the processor's sampling rate, in order.
    """

    where: str
    messages: list[dict[str, Any]] | None
    text: str | None
    images: list[Any]
    audios: list[Any]


def _items(row: Any) -> list[Mapping]:
    messages = row.get("messages") if isinstance(row, Mapping) else row
    if not isinstance(messages, (list, tuple)):
        return []
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, (list, tuple)):
            out += [c for c in content if isinstance(c, Mapping) and c.get("type") in ITEM_KEYS]
    return out


def is_media_row(row: Any) -> bool:
    """Whether ``row`` holds images or audio not yet mapped through a processor (see the module docstring)."""
    if isinstance(row, Mapping) and any(row.get(col) is not None for col in MEDIA_COLUMNS):
        return True
    return bool(_items(row))


def media_rows(rows: Sequence[Any], wheres: Sequence[str], base: Path | None, sampling_rate: int | None,
               text_column: str = "text") -> list[MediaRow]:  # fmt: skip
    """Every row with its media loaded, each checked before any is processed.

    Args:
        rows: the picked rows (dicts with ``messages`` or media columns, or conversations).
        wheres: each row's place, for errors.
        base: the folder relative paths are read from (the JSON lines file's), None: the working folder.
        sampling_rate: the processor's audio sampling rate (None: no audio expected).
        text_column: the column holding a media row's text.

    Returns:
        One ``MediaRow`` per row.

    Raises:
        CalibrationDataError: a file that does not exist or cannot be read, an item without a value, a row
            with neither messages nor text.
    """
    return [_media_row(row, where, base, sampling_rate, text_column) for row, where in zip(rows, wheres)]


def _media_row(row: Any, where: str, base: Path | None, rate: int | None, text_column: str) -> MediaRow:
    loaded = Loaded(where, base, rate)
    messages = row.get("messages") if isinstance(row, Mapping) else row
    if isinstance(messages, (list, tuple)):
        out = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, (list, tuple)):
                content = [_item(c, loaded) for c in content]
            out.append({**m, "content": content})
        return MediaRow(where, out, None, loaded.images, loaded.audios)
    for column, kind in MEDIA_COLUMNS.items():
        value = row.get(column)
        for one in value if isinstance(value, (list, tuple)) and kind == "image" else [value]:
            if one is not None:
                loaded.add(kind, one, f"column {column!r}")
    text = row.get(text_column)
    if text is not None and not isinstance(text, str):
        raise CalibrationDataError(f"{where}: column {text_column!r} holds a {type(text).__name__}, not text; "
                                   "give the row's prompt or transcript as a string")  # fmt: skip
    if text is None and loaded.images:
        raise CalibrationDataError(f"{where}: an image row needs its text in column {text_column!r} (or chat "
                                   "'messages'); add the prompt that goes with the image")  # fmt: skip
    return MediaRow(where, None, text, loaded.images, loaded.audios)


def _item(item: Any, loaded: Loaded) -> Any:
    """A content item with its media loaded into ``loaded``, reduced to ``{"type": ...}`` for the template."""
    if not isinstance(item, Mapping) or item.get("type") not in ITEM_KEYS:
        return item
    kind = item["type"]
    value = next((item[k] for k in ITEM_KEYS[kind] if item.get(k) is not None), None)
    if value is None:
        raise CalibrationDataError(f"{loaded.where}: a {kind!r} item has no {' / '.join(ITEM_KEYS[kind])} value; "
                                   f'give e.g. {{"type": "{kind}", "{kind}": "file"}}')  # fmt: skip
    loaded.add(kind, value, f"a {kind!r} item")
    return {"type": kind}


def batches(rows: list[MediaRow], processor: Any, model: torch.nn.Module, size: int) -> list[dict[str, Any]]:
    """The processor's model inputs for ``rows``, ``size`` rows per batch where the processor can batch them.

    Rows whose images the processor cannot put into one batch (sizes it does not resize to one) are batched
    with rows of the same image sizes instead; when even those fail, the error gives the processor's reason.

    Args:
        rows: the loaded rows.
        processor: the model's processor (tokenizer, image processor or feature extractor, chat template).
        model: the model (its config says whether it is an encoder-decoder fed ``decoder_input_ids``).
        size: rows per batch.

    Returns:
        Batches of tensors (``input_ids``, ``attention_mask``, ``pixel_values``, ``input_features``, ...).
    """
    out: list[dict[str, Any]] = []
    for start in range(0, len(rows), size):
        group = rows[start : start + size]
        try:
            out.append(_processed(group, processor, model))
        except (ValueError, RuntimeError, TypeError) as err:
            if len(group) == 1 or len({_sizes(r) for r in group}) == 1:
                raise CalibrationDataError(f"{group[0].where}: the processor {type(processor).__name__} could not "
                                           f"process the row ({err}); check the row's text and media against "
                                           "the model's processor") from err  # fmt: skip
            out += _by_image_size(group, processor, model)
    return out


def _sizes(row: MediaRow) -> tuple:
    return tuple(getattr(im, "size", None) for im in row.images)


def _by_image_size(group: list[MediaRow], processor: Any, model: torch.nn.Module) -> list[dict[str, Any]]:
    """``group`` in batches of rows whose images have the same sizes (the processor cannot mix them)."""
    by_size: dict[tuple, list[MediaRow]] = {}
    for row in group:
        by_size.setdefault(_sizes(row), []).append(row)
    out = []
    for same in by_size.values():
        try:
            out.append(_processed(same, processor, model))
        except (ValueError, RuntimeError, TypeError) as err:
            raise CalibrationDataError(
                f"{same[0].where}: the processor {type(processor).__name__} cannot batch these rows ({err}), not "
                "even those with images of one size; pass batch_size=1"
            ) from err
    return out


def _processed(group: list[MediaRow], processor: Any, model: torch.nn.Module) -> dict[str, Any]:
    """One batch: the texts rendered, then the processor on texts and media (decoder ids for seq2seq)."""
    texts = [_text(row, processor) for row in group]
    images = [im for row in group for im in row.images]
    audios = [a for row in group for a in row.audios]
    if getattr(model.config, "is_encoder_decoder", False):
        return _encoder_decoder(texts, audios, processor, model)
    kwargs: dict[str, Any] = {"text": texts, "return_tensors": "pt", "padding": True}
    if images:
        kwargs["images"] = images if len(group) == 1 else [row.images for row in group]
    if audios:
        kwargs["audio"] = audios
        kwargs["sampling_rate"] = _rate(processor)
    return dict(processor(**kwargs))


def _encoder_decoder(texts: list[str], audios: list[Any], processor: Any, model: torch.nn.Module) -> dict:
    """A speech-to-text batch: the audio's features and the decoder's start token then the text's tokens."""
    features = getattr(processor, "feature_extractor", processor)
    out = dict(features(audios, sampling_rate=_rate(processor), return_tensors="pt"))
    start = model.config.decoder_start_token_id
    tok = getattr(processor, "tokenizer", None)
    ids = []
    for text in texts:
        row = tok(text).input_ids if (text and tok is not None) else []
        ids.append(row if row[:1] == [start] else [start, *row])
    width = max(map(len, ids))
    pad = getattr(tok, "pad_token_id", None) or 0
    out["decoder_input_ids"] = torch.tensor([r + [pad] * (width - len(r)) for r in ids])
    if width > min(map(len, ids)):  # right padding, masked
        out["decoder_attention_mask"] = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
    return out


def _text(row: MediaRow, processor: Any) -> str:
    """The row's text: its chat through the chat template, a media column's text wrapped in one user turn
    when the processor has a template, else the text as given (it must hold the processor's media markers)."""
    template = getattr(processor, "chat_template", None)
    messages = row.messages
    if messages is None and template and row.text is not None:
        media = [{"type": "image"}] * len(row.images) + [{"type": "audio"}] * len(row.audios)
        messages = [{"role": "user", "content": [*media, {"type": "text", "text": row.text}]}]
    if messages is None:
        return row.text or ""
    if not template:
        raise CalibrationDataError(
            f"{row.where}: chat rows need the processor's chat template, but {type(processor).__name__} has no "
            "chat_template; give the processor one (processor.chat_template = ...) or give the text with an "
            "'image' / 'audio' column"
        )
    return processor.apply_chat_template(messages, tokenize=False)


def _rate(processor: Any) -> int:
    features = getattr(processor, "feature_extractor", processor)
    return int(getattr(features, "sampling_rate", 16000))


def sampling_rate(processor: Any) -> int | None:
    """The processor's audio sampling rate, or None when it takes no audio."""
    features = getattr(processor, "feature_extractor", None) or getattr(processor, "audio_processor", None)
    return getattr(features, "sampling_rate", None)
