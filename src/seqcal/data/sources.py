"""Calibration data sources: what a ``DataArgs.dataset`` is, and its rows, before any row is converted.

A row is what one sample comes from: a paragraph of a text file, a JSON/CSV/Parquet row, a row of an HF
dataset (the requested split, cut to its ``[A:B]`` window), a conversation, or a token sequence. The
readers are literal registries (``_FILE_READERS`` by file extension, ``_ROW_READERS`` by dataset kind).
``seqcal.data.batches`` turns rows into samples and batches; ``DataArgs`` and ``CalibrationDataError``
come from ``seqcal.data.args``.

Example:
    >>> rows, where = _ROW_READERS["list"](DataArgs(["Some text."]))
    >>> rows, where
    (['Some text.'], 'the dataset list')
"""

from __future__ import annotations

import csv
import importlib.resources
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from seqcal.data.args import (
    _SPLIT,
    CalibrationDataError,
    DataArgs,
    _hf_class,
    _is_int,
    _split_spec,
)

# Records keep the logger name users configure for calibration data, whichever module emits them.
logger = logging.getLogger("seqcal.data")

# Fragments shorter than this (captions, "References", stray list items) calibrate nothing useful.
MIN_PARAGRAPH_CHARS = 32
# WikiText section titles: " = Title = ", " = = Subtitle = = ".
_HEADING = re.compile(r"^\s*(=+)\s.*\s\1\s*$")


def default_calibration_text() -> str:
    """The embedded offline calibration text: original encyclopedic English prose, ~46 KB.

    Returns:
        Paragraphs separated by blank lines (history, science, geography, technology, literature).

    Example:
        >>> len(default_calibration_text().split("\\n\\n")) > 50
        True
    """
    return importlib.resources.files("seqcal.assets").joinpath("calibration.txt").read_text(encoding="utf-8")


# ---- what the dataset is -------------------------------------------------------------------------------


# ---- rows from each kind of dataset --------------------------------------------------------------------


def _paragraphs(text: str, min_chars: int = MIN_PARAGRAPH_CHARS) -> list[str]:
    """Blank-line separated paragraphs without heading lines, fragments under ``min_chars`` dropped."""
    out = []
    for block in re.split(r"\n[ \t\r\f\v]*\n", text):
        para = "\n".join(line.rstrip() for line in block.split("\n") if not _HEADING.match(line)).strip()
        if para and len(para) >= min_chars:
            out.append(para)
    return out


