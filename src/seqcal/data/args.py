"""What calibration data to use and how to cut it: ``DataArgs`` and the checks it runs on construction.

The base of ``seqcal.data``: ``sources`` (reading rows) and ``batches`` (rows -> padded batches) import
from here, and nothing here imports them back.

Example:
    >>> DataArgs("calib.jsonl", num_calibration_samples=128, max_seq_length=512).max_seq_length
    512
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from seqcal.data.autobatch import AUTO, BatchLimits
from seqcal.errors import SeqcalError

ACCEPTED = (
    "'default' (the embedded text), a local file (.txt/.text/.raw/.md: paragraphs at blank lines; "
    ".jsonl/.json/.csv/.parquet: rows with a text column or 'messages'), a folder saved with "
    "datasets' save_to_disk, a Hugging Face Hub dataset name, a datasets.Dataset or DatasetDict, a list of "
    "strings / chat conversations / row dicts / token-id lists, a dict of columns or {'input_ids': ...}, "
    "an integer tensor of token ids [N, T] or [T], or a torch DataLoader of {'input_ids', 'attention_mask'} "
    "batches"
)
_SPLIT = re.compile(r"^(?P<name>[\w.-]+)?(?:\[(?P<start>-?\d+%?)?:(?P<stop>-?\d+%?)?\])?$")


class CalibrationDataError(SeqcalError, ValueError):
    """The calibration dataset cannot be turned into batches; the message says where and what is valid."""


class PreparedBatches(list):
    """Batches built and checked already (image or audio rows, ``seqcal.multimodal.inputs``): used as they are."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _hf_class(obj: Any) -> str | None:
    """The class name of an object of the optional `datasets` package (found without importing it)."""
    return type(obj).__name__ if type(obj).__module__.split(".")[0] == "datasets" else None


def _dataset_kind(dataset: Any) -> str:
    if isinstance(dataset, (str, Path)):
        _require(bool(str(dataset).strip()), f"DataArgs.dataset is an empty string; accepted: {ACCEPTED}")
        return "path"
    if isinstance(dataset, DataLoader):
        return "loader"
    if _hf_class(dataset) in ("Dataset", "DatasetDict"):
        return "hf"
    if isinstance(dataset, (list, tuple)):
        return "list"
    if isinstance(dataset, (Mapping, torch.Tensor)):
        return "tokens"
    hint = (
        " (streaming datasets are not supported: load without streaming=True)" if _hf_class(dataset) else ""
    )
    raise CalibrationDataError(
        f"DataArgs.dataset: cannot use a {type(dataset).__name__}{hint}; accepted: {ACCEPTED}"
    )


def _split_spec(splits: str | dict[str, str] | None) -> str | None:
    """The split string to load, from llm-compressor's ``splits`` (a str or {"calibration": ...})."""
    spec = splits
    if isinstance(splits, Mapping):
        if "calibration" not in splits and len(splits) != 1:
            raise ValueError(f"DataArgs.splits {splits!r}: a dict needs a 'calibration' key or exactly one entry, "
                             "e.g. {'calibration': 'train[:512]'}")  # fmt: skip
        spec = splits.get("calibration", next(iter(splits.values())))
    if spec is not None and (not isinstance(spec, str) or not _SPLIT.match(spec)):
        raise ValueError(f"DataArgs.splits: {spec!r} is not a split; expected 'NAME', 'NAME[A:B]' or 'NAME[:N%]', "
                         "e.g. 'train[:512]'")  # fmt: skip
    return spec


@dataclasses.dataclass(frozen=True)
class DataArgs:
    """Where calibration data comes from and how it is cut into batches (llm-compressor's keyword names).

    Args:
        dataset: any of ``ACCEPTED`` (a file path, "default", a Hub name, a list, a Dataset, tensors, ...).
        num_calibration_samples: samples (``concatenate``: windows) to use, taken after shuffling.
        max_seq_length: tokens per sample at most (``concatenate``: exactly).
        batch_size: samples per batch; a batch is padded to its longest sample. ``"auto"``: samples grouped
            by length (right-padded by at most 1/8 of their tokens), as many per batch as ``batch_limits``
            allow (``seqcal.data.autobatch``); a DataLoader's batches are used as they come.
        shuffle_calibration_samples: shuffle rows with ``random.Random(seed)`` before selecting.
        text_column: column holding the text in row-shaped data (JSON, CSV, Parquet, HF datasets).
        splits: HF split to use: ``"train"``, ``"train[:512]"``, ``"validation[:10%]"`` or
            ``{"calibration": "train"}``; None picks "calibration", then "train", then the only split.
        seed: shuffling seed.
        concatenate: join texts with blank lines and cut full windows of ``max_seq_length`` tokens
            (the GPTQ paper's WikiText/C4 recipe) instead of one sample per row.
        dataset_config_name: HF dataset configuration, e.g. ``"wikitext-2-raw-v1"``.
        batch_limits: the caps of ``batch_size="auto"`` (``oneshot`` derives them from the memory budget);
            None: ``BatchLimits()``'s conservative defaults.

    Example:
        >>> DataArgs("calib.jsonl", num_calibration_samples=128, max_seq_length=512, text_column="content")
    """

    dataset: Any
    num_calibration_samples: int = 512
    max_seq_length: int = 2048
    batch_size: int | str = 1
    shuffle_calibration_samples: bool = True
    text_column: str = "text"
    splits: str | dict[str, str] | None = None
    seed: int = 42
    concatenate: bool = False
    dataset_config_name: str | None = None
    batch_limits: BatchLimits | None = None

    def __post_init__(self) -> None:
        for name, example in (("num_calibration_samples", 512), ("max_seq_length", 2048)):
            value = getattr(self, name)
            _require(
                _is_int(value) and value > 0,
                f"DataArgs.{name} must be a positive int, got {value!r}; e.g. {name}={example}",
            )
        _require(
            self.batch_size == AUTO or (_is_int(self.batch_size) and self.batch_size > 0),
            f"DataArgs.batch_size must be a positive int or {AUTO!r}, got {self.batch_size!r}; e.g. batch_size=8 "
            f"or batch_size={AUTO!r} (sized by the memory budget)",
        )
        _require(
            self.batch_limits is None or isinstance(self.batch_limits, BatchLimits),
            f"DataArgs.batch_limits must be a seqcal.data.autobatch.BatchLimits or None, got {self.batch_limits!r}",
        )
        _require(_is_int(self.seed), f"DataArgs.seed must be an int, got {self.seed!r}; e.g. seed=42")
        for name in ("shuffle_calibration_samples", "concatenate"):
            _require(
                isinstance(getattr(self, name), bool),
                f"DataArgs.{name} must be True or False, got {getattr(self, name)!r}",
            )
        _require(
            isinstance(self.text_column, str) and bool(self.text_column),
            f"DataArgs.text_column must be a non-empty column name, got {self.text_column!r}",
        )
        _require(
            self.dataset_config_name is None or isinstance(self.dataset_config_name, str),
            f"DataArgs.dataset_config_name must be a str or None, got {self.dataset_config_name!r}",
        )
        _split_spec(self.splits)
        _dataset_kind(self.dataset)
