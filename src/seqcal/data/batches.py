"""Calibration data: files, Python lists, HF datasets, token tensors or a DataLoader -> padded batches.

``load_calibration_batches(DataArgs(...), tokenizer)`` returns ``list[dict]`` whose ``input_ids`` and
``attention_mask`` are LongTensors ``[B, T]``, ready for ``model(**batch)``. Every step is deterministic:

1. read the dataset into rows (a paragraph, a JSON/CSV/Parquet row, a conversation, a token sequence;
   ``seqcal.data.sources``);
2. shuffle the row *order* with ``random.Random(seed)`` before converting any row, so a large dataset
   costs only the rows that are used;
3. convert rows in that order, skipping empty ones, until ``num_calibration_samples`` samples are found
   (``concatenate=True``: until the joined text fills that many windows of ``max_seq_length`` tokens;
   ``seqcal.data.samples``);
4. tokenize, truncating to ``max_seq_length``, and pad each run of ``batch_size`` samples to its longest
   (``batch_size="auto"``: group samples of about equal length instead, ``seqcal.data.autobatch``).

A DataLoader's batches are taken as they come (``seqcal.data.loader``). ``datasets`` and ``pyarrow`` are optional and imported only when a Hub name, a saved dataset folder or a
``.parquet`` file needs them.

Example:
    >>> args = DataArgs("default", num_calibration_samples=4, max_seq_length=64, batch_size=2)
    >>> [b["input_ids"].shape for b in load_calibration_batches(args, tokenizer)]
    [torch.Size([2, 64]), torch.Size([2, 64])]
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from seqcal.data.args import ACCEPTED, CalibrationDataError, DataArgs, PreparedBatches, _dataset_kind
from seqcal.data.autobatch import AUTO, BatchLimits, group_by_length
from seqcal.data.loader import _loader_batches
from seqcal.data.samples import _first_n, _shortfall, _to_sample, _windows
from seqcal.data.sources import (
    _ROW_READERS,
    MIN_PARAGRAPH_CHARS,
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