class _JsonLines(list):
    """The rows of a JSON lines file, with the file's line number of each row (blank lines are skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[int] = []


def _read_jsonl(path: Path) -> list[Any]:
    rows = _JsonLines()
    with path.open(encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not part of the first row
        n = 0
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rows.append(json.loads(line))
                rows.lines.append(n)
        except json.JSONDecodeError as err:
            raise CalibrationDataError(f"{path}:{n}: not valid JSON ({err.msg}); JSON lines hold one object "
                                       'per line, e.g. {"text": "..."}') from err  # fmt: skip
        except UnicodeDecodeError as err:
            raise CalibrationDataError(f"{path}:{n + 1}: not UTF-8 text ({err.reason}); is it the right file? "
                                       'JSON lines hold one object per line, e.g. {"text": "..."}') from err  # fmt: skip
    return rows


def _row_where(rows: Sequence[Any], where: str, i: int) -> str:
    """Where row ``i`` is, for messages: ``file:line`` for JSON lines, else ``where, row i``."""
    return f"{where}:{rows.lines[i]}" if isinstance(rows, _JsonLines) else f"{where}, row {i}"


def _columns_to_rows(data: Mapping) -> list[Any] | None:
    """{"text": [a, b]} -> [{"text": a}, {"text": b}]; None when ``data`` is not a dict of equal-length lists."""
    cols = list(data.values())
    if not cols or not all(isinstance(c, list) for c in cols) or len({len(c) for c in cols}) != 1:
        return None
    if _is_conversation(data.get("messages")):  # one chat row, not a column of messages
        return None
    return [dict(zip(data.keys(), values)) for values in zip(*cols)]


def _read_json(path: Path) -> list[Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # JSON lines saved under .json, as datasets' to_json writes them
            return _read_jsonl(path)
        raise CalibrationDataError(f"{path}: not valid JSON ({err}); expected a list of rows, a dict of "
                                   "columns, or one object per line") from err  # fmt: skip
    if isinstance(data, list):
        return data
    rows = _columns_to_rows(data) if isinstance(data, dict) else None
    return rows if rows is not None else [data]


def _read_csv(path: Path) -> list[Any]:
    with path.open(encoding="utf-8", newline="") as f:
        try:
            return list(csv.DictReader(f))
        except csv.Error as err:
            raise CalibrationDataError(f"{path}: cannot read as CSV ({err}); convert it to .jsonl "
                                       '(one {"text": ...} object per line)') from err  # fmt: skip


def _read_parquet(path: Path) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise CalibrationDataError(f"{path}: reading .parquet needs the optional package pyarrow "
                                   "(pip install pyarrow, or datasets which brings it); or convert the file "
                                   "to .jsonl") from err  # fmt: skip
    return pq.read_table(path).to_pylist()


def _read_text(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    paragraphs = _paragraphs(text)
    if paragraphs:
        return paragraphs
    # Only fragments (a one-line file): dropping them would leave nothing, so they are what there is to use.
    fragments = _paragraphs(text, min_chars=1)
    if fragments:
        logger.warning("%s: every paragraph is shorter than %d characters (%d bytes in all); calibrating on "
                       "them as they are", path, MIN_PARAGRAPH_CHARS, len(text.encode()))  # fmt: skip
    return fragments


_FILE_READERS: dict[str, Callable[[Path], list[Any]]] = {
    ".txt": _read_text,
    ".text": _read_text,
    ".raw": _read_text,  # WikiText's wiki.*.raw
    ".md": _read_text,
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".csv": _read_csv,
    ".parquet": _read_parquet,
}


def _import_datasets(what: str) -> Any:
    try:
        import datasets
    except ImportError as err:
        raise CalibrationDataError(
            f"{what} needs the optional package `datasets` (pip install datasets). Without it, pass a local "
            f"file ({', '.join(_FILE_READERS)}), a list of strings, or dataset='default'"
        ) from err
    return datasets


def _string_rows(args: DataArgs) -> tuple[Sequence[Any], str]:
    spec = str(args.dataset)
    if spec == "default":
        return _paragraphs(default_calibration_text()), "the embedded calibration text"
    path = Path(spec).expanduser()
    if path.is_file():
        reader = _FILE_READERS.get(path.suffix.lower())
        if reader is None:
            raise CalibrationDataError(f"{path}: unknown extension {path.suffix!r}; accepted: "
                                       f"{', '.join(_FILE_READERS)}")  # fmt: skip
        _warn_unused_splits(args, str(path))
        return reader(path), str(path)
    if path.is_dir():
        datasets = _import_datasets(f"dataset folder {path}")
        return _hf_rows(datasets.load_from_disk(str(path)), args, sliced=False), f"dataset folder {path}"
    suffix = path.suffix.lower()
    if isinstance(args.dataset, Path) or suffix in _FILE_READERS or suffix[1:].isalpha() or spec[:1] in "./~":
        raise FileNotFoundError(f"calibration dataset file {spec!r} does not exist (working folder: "
                                f"{Path.cwd()}); pass an existing {', '.join(_FILE_READERS)} file, a Hub dataset "
                                "name, or dataset='default'")  # fmt: skip
    return _hub_rows(spec, args), f"Hub dataset {spec!r}"


def _hub_rows(name: str, args: DataArgs) -> Sequence[Any]:
    """Rows of a Hub dataset, resolved as ``datasets.load_dataset`` resolves it.

    Online, and offline when ``datasets`` prepared it before (its own cache), ``load_dataset(name)`` does it.
    Offline otherwise, ``datasets`` does not look in the Hub file cache, so the cached snapshot of the
    repository (``hf download --repo-type dataset``, or an earlier download) is loaded as a local folder.
    """
    datasets = _import_datasets(
        f"dataset {name!r} is not a local file, so it would come from the Hugging Face Hub; that"
    )
    split = _split_spec(args.splits)
    try:
        loaded = datasets.load_dataset(name, args.dataset_config_name, split=split)
    except ConnectionError as err:
        loaded = datasets.load_dataset(
            str(_hub_snapshot(name, args, err)), args.dataset_config_name, split=split
        )
    return _hf_rows(loaded, args, sliced=args.splits is not None)


def _hub_snapshot(name: str, args: DataArgs, err: ConnectionError) -> Path:
    """The dataset's snapshot in the Hub cache, after ``datasets`` could not reach the Hub (``err``)."""
    from seqcal.models import hub

    try:
        return hub.snapshot(name, repo_type="dataset")
    except hub.HubError as missing:
        if not missing.offline:
            raise CalibrationDataError(str(missing)) from missing
        raise ConnectionError(
            f"cannot load dataset {name!r}: offline ({err}) and not in the Hugging Face Hub cache "
            f"({hub.hub_cache()}); run once online (or `hf download {name} --repo-type dataset`) to cache it. "
            f"Pass a local file instead, e.g. dataset='calib.txt' (paragraphs separated by blank lines) or "
            f"dataset='calib.jsonl' with a {args.text_column!r} field per line, or dataset='default'"
        ) from err


