"""The per-layer error report of a quantization run: an aligned text table, and strict JSON on disk.

``format_error_table`` prints one row per subgraph and the modules with the largest GPTQ loss;
``write_error_report`` writes ``quantization_report.json`` into the checkpoint directory atomically. Both
are re-exported by ``seqcal.evaluation.perplexity``.

Example:
    >>> print(format_error_table({"modules": {"model.layers.0.mlp.down_proj": {"gptq_loss": 0.5}}}))
    top 1 of 1 modules by GPTQ loss
    module                        gptq loss  time (s)
    model.layers.0.mlp.down_proj        0.5         -
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from seqcal.checkpoint.writer import ERRORS_PNG as ERRORS_PNG  # re-exported: files of the output directory
from seqcal.checkpoint.writer import REPORT_FILENAME as REPORT_FILENAME
from seqcal.data.autobatch import describe_batches


def format_error_table(report: Mapping[str, Any], *, top: int = 10) -> str:
    """The per-layer error report as aligned text: one row per subgraph, then the worst modules.

    Every key is optional (a missing value prints ``-``). Modules rank by ``gptq_loss``, largest first; NaN
    ranks first, as it marks a failed solve.

    Args:
        report: ``{"subgraphs": [{"index", "targets", "rel_error", "seconds"}], "modules": {name:
            {"gptq_loss", "gptq_seconds"}}, "log": [str]}``; top: how many modules to list.

    Returns:
        The table text, no trailing newline.

    Example:
        >>> print(format_error_table({"subgraphs": [{"index": 0, "targets": ["model.layers.0"],
        ...     "rel_error": 0.012, "seconds": 0.5}]}))
        subgraph  target          rel error  time (s)
               0  model.layers.0  1.200e-02      0.50
                  total                          0.50
    """
    if not isinstance(report, Mapping):
        raise TypeError(
            f"seqcal.evaluation.perplexity.format_error_table: expected a dict report, got {type(report).__name__}."
        )
    sections = []
    subgraphs = [s if isinstance(s, Mapping) else {} for s in report.get("subgraphs") or []]
    if subgraphs:
        rows = [[_fmt(s.get("index"), "g"), _targets(s.get("targets"))] for s in subgraphs]
        for row, s in zip(rows, subgraphs):
            row += [_fmt(s.get("rel_error"), ".3e"), _fmt(s.get("seconds"), ".2f")]
        total = sum(v for s in subgraphs if (v := _as_float(s.get("seconds"))) is not None)
        rows.append(["", "total", "", f"{total:.2f}"])
        sections.append(_table(["subgraph", "target", "rel error", "time (s)"], rows, "r<rr"))
    modules = report.get("modules") or {}
    if isinstance(modules, Mapping) and modules:
        stats = {name: m if isinstance(m, Mapping) else {} for name, m in modules.items()}
        ranked = sorted(stats.items(), key=lambda kv: _rank(kv[1].get("gptq_loss")), reverse=True)[:top]
        rows = [
            [name, _fmt(m.get("gptq_loss"), ".4g"), _fmt(m.get("gptq_seconds"), ".2f")] for name, m in ranked
        ]
        title = f"top {len(ranked)} of {len(stats)} modules by GPTQ loss"
        sections.append(title + "\n" + _table(["module", "gptq loss", "time (s)"], rows, "<rr"))
    batches = report.get("batches")
    if isinstance(batches, Mapping) and batches.get("samples"):
        sections.append(f"calibration: {describe_batches(batches)}")
    return "\n\n".join(sections) if sections else "(empty error report: no subgraphs and no modules)"


def _as_float(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _fmt(value: Any, spec: str) -> str:
    number = _as_float(value)
    if number is None:
        return "-" if value is None else str(value)
    return format(number, spec)


def _targets(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "-"
    return "-" if value is None else str(value)


def _rank(loss: Any) -> float:
    number = _as_float(loss)
    if number is None:
        return -math.inf
    return math.inf if math.isnan(number) else number


def _table(headers: list[str], rows: list[list[str]], align: str) -> str:
    """Columns padded to their widest cell; ``align`` has one '<' or 'r' per column."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [
        "  ".join(cell.ljust(w) if a == "<" else cell.rjust(w) for cell, w, a in zip(row, widths, align))
        for row in [headers, *rows]
    ]
    return "\n".join(lines)


def write_error_report(report: Mapping[str, Any], output_dir: str | os.PathLike[str]) -> Path:
    """Write the report as JSON into the checkpoint directory, atomically.

    Tensors and numpy values become numbers/lists, paths strings, and non-finite floats the strings
    ``"nan"``, ``"inf"``, ``"-inf"``, so the file stays strict JSON.

    Args:
        report: the per-layer error report (see :func:`format_error_table`); output_dir: the checkpoint
            directory, created if missing.

    Returns:
        ``output_dir / "quantization_report.json"``. Raises NotADirectoryError if ``output_dir`` is a file,
        TypeError (naming the key path) for a value JSON cannot hold.

    Example:
        >>> write_error_report({"subgraphs": [], "modules": {}, "log": []}, "out").name
        'quantization_report.json'
    """
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(
            f"seqcal.evaluation.perplexity.write_error_report: {out} is a file; pass the checkpoint directory instead."
        )
    text = json.dumps(_jsonable(report, "report"), indent=2, allow_nan=False) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT_FILENAME
    tmp = path.with_name(f".{REPORT_FILENAME}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)  # readers never see a half-written report
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _jsonable(value: Any, where: str) -> Any:
    """``value`` as JSON types; ``where`` is its key path, for the error message."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # "nan", "inf", "-inf"
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if callable(getattr(value, "tolist", None)):  # torch / numpy tensors and scalars
        return _jsonable(value.tolist(), where)
    raise TypeError(
        f"seqcal.evaluation.perplexity.write_error_report: {where} is a {type(value).__name__}, which JSON cannot hold; "
        "store numbers, strings, lists or dicts in the report."
    )
