"""Calibration data: files, Python lists, HF datasets, token tensors or a DataLoader -> padded batches.

``load_calibration_batches(DataArgs(...), tokenizer)`` returns ``list[dict]`` whose ``input_ids`` and
``attention_mask`` are LongTensors ``[B, T]``, ready for ``model(**batch)``. Every step is deterministic:

1. read the dataset into rows (a paragraph, a JSON/CSV/Parquet row, a conversation, a token sequence);
2. shuffle the row *order* with ``random.Random(seed)`` before converting any row, so a large dataset
   costs only the rows that are used;
3. convert rows in that order, skipping empty ones, until ``num_calibration_samples`` samples are found
   (``concatenate=True``: until the joined text fills that many windows of ``max_seq_length`` tokens);
4. tokenize, truncating to ``max_seq_length``, and pad each run of ``batch_size`` samples to its longest.

``datasets`` and ``pyarrow`` are optional and imported only when a Hub name, a saved dataset folder or a
``.parquet`` file needs them.

Example:
    >>> args = DataArgs("default", num_calibration_samples=4, max_seq_length=64, batch_size=2)
    >>> [b["input_ids"].shape for b in load_calibration_batches(args, tokenizer)]
    [torch.Size([2, 64]), torch.Size([2, 64])]
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.resources
import json
import logging
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

ACCEPTED = (
    "'default' (the embedded text), a local file (.txt/.text/.raw/.md: paragraphs at blank lines; "
    ".jsonl/.json/.csv/.parquet: rows with a text column or 'messages'), a folder saved with "
    "datasets' save_to_disk, a Hugging Face Hub dataset name, a datasets.Dataset or DatasetDict, a list of "
    "strings / chat conversations / row dicts / token-id lists, a dict of columns or {'input_ids': ...}, "
    "an integer tensor of token ids [N, T] or [T], or a torch DataLoader of {'input_ids', 'attention_mask'} "
    "batches"
)
# Fragments shorter than this (captions, "References", stray list items) calibrate nothing useful.
MIN_PARAGRAPH_CHARS = 32
# WikiText section titles: " = Title = ", " = = Subtitle = = ".
_HEADING = re.compile(r"^\s*(=+)\s.*\s\1\s*$")
_SPLIT = re.compile(r"^(?P<name>[\w.-]+)?(?:\[(?P<start>-?\d+%?)?:(?P<stop>-?\d+%?)?\])?$")


class CalibrationDataError(ValueError):
    """The calibration dataset cannot be turned into batches; the message says where and what is valid."""


@dataclasses.dataclass(frozen=True)
class DataArgs:
    """Where calibration data comes from and how it is cut into batches (llm-compressor's keyword names).

    Args:
        dataset: any of ``ACCEPTED`` (a file path, "default", a Hub name, a list, a Dataset, tensors, ...).
        num_calibration_samples: samples (``concatenate``: windows) to use, taken after shuffling.
        max_seq_length: tokens per sample at most (``concatenate``: exactly).
        batch_size: samples per batch; a batch is padded to its longest sample.
        shuffle_calibration_samples: shuffle rows with ``random.Random(seed)`` before selecting.
        text_column: column holding the text in row-shaped data (JSON, CSV, Parquet, HF datasets).
        splits: HF split to use: ``"train"``, ``"train[:512]"``, ``"validation[:10%]"`` or
            ``{"calibration": "train"}``; None picks "calibration", then "train", then the only split.
        seed: shuffling seed.
        concatenate: join texts with blank lines and cut full windows of ``max_seq_length`` tokens
            (the GPTQ paper's WikiText/C4 recipe) instead of one sample per row.
        dataset_config_name: HF dataset configuration, e.g. ``"wikitext-2-raw-v1"``.

    Example:
        >>> DataArgs("calib.jsonl", num_calibration_samples=128, max_seq_length=512, text_column="content")
    """

    dataset: Any
    num_calibration_samples: int = 512
    max_seq_length: int = 2048
    batch_size: int = 1
    shuffle_calibration_samples: bool = True
    text_column: str = "text"
    splits: str | dict[str, str] | None = None
    seed: int = 42
    concatenate: bool = False
    dataset_config_name: str | None = None

    def __post_init__(self) -> None:
        for name, example in (("num_calibration_samples", 512), ("max_seq_length", 2048), ("batch_size", 1)):
            value = getattr(self, name)
            _require(
                _is_int(value) and value > 0,
                f"DataArgs.{name} must be a positive int, got {value!r}; e.g. {name}={example}",
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


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class _Sample:
    text: str | None = None
    ids: list[int] | None = None
    chat: bool = False  # rendered by a chat template, which already holds BOS: add no special tokens


def default_calibration_text() -> str:
    """The embedded offline calibration text: original encyclopedic English prose, ~46 KB.

    Returns:
        Paragraphs separated by blank lines (history, science, geography, technology, literature).

    Example:
        >>> len(default_calibration_text().split("\\n\\n")) > 50
        True
    """
    return importlib.resources.files("seqcal.assets").joinpath("calibration.txt").read_text(encoding="utf-8")


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
        s for i in order if (s := _to_sample(rows[i], f"{where}, row {i}", args, tokenizer)) is not None
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
        logger.warning("%s gives %d calibration samples, fewer than the %d requested; using those",
                       where, len(seqs), args.num_calibration_samples)  # fmt: skip
    side = getattr(tokenizer, "padding_side", "right")
    return [
        _collate(seqs[i : i + args.batch_size], pad_id, side) for i in range(0, len(seqs), args.batch_size)
    ]


# ---- what the dataset is -------------------------------------------------------------------------------


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


# ---- rows from each kind of dataset --------------------------------------------------------------------


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs without heading lines, fragments under MIN_PARAGRAPH_CHARS dropped."""
    out = []
    for block in re.split(r"\n[ \t\r\f\v]*\n", text):
        para = "\n".join(line.rstrip() for line in block.split("\n") if not _HEADING.match(line)).strip()
        if len(para) >= MIN_PARAGRAPH_CHARS:
            out.append(para)
    return out


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise CalibrationDataError(f"{path}:{n}: not valid JSON ({err.msg}); JSON lines hold one object "
                                           'per line, e.g. {"text": "..."}') from err  # fmt: skip
    return rows


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
    return _paragraphs(path.read_text(encoding="utf-8"))


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
    datasets = _import_datasets(
        f"dataset {name!r} is not a local file, so it would come from the Hugging Face Hub; that"
    )
    try:
        loaded = datasets.load_dataset(name, args.dataset_config_name, split=_split_spec(args.splits))
    except ConnectionError as err:
        raise ConnectionError(
            f"cannot load dataset {name!r} from the Hugging Face Hub: this machine is offline or HF_HUB_OFFLINE=1 "
            f"is set ({err}). Pass a local file instead, e.g. dataset='calib.txt' (paragraphs separated by blank "
            f"lines) or dataset='calib.jsonl' with a {args.text_column!r} field per line, or dataset='default'"
        ) from err
    return _hf_rows(loaded, args, sliced=args.splits is not None)


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


# ---- rows -> samples -> token sequences ----------------------------------------------------------------


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


# ---- batches -------------------------------------------------------------------------------------------


def _pad_id(args: DataArgs, tokenizer: Any) -> int:
    """Padding id: pad_token_id, else eos_token_id; checked up front when batches may need padding."""
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else getattr(tokenizer, "eos_token_id", None)
    if pad is None and args.batch_size > 1 and not args.concatenate:
        raise CalibrationDataError(
            f"batch_size={args.batch_size} pads samples to the longest, but the tokenizer has neither a "
            "pad_token nor an eos_token; set tokenizer.pad_token (e.g. to an existing special token) or use "
            "batch_size=1"
        )
    side = getattr(tokenizer, "padding_side", "right")
    if side not in ("left", "right"):
        raise CalibrationDataError(f"tokenizer.padding_side is {side!r}; expected 'left' or 'right'")
    return 0 if pad is None else int(pad)  # 0 is never written: batch_size == 1 or equal-length windows


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