def _hf_rows(ds: Any, args: DataArgs, sliced: bool) -> Sequence[Any]:
    """A datasets.Dataset (rows are dicts): the requested split, cut to its ``[A:B]`` window."""
    spec = _split_spec(args.splits)
    match = _SPLIT.match(spec or "")
    if _hf_class(ds) == "DatasetDict":
        names = list(ds)
        default = next(
            (n for n in ("calibration", "train") if n in ds), names[0] if len(names) == 1 else None
        )
        name = match["name"] or default
        if name not in ds:
            raise CalibrationDataError(f"DatasetDict has no split {name!r} (splits: {names}); pass splits='NAME' "
                                       f"or splits={{'calibration': 'NAME[:512]'}} with NAME among {names}")  # fmt: skip
        ds = ds[name]
    if sliced or not (match["start"] or match["stop"]):
        return ds
    bounds = [None if b is None else round(len(ds) * int(b[:-1]) / 100) if b.endswith("%") else int(b)
              for b in (match["start"], match["stop"])]  # fmt: skip
    return ds.select(range(*slice(*bounds).indices(len(ds))))


def _warn_unused_splits(args: DataArgs, where: str) -> None:
    if args.splits is not None:
        logger.warning(
            "DataArgs.splits=%r is ignored for %s: splits select from HF datasets only", args.splits, where
        )


def _token_rows(args: DataArgs) -> tuple[Sequence[Any], str]:
    data = args.dataset
    if isinstance(data, Mapping) and "input_ids" not in data:
        rows = _columns_to_rows(data)
        if rows is None:
            raise CalibrationDataError(f"DataArgs.dataset dict with keys {sorted(data)}: expected "
                                       "{'input_ids': ...} or equal-length column lists like {'text': [...]}")  # fmt: skip
        return rows, "the dataset dict"
    ids = data["input_ids"] if isinstance(data, Mapping) else data
    mask = data.get("attention_mask") if isinstance(data, Mapping) else None
    if _as_ids(ids) is not None:  # one sequence [T]
        return [{"input_ids": ids, "attention_mask": mask}], "the token ids"
    if isinstance(ids, torch.Tensor) and ids.ndim != 2:
        raise CalibrationDataError(
            f"token ids of shape {list(ids.shape)}: expected an integer tensor [N, T] or [T]"
        )
    masks = [None] * len(ids) if mask is None else mask
    return [{"input_ids": i, "attention_mask": m} for i, m in zip(ids, masks)], "the token ids"


_ROW_READERS: dict[str, Callable[[DataArgs], tuple[Sequence[Any], str]]] = {
    "path": _string_rows,
    "list": lambda args: (list(args.dataset), "the dataset list"),
    "tokens": _token_rows,
    "hf": lambda args: (_hf_rows(args.dataset, args, sliced=False), f"the {type(args.dataset).__name__}"),
}


# ---- row shapes (also read by seqcal.data.batches when it converts rows) ---------------------------------------


def _is_conversation(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    )


def _as_ids(value: Any) -> list[int] | None:
    """A token sequence [T] as a list, or None when ``value`` is not one (a 2-D tensor, text, ...)."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise CalibrationDataError(f"token ids must be an integer tensor, got dtype {value.dtype}; "
                                       "pass input_ids as a LongTensor")  # fmt: skip
        return value.tolist() if value.ndim == 1 else None
    if isinstance(value, (list, tuple)) and all(_is_int(v) for v in value):
        return list(value)
    return None
