"""Calibration rows that carry images or audio -> batches holding every input the model's forward takes.

llm-compressor's route: a ``datasets.Dataset`` mapped through the model's processor (rows with
``input_ids``, ``attention_mask``, ``pixel_values``, ``image_grid_thw``, ``input_features``, ...), an optional
``preprocessing_func`` applied to each row and a ``data_collator`` that turns a list of rows into one batch
(default: one row per batch, each value as a tensor, as llm-compressor's multimodal examples collate).
Every key of every batch reaches the model; a key its forward does not name is an error that names the
column (nothing is dropped silently), and so are image or audio rows for a text-only model.

Example:
    >>> media = MediaArgs(data_collator=lambda rows: {k: torch.tensor(v) for k, v in rows[0].items()})
    >>> data_args = with_media_batches(data_args, model, media)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

import torch

from seqcal.data.args import CalibrationDataError, DataArgs, PreparedBatches, _dataset_kind

logger = logging.getLogger("seqcal.data")

# Inputs that only image, video or audio rows carry (keys of transformers processors' outputs); a row with one
# of them, or any row when a collator or preprocessing function is given, takes this module's route.
MEDIA_KEYS: frozenset[str] = frozenset({
    "pixel_values", "pixel_values_videos", "pixel_attention_mask", "pixel_mask", "image_sizes",
    "image_grid_thw", "video_grid_thw", "second_per_grid_ts", "image_attention_mask", "aspect_ratio_ids",
    "aspect_ratio_mask", "cross_attention_mask", "input_features", "feature_attention_mask", "input_values",
    "audio_values", "image_embeds", "mm_token_type_ids",
})  # fmt: skip
# Sequence inputs [B, T] that a row may hold without its batch dimension ([T]).
_SEQUENCE_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "labels",
                  "decoder_input_ids", "decoder_attention_mask")  # fmt: skip
# llm-compressor's named default collators: both mean "seqcal's own batching".
_DEFAULT_COLLATORS = ("truncation", "padding")


@dataclasses.dataclass(frozen=True)
class MediaArgs:
    """How rows become batches on the multimodal route (llm-compressor's keyword names).

    Args:
        data_collator: ``collator(rows: list[dict]) -> dict`` of tensors, one call per batch of ``batch_size``
            rows; None (or llm-compressor's "truncation" / "padding"): one row per batch, values as tensors.
        preprocessing_func: ``func(row: dict) -> dict`` applied to each row first (llm-compressor maps the
            dataset with it), e.g. a chat template and the processor.
    """

    data_collator: Callable[[list[dict[str, Any]]], Mapping[str, Any]] | str | None = None
    preprocessing_func: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None

    def __post_init__(self) -> None:
        collator = self.data_collator
        if not (collator is None or callable(collator) or collator in _DEFAULT_COLLATORS):
            raise TypeError(f"data_collator={collator!r} is neither a function of a list of rows nor one of "
                            f"{list(_DEFAULT_COLLATORS)}; pass e.g. lambda rows: {{k: torch.tensor(v) for k, v in "
                            "rows[0].items()}")  # fmt: skip
        if self.preprocessing_func is not None and not callable(self.preprocessing_func):
            raise TypeError(f"preprocessing_func={self.preprocessing_func!r} is not callable; pass a function "
                            "of one row that returns the row's model inputs")  # fmt: skip

    @property
    def collator(self) -> Callable[[list[dict[str, Any]]], Mapping[str, Any]] | None:
        """The collator to call (None: the default one)."""
        return self.data_collator if callable(self.data_collator) else None

    @property
    def given(self) -> bool:
        return self.collator is not None or self.preprocessing_func is not None


def forward_inputs(model: torch.nn.Module) -> set[str]:
    """The inputs ``model``'s forward names (``**kwargs`` not counted: it names nothing a batch can rely on)."""
    params = inspect.signature(type(model).forward).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}


def takes_media(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward takes image, video or audio inputs (a VLM or a speech model)."""
    return bool(forward_inputs(model) & MEDIA_KEYS)


def is_media_dataset(dataset: Any, media: MediaArgs) -> bool:
    """Whether ``dataset`` takes the multimodal route: a collator or preprocessing function is given, or its
    first row holds one of ``MEDIA_KEYS``."""
    if media.given:
        return True
    first = _first_row(dataset)
    return isinstance(first, Mapping) and bool(MEDIA_KEYS & set(map(str, first)))


def _first_row(dataset: Any) -> Any:
    kind = _dataset_kind(dataset)
    if kind == "hf":
        ds = dataset[next(iter(dataset))] if type(dataset).__name__ == "DatasetDict" else dataset
        return ds[0] if len(ds) else None
    if kind == "list":
        return dataset[0] if len(dataset) else None
    if kind == "tokens" and isinstance(dataset, Mapping):
        return dataset
    return None


def with_media_batches(args: DataArgs, model: torch.nn.Module, media: MediaArgs) -> DataArgs:
    """``args`` with its dataset replaced by ready batches when it takes the multimodal route, else ``args``.

    Args:
        args: the calibration data as ``oneshot`` describes it.
        model: the loaded model (its forward's inputs are checked against every batch key).
        media: the collator and preprocessing function.

    Returns:
        ``args`` unchanged for text data, else a copy whose dataset is a ``PreparedBatches``.

    Raises:
        CalibrationDataError: a row or batch key the forward does not take (named), rows that are not dicts,
            a sequence longer than ``max_seq_length``, or ``batch_size`` > 1 without a collator.
    """
    if args is None or isinstance(args.dataset, PreparedBatches) or not is_media_dataset(args.dataset, media):
        return args
    from seqcal.data.sources import _ROW_READERS, _row_where

    rows, where = _ROW_READERS[_dataset_kind(args.dataset)](args)
    order = list(range(len(rows)))
    if args.shuffle_calibration_samples:
        random.Random(args.seed).shuffle(order)
    size = 1 if media.collator is None else (args.batch_size if isinstance(args.batch_size, int) else 1)
    if media.collator is None and args.batch_size not in (1, "auto"):
        raise CalibrationDataError(
            f"batch_size={args.batch_size} with image or audio rows needs a data_collator that batches them "
            "(pixel layouts differ between models); pass data_collator=, or batch_size=1"
        )
    picked = [
        (_preprocessed(rows[i], media, _row_where(rows, where, i)), _row_where(rows, where, i))
        for i in order[: args.num_calibration_samples]
    ]
    if not picked:
        raise CalibrationDataError(f"{where} is empty: it has no rows; pass a dataset with rows in it")
    inputs = forward_inputs(model)
    batches = PreparedBatches()
    for start in range(0, len(picked), size):
        group = picked[start : start + size]
        batch = _collate([r for r, _ in group], media, group[0][1])
        batches.append(_checked(batch, inputs, type(model).__name__, group[0][1], args.max_seq_length))
    return dataclasses.replace(args, dataset=batches)


def _preprocessed(row: Any, media: MediaArgs, where: str) -> dict[str, Any]:
    if media.preprocessing_func is not None:
        row = media.preprocessing_func(dict(row))
    if not isinstance(row, Mapping):
        raise CalibrationDataError(f"{where}: expected a dict of model inputs (input_ids, pixel_values, ...), got "
                                   f"a {type(row).__name__}; map the rows through the processor first")  # fmt: skip
    return dict(row)


def _collate(rows: list[dict[str, Any]], media: MediaArgs, where: str) -> dict[str, Any]:
    """One batch: the collator's, else the one row's values as tensors (sequences given a batch dimension)."""
    if media.collator is not None:
        batch = media.collator(rows)
        if not isinstance(batch, Mapping):
            raise CalibrationDataError(f"{where}: data_collator returned a {type(batch).__name__}; it must return "
                                       "a dict of tensors such as {'input_ids': ..., 'pixel_values': ...}")  # fmt: skip
        return dict(batch)
    out = {}
    for key, value in rows[0].items():
        try:
            tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise CalibrationDataError(
                f"{where}: column {key!r} holds a {type(value).__name__}, not numbers the model can take; remove "
                "it (Dataset.map(..., remove_columns=...)) or turn it into model inputs with the processor"
            ) from None
        out[key] = tensor[None] if key in _SEQUENCE_KEYS and tensor.dim() == 1 else tensor
    return out


def _checked(
    batch: dict[str, Any], inputs: set[str], model_name: str, where: str, limit: int
) -> dict[str, Any]:
    """``batch`` after checking that the forward takes each key and no sequence passes ``max_seq_length``."""
    for key, value in batch.items():
        if key not in inputs:
            what = "image or audio inputs" if key in MEDIA_KEYS else "an input"
            raise CalibrationDataError(
                f"{where}: column {key!r} is {what} that {model_name}.forward does not take; remove the column, "
                f"or calibrate a model that takes it (forward inputs: {', '.join(sorted(inputs))})"
            )
        if not isinstance(value, torch.Tensor):
            raise CalibrationDataError(f"{where}: {key!r} is a {type(value).__name__}, not a tensor; make the "
                                       "data_collator return tensors")  # fmt: skip
        if key in _SEQUENCE_KEYS and value.dim() >= 2 and value.shape[1] > limit:
            raise CalibrationDataError(
                f"{where}: {key!r} has {value.shape[1]} positions, more than max_seq_length={limit}, and cutting "
                "them would cut image or audio tokens; raise max_seq_length or truncate in the processor"
            )
    if not any(k in batch for k in ("input_ids", "decoder_input_ids", "inputs_embeds")):
        raise CalibrationDataError(f"{where}: the batch has no input_ids (keys: {sorted(batch)}); map the rows "
                                   "through the processor so that they hold the tokenized text")  # fmt: skip
    return batch


def text_only_note(model: torch.nn.Module, args: DataArgs | None) -> str | None:
    """The note for a model that takes images or audio calibrated on text alone (allowed, but said)."""
    if args is None or not takes_media(model):
        return None
    if isinstance(args.dataset, PreparedBatches) and any(MEDIA_KEYS & set(b) for b in args.dataset):
        return None
    return (
        f"{type(model).__name__} takes images or audio, but it was calibrated on text alone: its vision or "
        "audio path saw no calibration data; give rows mapped through its processor to calibrate with them"
    )
