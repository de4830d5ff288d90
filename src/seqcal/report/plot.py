"""A PNG of the run report: relative output error per subgraph and GPTQ loss per module, on log scales, and
the bits per weight of each module when a mixed-precision allocation chose them.

matplotlib is used through its object API with the Agg canvas (no pyplot), so nothing global changes.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_LAYER = re.compile(r"\.(\d+)\.")  # "model.layers.3.mlp.up_proj" -> layer 3, for the x-axis ticks
_PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#9d755d"]


def _finite(value: Any) -> float | None:
    """The value as a float if it is a finite number; report JSON writes NaN as the string "nan"."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _errors_panel(ax: Any, subgraphs: list[Mapping[str, Any]]) -> None:
    points = [(s.get("index"), _finite(s.get("rel_error")), s.get("targets") or []) for s in subgraphs]
    points = [(i, e, t) for i, e, t in points if isinstance(i, int) and e is not None and e > 0]
    ax.set_title("relative output error per subgraph (quantized vs full precision)")
    if not points:
        ax.text(
            0.5,
            0.5,
            "no per-subgraph errors in this report",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        return
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    ax.bar(xs, ys, color="#4c78a8")
    ax.set_yscale("log")
    ax.set_xlabel("subgraph")
    ax.set_ylabel("relative error")
    ax.grid(True, axis="y", which="both", alpha=0.3)


def _loss_panel(ax: Any, modules: Mapping[str, Any]) -> None:
    ax.set_title("GPTQ loss per module (execution order)")
    losses = [(name, m.get("gptq_loss")) for name, m in modules.items() if isinstance(m, Mapping)]
    failed = sum(1 for _, v in losses if v is not None and _finite(v) is None)
    rows = [(name, v) for name, v in ((n, _finite(v)) for n, v in losses) if v is not None and v > 0]
    if failed:
        ax.set_title(f"GPTQ loss per module (execution order; {failed} non-finite not drawn)", color="#b00")
    if not rows:
        ax.text(0.5, 0.5, "no GPTQ losses in this report", ha="center", va="center", transform=ax.transAxes)
        return
    kinds = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name, _ in rows))  # q_proj, k_proj, ...
    for k, kind in enumerate(kinds):
        xs = [i for i, (name, _) in enumerate(rows) if name.rsplit(".", 1)[-1] == kind]
        ax.bar(xs, [rows[i][1] for i in xs], color=_PALETTE[k % len(_PALETTE)], label=kind, width=0.9)
    _layer_ticks(ax, [name for name, _ in rows])
    ax.set_yscale("log")
    ax.set_ylabel("GPTQ loss")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    if len(kinds) <= 12:
        ax.legend(fontsize=7, ncol=min(len(kinds), 8), loc="upper left")


def _layer_ticks(ax: Any, names: list[str]) -> None:
    """Label the x-axis (one bar per module) with the layer index where each layer starts."""
    ticks: dict[str, int] = {}
    for i, name in enumerate(names):
        match = _LAYER.search(name)
        if match:
            ticks.setdefault(match.group(1), i)
    if ticks:
        step = max(1, len(ticks) // 16)  # at most ~16 labels
        shown = list(ticks.items())[::step]
        ax.set_xticks([i for _, i in shown], [layer for layer, _ in shown])
        ax.set_xlabel("layer")


def plot_errors(report: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Draw the run report's per-subgraph relative error and per-module GPTQ loss into a PNG.

    Args:
        report: ``{"subgraphs": [{"index", "targets", "rel_error", "seconds"}], "modules": {name:
            {"gptq_loss", "gptq_seconds"}}}`` (``state.results.report`` or quantization_report.json); missing parts
            give an empty panel, non-finite values are left out and counted in the title.
        path: the PNG file to write (parent folders are created).

    Returns:
        The path written.

    Raises:
        TypeError: ``report`` is not a dict. ImportError: matplotlib is not installed.

    Example:
        >>> plot_errors(json.load(open("out/quantization_report.json")), "errors.png")  # doctest: +SKIP
        PosixPath('errors.png')
    """
    if not isinstance(report, Mapping):
        raise TypeError(f"plot_errors: report must be a dict (the run report), got {type(report).__name__}")
    modules = report.get("modules") or {}
    mixed = isinstance(modules, Mapping) and any(
        isinstance(m, Mapping) and "bits" in m for m in modules.values()
    )
    fig = agg_figure("plot_errors", (11, 10 if mixed else 7))
    axes = fig.subplots(3 if mixed else 2, 1)
    _errors_panel(axes[0], [s for s in report.get("subgraphs") or [] if isinstance(s, Mapping)])
    _loss_panel(axes[1], modules)
    if mixed:
        _bits_panel(axes[2], modules)
    return save_png(fig, path)


def _bits_panel(ax: Any, modules: Mapping[str, Any]) -> None:
    """Stored bits per weight of each module (execution order), coloured by projection."""
    rows = [
        (n, v)
        for n, m in modules.items()
        if isinstance(m, Mapping) and (v := _finite(m.get("bits"))) is not None
    ]
    mean = sum(v for _, v in rows) / max(len(rows), 1)
    ax.set_title(
        f"bits per weight per module, mixed precision (scales counted; mean over modules {mean:.2f})"
    )
    kinds = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name, _ in rows))
    for k, kind in enumerate(kinds):
        xs = [i for i, (name, _) in enumerate(rows) if name.rsplit(".", 1)[-1] == kind]
        ax.bar(xs, [rows[i][1] for i in xs], color=_PALETTE[k % len(_PALETTE)], label=kind, width=0.9)
    _layer_ticks(ax, [name for name, _ in rows])
    ax.set_ylabel("bits per weight")
    ax.grid(True, axis="y", alpha=0.3)
    if len(kinds) <= 12:
        ax.legend(fontsize=7, ncol=min(len(kinds), 8), loc="upper left")


def agg_figure(caller: str, size: tuple[float, float]) -> Any:
    """A matplotlib Figure drawn by the Agg canvas (no pyplot state); ImportError names ``caller``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            f"{caller} needs matplotlib, which is not installed: pip install matplotlib"
        ) from err
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)  # attaches itself to the figure: savefig renders with Agg, no pyplot state
    return fig


def save_png(fig: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``fig`` to ``path`` as PNG (parent folders created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out
