"""``oneshot``'s two multimodal hooks: before calibrating (batches, checks) and after saving (the processor).

Example:
    >>> media = prepare_media(data_args, model, MediaArgs(data_collator=collate), processor, source)  # doctest: +SKIP
    >>> finish_media(media, "out")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from seqcal.data.args import CalibrationDataError, DataArgs, PreparedBatches
from seqcal.multimodal.inputs import MEDIA_KEYS, MediaArgs, text_only_note, with_media_batches
from seqcal.multimodal.processor import PROCESSOR_FILES, has_processor, save_processor

logger = logging.getLogger("seqcal")


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
    if media.given and data_args is None:
        raise CalibrationDataError("data_collator / preprocessing_func were given to a data-free run; drop them "
                                   "or use pipeline='sequential' with a dataset")  # fmt: skip
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


def finish_media(run: MediaRun, output_dir: str | Path) -> None:
    """Write the processor beside the checkpoint in ``output_dir`` (logged with the files written)."""
    written = save_processor(run.processor, run.source, output_dir)
    if written:
        logger.info("seqcal: processor files written with the checkpoint: %s", ", ".join(written))
