"""Calibration data: files, Python lists, HF datasets, token tensors or a DataLoader -> padded batches.

``load_calibration_batches(DataArgs(...), tokenizer)`` returns ``list[dict]`` whose ``input_ids`` and
``attention_mask`` are LongTensors ``[B, T]``, ready for ``model(**batch)``. Every step is deterministic:

1. read the dataset into rows (a paragraph, a JSON/CSV/Parquet row, a conversation, a token sequence);
2. shuffle the row *order* with ``random.Random(seed)`` before converting any row, so a large dataset
   costs only the rows that are used;
3. convert rows in that order, skipping empty ones, until ``num_calibration_samples`` samples are found
   (``concatenate=True``: until the joined text fills that many windows of ``max_seq_length`` tokens);
4. tokenize, truncating to ``max_seq_length``, and pad each run of ``batch_size`` samples to its longest
   (``batch_size="auto"``: group samples of about equal length instead, ``seqcal.data.autobatch``).

``datasets`` and ``pyarrow`` are optional and imported only when a Hub name, a saved dataset folder or a
``.parquet`` file needs them.

Example:
    >>> args = DataArgs("default", num_calibration_samples=4, max_seq_length=64, batch_size=2)
    >>> [b["input_ids"].shape for b in load_calibration_batches(args, tokenizer)]
    [torch.Size([2, 64]), torch.Size([2, 64])]
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from seqcal.data.args import ACCEPTED, CalibrationDataError, DataArgs, PreparedBatches, _dataset_kind
from seqcal.data.autobatch import AUTO, BatchLimits, group_by_length
from seqcal.data.sources import (
    _HEADING,
    _ROW_READERS,
    MIN_PARAGRAPH_CHARS,
    _as_ids,
    _is_conversation,
    _row_where,
    _warn_unused_splits,
    default_calibration_text,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ACCEPTED",
    "MIN_PARAGRAPH_CHARS",
    "CalibrationDataError",
    "DataArgs",
    "default_calibration_text",
    "load_calibration_batches",
    "needs_tokenizer",
]

logger = logging.getLogger("seqcal.data")


@dataclasses.dataclass(frozen=True)
class _Sample:
    text: str | None = None
    ids: list[int] | None = None
    chat: bool = False  # rendered by a chat template, which already holds BOS: add no special tokens


def load_calibration_batches(
    args: DataArgs, tokenizer: PreTrainedTokenizerBase | None
) -> list[dict[str, torch.Tensor]]:
    """Read, shuffle, select, tokenize and pad the calibration samples described by ``args``.

    Args:
        args: the dataset and how to cut it.
        tokenizer: a transformers tokenizer; padding uses its ``padding_side`` and ``pad_token_id``
            (else ``eos_token_id``). May be None for token ids with ``batch_size=1`` or a DataLoader.

    Returns:
        Batches ``{"input_ids": LongTensor[B, T], "attention_mask": LongTensor[B, T]}``, T = longest sample
        of the batch (<= max_seq_length). DataLoader batches are returned as they come (other keys kept),
        with a mask of ones added when missing and columns past max_seq_length dropped.

    Example:
        >>> batches = load_calibration_batches(DataArgs(["Some text.", "More text."], batch_size=2), tok)
        >>> batches[0]["attention_mask"].sum(1)  # tokens per sample
    """
    if isinstance(args.dataset, PreparedBatches):
        return list(args.dataset)
    if isinstance(args.dataset, DataLoader):
        return _loader_batches(args)
    pad_id = _pad_id(args, tokenizer)
    kind = _dataset_kind(args.dataset)
    if kind in ("list", "tokens"):
        _warn_unused_splits(args, f"a {type(args.dataset).__name__}")
    rows, where = _ROW_READERS[kind](args)
    if len(rows) == 0:
        raise CalibrationDataError(f"{where} is empty: it has no rows; pass a dataset with text in it")
    order = list(range(len(rows)))
    if args.shuffle_calibration_samples:
        random.Random(args.seed).shuffle(order)
    samples = (
        s
        for i in order
        if (s := _to_sample(rows[i], _row_where(rows, where, i), args, tokenizer)) is not None
    )
    seqs = (
        _windows(samples, args, tokenizer, where) if args.concatenate else _first_n(samples, args, tokenizer)
    )
    if not seqs:
        raise CalibrationDataError(
            f"{where} has {len(rows)} rows but no usable sample: all are empty, headings or shorter than "
            f"{MIN_PARAGRAPH_CHARS} characters (paragraphs of text files); check text_column={args.text_column!r}"
        )
    if len(seqs) < args.num_calibration_samples:
        logger.warning("%s", _shortfall(seqs, len(rows), where, args))
    if args.batch_size == AUTO:
        # Right padding keeps each real token's positions and context as it has alone (autobatch, rule 2);
        # nothing real reads a padded position, so with no pad token id 0 pads as well as any.
        groups = group_by_length([len(s) for s in seqs], args.batch_limits or BatchLimits())
        return [_collate([seqs[i] for i in group], pad_id, "right") for group in groups]
    side = getattr(tokenizer, "padding_side", "right")
    return [
        _collate(seqs[i : i + args.batch_size], pad_id, side) for i in range(0, len(seqs), args.batch_size)
    ]


def needs_tokenizer(args: DataArgs) -> bool:
    """Whether the calibration data holds text (which needs a tokenizer) rather than token ids.

    Decided by the first non-empty row; reading rows costs a second read of the dataset, so call it only
    when no tokenizer is at hand.

    Args:
        args: the dataset and how to read it.

    Returns:
        False for a DataLoader and for token ids (tensors, id lists, ``{"input_ids": ...}`` rows), else True.

    Example:
        >>> needs_tokenizer(DataArgs(["Some text."])), needs_tokenizer(DataArgs(torch.ones(2, 8).long()))
        (True, False)
    """
    kind = _dataset_kind(args.dataset)
    if kind == "loader" or isinstance(args.dataset, PreparedBatches):
        return False
    rows, _ = _ROW_READERS[kind](args)
    for row in rows:
        if row is None or (isinstance(row, str) and not row.strip()):
            continue
        if isinstance(row, Mapping):
            return "input_ids" not in row or args.text_column in row or "messages" in row
        return isinstance(row, str) or _is_conversation(row)
    return False


# ---- rows -> samples -> token sequences ----------------------------------------------------------------


def _unpad(row: Mapping, where: str) -> list[int]:
    """Token ids of a pre-tokenized row, padding (attention_mask == 0) removed."""
    ids = _as_ids(row["input_ids"])
    if ids is None:
        raise CalibrationDataError(f"{where}: 'input_ids' must be a list of ints or a 1-D integer tensor")
    mask = row.get("attention_mask")
    if mask is None:
        return ids
    mask = mask.tolist() if isinstance(mask, torch.Tensor) else list(mask)
    if len(mask) != len(ids):
        raise CalibrationDataError(
            f"{where}: attention_mask has {len(mask)} entries for {len(ids)} input_ids"
        )
    return [t for t, m in zip(ids, mask) if m]


def _render_chat(messages: Sequence[Mapping], tokenizer: Any, where: str, args: DataArgs) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise CalibrationDataError(
            f"{where}: chat rows need tokenizer.apply_chat_template, but the tokenizer has no chat_template; "
            f"use an instruct model's tokenizer, set tokenizer.chat_template, or give plain text in a "
            f"{args.text_column!r} column"
        )
    return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False)


def _not_messages(value: Any, where: str) -> str:
    """The error for a 'messages' value that is not a conversation (a string, a dict, messages without roles)."""
    got = f"a {type(value).__name__}"
    if isinstance(value, (list, tuple)):
        bad = next(m for m in value if not (isinstance(m, Mapping) and "role" in m and "content" in m))
        got = f"a list whose item {bad!r:.60} is not a {{'role', 'content'}} dict"
    return (f"{where}: expected a list of messages like [{{'role': 'user', 'content': '...'}}], got {got}; "
            "give each chat row such a list, or put plain text in the text column")  # fmt: skip


def _to_sample(row: Any, where: str, args: DataArgs, tokenizer: Any) -> _Sample | None:
    """One row as text, chat text or token ids; None for rows with nothing to calibrate on."""
    if row is None:
        return None
    if isinstance(row, str):
        return _Sample(text=row) if row.strip() and not _HEADING.match(row) else None
    if _is_conversation(row):
        return _Sample(text=_render_chat(row, tokenizer, where, args), chat=True)
    if isinstance(row, Mapping):
        for key in (args.text_column, "messages"):
            if key in row:
                empty = isinstance(row[key], (list, tuple)) and not row[key]
                if key == "messages" and not empty and not _is_conversation(row[key]):
                    raise CalibrationDataError(_not_messages(row[key], f"{where}, column 'messages'"))
                return _to_sample(row[key], f"{where}, column {key!r}", args, tokenizer)
        if "input_ids" in row:
            ids = _unpad(row, where)
            return _Sample(ids=ids) if ids else None
        hint = (
            " (one conversation is a list of messages: pass dataset=[conversation])" if "role" in row else ""
        )
        raise CalibrationDataError(
            f"{where}: no column {args.text_column!r}; columns: {sorted(map(str, row))}{hint}. Set text_column "
            "to the one holding text, or give chat rows a 'messages' list of {role, content}"
        )
    ids = _as_ids(row)
    if ids is None:
        raise CalibrationDataError(f"{where}: cannot use a {type(row).__name__} as a sample; a sample is a "
                                   "string, a conversation, a row dict or a list of token ids")  # fmt: skip
    return _Sample(ids=ids) if ids else None


def _encode(text: str, chat: bool, tokenizer: Any, max_length: int | None) -> list[int]:
    if tokenizer is None:
        raise CalibrationDataError("load_calibration_batches: text samples need a tokenizer, got None; pass the "
                                   "model's tokenizer (or pre-tokenized {'input_ids': ...} data)")  # fmt: skip
    # verbose=False: concatenation tokenizes far past model_max_length on purpose.
    enc = tokenizer(text, add_special_tokens=not chat, truncation=max_length is not None,
                    max_length=max_length, verbose=False)  # fmt: skip
    return list(enc["input_ids"])


def _first_n(samples: Iterable[_Sample], args: DataArgs, tokenizer: Any) -> list[list[int]]:
    """Tokenize samples in order until num_calibration_samples non-empty ones are found."""
    seqs: list[list[int]] = []
    T = args.max_seq_length
    for s in samples:
        ids = s.ids[:T] if s.ids is not None else _encode(s.text or "", s.chat, tokenizer, T)
        if ids:
            seqs.append(ids)
        if len(seqs) == args.num_calibration_samples:
            break
    return seqs


def _windows(samples: Iterable[_Sample], args: DataArgs, tokenizer: Any, where: str) -> list[list[int]]:
    """Join samples ("\\n\\n" between texts) and cut consecutive windows of exactly max_seq_length tokens."""
    T, N = args.max_seq_length, args.num_calibration_samples
    need = N * T
    ids: list[int] = []
    texts: list[_Sample] = []
    chars, budget = 0, 4 * need  # ~4 characters per token in English BPE; only the first guess
    for s in samples:
        if s.ids is not None:
            ids.extend(s.ids)
        else:
            texts.append(s)
            chars += len(s.text or "") + 2
        if texts and ids:
            raise CalibrationDataError(f"{where}: concatenate=True cannot mix text rows with token-id rows")
        if texts and chars >= budget:
            # Tokenize the whole join again so that tokens across text boundaries are exactly the join's.
            joined = _encode("\n\n".join(t.text or "" for t in texts), texts[0].chat, tokenizer, None)
            if len(joined) >= need:
                return _cut(joined, T, N)
            budget *= 2
        if not texts and len(ids) >= need:
            return _cut(ids, T, N)
    if texts:
        ids = _encode("\n\n".join(t.text or "" for t in texts), texts[0].chat, tokenizer, None)
    if len(ids) < T:
        raise CalibrationDataError(f"{where}: concatenate=True needs at least max_seq_length={T} tokens for one "
                                   f"window, the whole dataset has {len(ids)}; lower max_seq_length or use "
                                   "concatenate=False")  # fmt: skip
    return _cut(ids, T, N)


def _cut(ids: list[int], T: int, N: int) -> list[list[int]]:
    return [ids[i : i + T] for i in range(0, len(ids) - T + 1, T)][:N]


def _shortfall(seqs: list[list[int]], rows: int, where: str, args: DataArgs) -> str:
    """Why the dataset gives fewer samples than asked for: what it gave, in samples and tokens, and what it has."""
    T, tokens = args.max_seq_length, sum(len(s) for s in seqs)
    gave = f"{where} gives {len(seqs)} calibration sample{'s' * (len(seqs) != 1)} ({tokens} tokens)"
    asked = f"fewer than the {args.num_calibration_samples} requested"
    if args.concatenate:
        return f"{gave}, {asked} (windows of {T} tokens): the joined text holds {len(seqs)} whole windows; using those"
    skipped = rows - len(seqs)
    why = f", {skipped} of them empty or headings" if skipped else ""
    return (f"{gave}, {asked} (up to {T} tokens each): it has {rows} row{'s' * (rows != 1)}{why} "
            "(one sample per row; a text file's rows are its paragraphs); using those")  # fmt: skip


# ---- batches -------------------------------------------------------------------------------------------


def _pad_id(args: DataArgs, tokenizer: Any) -> int:
    """Padding id: pad_token_id, else eos_token_id; checked up front when batches may need padding."""
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else getattr(tokenizer, "eos_token_id", None)
    if pad is None and args.batch_size != AUTO and args.batch_size > 1 and not args.concatenate:
        raise CalibrationDataError(
            f"batch_size={args.batch_size} pads samples to the longest, but the tokenizer has neither a "
            "pad_token nor an eos_token; set tokenizer.pad_token (e.g. to an existing special token) or use "
            "batch_size=1"
        )
    side = getattr(tokenizer, "padding_side", "right")
    if side not in ("left", "right"):
        raise CalibrationDataError(f"tokenizer.padding_side is {side!r}; expected 'left' or 'right'")
    return 0 if pad is None else int(pad)  # 0 pads only masked positions (auto) or is never written


def _collate(seqs: list[list[int]], pad_id: int, side: str) -> dict[str, torch.Tensor]:
    T = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(seqs), T), dtype=torch.long)  # [B, T]
    for b, s in enumerate(seqs):
        cols = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        input_ids[b, cols] = torch.tensor(s, dtype=torch.long)
        attention_mask[b, cols] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _check_loader_batch(batch: Any, i: int, T: int) -> dict[str, Any]:
    """A DataLoader batch as a dict with input_ids / attention_mask [B, <=T]; other keys kept as they are."""
    batch = {"input_ids": batch} if isinstance(batch, torch.Tensor) else batch
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if (
        not isinstance(ids, torch.Tensor)
        or ids.ndim != 2
        or ids.dtype.is_floating_point
        or ids.dtype == torch.bool
    ):
        raise CalibrationDataError(f"DataLoader batch {i}: expected a dict with 'input_ids' an integer tensor "
                                   f"[B, T] (and 'attention_mask' [B, T]), got {type(batch).__name__}"
                                   f"{'' if ids is None else f' with input_ids {type(ids).__name__}'}")  # fmt: skip
    out = dict(batch)
    mask = out.setdefault("attention_mask", torch.ones_like(ids))
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        raise CalibrationDataError(f"DataLoader batch {i}: attention_mask must be a tensor of input_ids' shape "
                                   f"{list(ids.shape)}")  # fmt: skip
    if ids.shape[1] > T:  # cut every [B, T, ...] tensor (labels, position_ids) the same way
        out = {
            k: v[:, :T] if isinstance(v, torch.Tensor) and v.shape[:2] == ids.shape else v
            for k, v in out.items()
        }
    return out


def _loader_batches(args: DataArgs) -> list[dict[str, torch.Tensor]]:
    """A DataLoader's batches in its own order until num_calibration_samples rows are covered."""
    batches, count = [], 0
    for i, batch in enumerate(args.dataset):
        batches.append(_check_loader_batch(batch, i, args.max_seq_length))
        count += batches[-1]["input_ids"].shape[0]
        if count >= args.num_calibration_samples:
            break
    if not batches:
        raise CalibrationDataError("the DataLoader is empty: it yields no batches")
    if count < args.num_calibration_samples:
        logger.warning("the DataLoader gives %d calibration samples, fewer than the %d requested; using those",
                       count, args.num_calibration_samples)  # fmt: skip
    return batches
