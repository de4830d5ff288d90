"""``oneshot``'s two multimodal hooks: before calibrating (batches, checks) and after saving (the processor).

Example:
    >>> media = prepare_media(data_args, model, MediaArgs(data_collator=collate), processor, source)  # doctest: +SKIP
    >>> finish_media(media, "out")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from seqcal.data.args import CalibrationDataError, DataArgs, PreparedBatches, _dataset_kind
from seqcal.data.sources import _ROW_READERS, _row_where
from seqcal.multimodal.classes import fix_forward
from seqcal.multimodal.inputs import (
    MEDIA_KEYS,
    MediaArgs,
    _checked,
    forward_inputs,
    text_only_note,
    with_media_batches,
)
from seqcal.multimodal.processor import PROCESSOR_FILES, has_processor, load_processor, save_processor
from seqcal.multimodal.rows import MEDIA_COLUMNS, batches, is_media_row, media_rows, sampling_rate

logger = logging.getLogger("seqcal")
# Files whose rows may hold raw images or audio (JSON rows; a dataset folder is read as well).
_ROW_FILES = (".jsonl", ".json", ".parquet")


@dataclass
class MediaRun:
    """What the multimodal hooks hand from before calibration to after it.

    Args:
        data_args: the calibration data, with ready batches for image or audio rows.
        processor: the processor object to save with the checkpoint (None: copy files from ``source``).
        source: the directory the model's processor files are copied from, or None.
        notes: lines for the log and the report (a model that takes images calibrated on text alone).
    """

    data_args: DataArgs | None
    processor: Any = None
    source: Path | None = None
    notes: tuple[str, ...] = ()


def prepare_media(
    data_args: DataArgs | None, model: torch.nn.Module, media: MediaArgs, processor: Any, source: Path | None
) -> MediaRun:
    """Batches for image or audio rows, checked against the model before any weight is read or written.

    Args:
        data_args: the calibration data (None: a data-free run).
        model: the loaded model.
        media: the data collator and preprocessing function.
        processor: the processor object given, or None.
        source: the directory that may hold the processor's files.

    Returns:
        The ``MediaRun`` whose ``data_args`` the pipeline calibrates on.

    Raises:
        CalibrationDataError: rows with images or audio and no processor to save beside the checkpoint, or
            any error of ``with_media_batches`` (a column the forward does not take, a text-only model).
    """
    fix_forward(model)  # a transformers bug in the model's own forward, which calibration's checks call
    if media.given and data_args is None:
        raise CalibrationDataError("data_collator / preprocessing_func were given to a data-free run; drop them "
                                   "or use pipeline='sequential' with a dataset")  # fmt: skip
    if not media.given:  # a collator or preprocessing function maps the rows itself (llm-compressor's route)
        data_args = own_route(data_args, model, processor, source)
    data_args = with_media_batches(data_args, model, media)
    carries = isinstance(getattr(data_args, "dataset", None), PreparedBatches) and any(
        MEDIA_KEYS & set(b) for b in data_args.dataset
    )
    if carries and not has_processor(processor, source):
        where = f"the directory {str(source)!r}" if source is not None else "the loaded model"
        raise CalibrationDataError(
            f"the calibration rows carry images or audio, but {where} has no processor "
            f"({', '.join(PROCESSOR_FILES[:2])}) and none was given, so the checkpoint could not be used on such "
            "inputs; pass processor= (the model's processor object or its directory)"
        )
    note = text_only_note(model, data_args)
    if note:
        logger.warning("seqcal: %s", note)
    return MediaRun(data_args, processor, source, (note,) if note else ())


def own_route(
    data_args: DataArgs | None, model: torch.nn.Module, processor: Any, source: Path | None
) -> DataArgs | None:
    """``data_args`` with raw image or audio rows (``seqcal.multimodal.rows``) turned into ready batches.

    Args:
        data_args: the calibration data (returned unchanged unless its rows hold raw images or audio).
        model: the loaded model (its forward's inputs are checked against every batch key).
        processor: the processor object given, or None: the one in ``source``.
        source: the directory that may hold the processor's files.

    Returns:
        ``data_args``, or a copy whose dataset is a ``PreparedBatches``.

    Raises:
        CalibrationDataError: no processor, a missing or unreadable image or audio file (named with its row),
            a row the processor cannot process, a batch key the forward does not take.
    """
    found = _raw_rows(data_args)
    if found is None:
        return data_args
    rows, where, base = found
    processor = processor if processor is not None else _load_processor(source)
    order = list(range(len(rows)))
    if data_args.shuffle_calibration_samples:
        random.Random(data_args.seed).shuffle(order)
    picked = order[: data_args.num_calibration_samples]
    loaded = media_rows([rows[i] for i in picked], [_row_where(rows, where, i) for i in picked], base,
                        sampling_rate(processor), data_args.text_column)  # fmt: skip
    size = data_args.batch_size if isinstance(data_args.batch_size, int) else 1
    inputs, name = forward_inputs(model), type(model).__name__
    ready = PreparedBatches()
    for batch in batches(loaded, processor, model, size):
        where_ = f"{where} (batch {len(ready)})"
        ready.append(_checked(batch, inputs, name, where_, data_args.max_seq_length))
    return dataclasses.replace(data_args, dataset=ready)


def _raw_rows(data_args: DataArgs | None) -> tuple[Any, str, Path | None] | None:
    """(rows, where, the folder relative paths are read from) when the rows hold raw images or audio."""
    if data_args is None:
        return None
    dataset = data_args.dataset
    kind = _dataset_kind(dataset)
    path = Path(str(dataset)).expanduser() if kind == "path" else None
    if path is not None and not (path.is_dir() or path.suffix.lower() in _ROW_FILES and path.is_file()):
        return None  # text files, Hub names, 'default' (a Hub dataset with images: pass it as a Dataset)
    if kind == "hf":
        first = dataset[next(iter(dataset))] if type(dataset).__name__ == "DatasetDict" else dataset
        if not (set(first.column_names) & {"messages", *MEDIA_COLUMNS}):
            return None
    elif kind not in ("path", "list"):
        return None
    rows, where = _ROW_READERS[kind](data_args)
    scan = rows if kind != "hf" else [rows[0]] if len(rows) else []
    if not any(is_media_row(r) for r in scan):
        return None
    return rows, where, (path.parent.resolve() if path is not None and path.is_file() else None)


def trace_inputs(
    dataset: str | None, model_arg: str, dtype: str, max_seq_length: int
) -> tuple[Any, Any, Any]:
    """For ``seqcal trace --dataset rows.jsonl``: (model, the sample to trace: the first row alone, the batch
    to check the partition on: the first two rows in one batch) when the file holds image or audio rows, the
    model loaded with its own class and the rows through its directory's processor; else (None, None, None).

    Args:
        dataset: the ``--dataset`` file (None: text).
        model_arg: the ``--model`` directory, Hub id or 'default'.
        dtype: "float32", "bfloat16" or "float16".
        max_seq_length: the longest sequence allowed.
    """
    path = Path(dataset) if dataset else None
    if path is None or path.suffix.lower() != ".jsonl" or not path.is_file():
        return None, None, None
    args = DataArgs(str(path), 2, max_seq_length, 1, shuffle_calibration_samples=False)
    if _raw_rows(args) is None:
        return None, None, None
    from seqcal.models import resolve_model
    from seqcal.multimodal.classes import from_pretrained

    source = Path(resolve_model(model_arg))
    model = from_pretrained(str(source), getattr(torch, dtype)).eval()
    sample = own_route(args, model, None, source).dataset[0]
    check = own_route(dataclasses.replace(args, batch_size=2), model, None, source).dataset[0]
    return model, sample, check


def media_lengths(
    dataset: str | None, model_arg: str, num_samples: int, max_seq_length: int
) -> list[int] | None:
    """For ``seqcal plan --dataset rows.jsonl``: each calibration row's length in tokens, its images' or audio's
    placeholder tokens included (the processor in the model's directory expands them), or None when the file
    holds no image or audio rows. Reads no weights: the model is built on the meta device from its config.

    Args:
        dataset: the ``--dataset`` file (None: text).
        model_arg: the ``--model`` directory, Hub id or 'default'.
        num_samples: the rows calibration would take (the first ones, as ``seqcal oneshot`` takes them).
        max_seq_length: the longest sequence allowed (a longer row is refused as calibration refuses it).

    Raises:
        CalibrationDataError: as calibration raises it (a missing image, no processor, a row too long).
    """
    path = Path(dataset) if dataset else None
    if path is None or path.suffix.lower() not in _ROW_FILES or not path.is_file():
        return None
    args = DataArgs(str(path), num_samples, max_seq_length, 1, shuffle_calibration_samples=False)
    if _raw_rows(args) is None:
        return None
    from transformers import AutoConfig

    from seqcal.models import resolve_model
    from seqcal.multimodal.classes import build

    source = Path(resolve_model(model_arg))
    with torch.device("meta"):
        model = build(AutoConfig.from_pretrained(source), torch.float32)
    ready = own_route(args, model, None, source).dataset
    return [int(next(b[k] for k in ("input_ids", "decoder_input_ids") if k in b).shape[-1]) for b in ready]


def _load_processor(source: Path | None) -> Any:
    if not has_processor(None, source):
        where = f"the directory {str(source)!r}" if source is not None else "the loaded model"
        raise CalibrationDataError(
            f"the calibration rows hold images or audio, but {where} has no processor "
            f"({', '.join(PROCESSOR_FILES[:2])}) to turn them into model inputs; pass processor= (the model's "
            "processor object or its directory)"
        )
    return load_processor(source)


def finish_media(run: MediaRun, output_dir: str | Path) -> None:
    """Write the processor beside the checkpoint in ``output_dir`` (logged with the files written)."""
    written = save_processor(run.processor, run.source, output_dir)
    if written:
        logger.info("seqcal: processor files written with the checkpoint: %s", ", ".join(written))
