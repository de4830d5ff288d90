"""Calibration rows -> samples -> token sequences: a row as text, chat text or token ids, then the first
``num_calibration_samples`` of them tokenized (each cut at ``max_seq_length``), or, with ``concatenate=True``,
their joined text cut into whole windows of ``max_seq_length`` tokens; and why a dataset gave fewer than asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from seqcal.data.args import CalibrationDataError, DataArgs
from seqcal.data.sources import _HEADING, _as_ids, _is_conversation


@dataclasses.dataclass(frozen=True)
class _Sample:
    text: str | None = None
    ids: list[int] | None = None
    chat: bool = False  # rendered by a chat template, which already holds BOS: add no special tokens


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
