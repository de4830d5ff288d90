"""Calibration batches from a ``torch.utils.data.DataLoader``: taken in its own order until
``num_calibration_samples`` rows are covered, each checked (``input_ids [B, T]``, a mask of ones added when
missing) and cut at ``max_seq_length``; other keys kept as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from seqcal.data.args import CalibrationDataError, DataArgs

logger = logging.getLogger("seqcal.data")


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
