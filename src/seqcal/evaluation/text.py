"""The evaluation text: a WikiText raw split as the Hugging Face dataset joins it, cut into token windows.

``load_eval_text`` reads the split as ``"\\n\\n".join(dataset["text"])`` (blank rows put back where a copy of the
file dropped them); ``token_windows`` tokenizes it once and cuts non-overlapping windows, as GPTQ's evaluation does.
``seqcal.evaluation.perplexity`` scores the windows.

Example:
    >>> windows = token_windows(tokenizer, load_eval_text("../shared/data/wiki.test.raw"), 2048)  # doctest: +SKIP
    >>> windows.shape  # doctest: +SKIP
    torch.Size([148, 2048])
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def load_eval_text(path: str | os.PathLike[str]) -> str:
    """Read a WikiText raw split as the string ``"\\n\\n".join(dataset["text"])`` of the Hugging Face dataset.

    HF ``wikitext`` rows are the raw file's lines: a non-blank row keeps its ``"\\n"``, a blank one is ``""``.
    A file with blank lines (the original ``wiki.*.raw``) is one row per line. A file without any (blank rows
    dropped, e.g. ``shared/data/wiki.test.raw``) gets them back by WikiText's layout: one blank row before
    and after each ``= heading =``, one more before each article title but the first. For wikitext-2 test
    that is 4,364 rows (HF: 4,358), a dozen newlines off in 1.29 M characters. CRLF reads as LF.

    Args:
        path: a WikiText raw text file (UTF-8).

    Returns:
        The evaluation text.

    Raises:
        FileNotFoundError: ``path`` is not a file.

    Example:
        >>> text = load_eval_text("../shared/data/wiki.test.raw")
        >>> text[:30]
        '\\n\\n = Robert Boulter = \\n\\n\\n\\n\\n Rob'
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"seqcal.evaluation.text.load_eval_text: {path} is not a file. Pass a WikiText raw split such as "
            "../shared/data/wiki.test.raw (the perplexity evaluation text)."
        )
    text = path.read_text(encoding="utf-8")  # text mode: CRLF reads as "\n", as the HF loader reads it
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()  # the final newline ends the last row; it does not start another
    if lines and all(line.strip() for line in lines):
        lines = _reinsert_blank_rows(lines)
    return "\n\n".join(line + "\n" if line.strip() else "" for line in lines)


def _heading_level(line: str) -> int:
    """``= = Title = =`` -> 2; 0 for a line that is not a WikiText heading."""
    words = line.strip().split(" ")
    level = 0
    while level < len(words) and words[level] == "=":
        level += 1
    is_heading = 0 < level and len(words) > 2 * level and all(w == "=" for w in words[-level:])
    return level if is_heading else 0


def _reinsert_blank_rows(lines: list[str]) -> list[str]:
    """Blank rows around headings, as in the splits that keep them (rule read off wiki.valid.raw)."""
    rows: list[str] = []
    for line in lines:
        level = _heading_level(line)
        if not level:
            rows.append(line)
            continue
        if level == 1 and rows:
            rows.append("")  # articles are separated by one more blank row
        rows.extend(("", line, ""))
    return rows


def token_windows(tokenizer: Any, text: str, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Tokenize ``text`` once and cut it into non-overlapping windows, dropping the last partial one.

    Args:
        tokenizer: a Hugging Face tokenizer, called with its defaults (special tokens as it adds them).
        text: the evaluation text; seq_len: tokens per window; max_windows: keep only the first ones.

    Returns:
        Token ids, shape ``(windows, seq_len)``, int64. Raises ValueError if not one window long.

    Example:
        >>> token_windows(tokenizer, text, 2048).shape
        torch.Size([148, 2048])
    """
    # verbose=False: the whole split is longer than model_max_length on purpose; no warning about it.
    ids = torch.as_tensor(tokenizer(text, verbose=False)["input_ids"], dtype=torch.long)  # (N,)
    if ids.dim() != 1:
        raise ValueError(
            f"seqcal.evaluation.text.token_windows: the tokenizer returned ids of shape {tuple(ids.shape)} for one "
            "string; expected a flat list. Pass a Hugging Face tokenizer and a single str."
        )
    count = ids.numel() // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    if count == 0:
        raise ValueError(
            f"seqcal.evaluation.text.token_windows: the text has {ids.numel()} tokens, fewer than seq_len={seq_len}; "
            "pass a longer text or a smaller seq_len."
        )
    return ids[: count * seq_len].view(count, seq_len)  # (W, T)
