"""A PNG of a profile trace: one row of bars per stage track, host and device memory below.

The picture a person would take a screenshot of in ui.perfetto.dev, drawn offline from the trace file
``Profiler`` writes (docs/tracing.md, "See inside"). matplotlib's object API with the Agg canvas, no pyplot state.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from seqcal.report.plot import agg_figure, save_png
from seqcal.report.profile import TRACKS, Profiler

_COLORS = {
    "onload": "#9d755d", "calibration": "#4c78a8", "compress": "#e45756", "propagation": "#54a24b",
    "cache": "#b279a2", "offload": "#72b7b2", "save": "#eeca3b", "write": "#f58518", "verify": "#bab0ac", "communication": "#ff9da6",
}  # fmt: skip


def _spans(events: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Track -> [(start s, duration s)] of its complete events."""
    out: dict[str, list[tuple[float, float]]] = {t: [] for t in TRACKS}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in out:
            out[e["cat"]].append((e["ts"] / 1e6, e["dur"] / 1e6))
    return out


def _counters(events: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(times s, values MiB) of the counter events carrying ``key`` ("rss" or "allocated")."""
    points = sorted((e["ts"] / 1e6, float(e["args"][key])) for e in events
                    if e.get("ph") == "C" and key in e.get("args", {}))  # fmt: skip
    return [t for t, _ in points], [v for _, v in points]


def plot_timeline(trace: str | os.PathLike[str] | Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Draw a profile trace (``oneshot(profile=...)``) as a timeline PNG.

    Args:
        trace: the trace file, or its parsed ``{"traceEvents": [...]}``.
        path: the PNG to write (parent folders are created).

    Returns:
        The path written.

    Raises:
        ValueError: the trace has no stage spans. ImportError: matplotlib is not installed.

    Example:
        >>> plot_timeline("run.trace.json", "run.timeline.png")  # doctest: +SKIP
        PosixPath('run.timeline.png')
    """
    # a file is read as Profiler.load reads it (a clear error for one that is not a trace)
    events = (trace.get("traceEvents") or []) if isinstance(trace, Mapping) else Profiler.load(trace).events
    spans = _spans(events)
    if not any(spans.values()):
        raise ValueError(f"plot_timeline: {trace if not isinstance(trace, Mapping) else 'trace'} has no stage "
                         "spans; pass a trace written by oneshot(profile=...)")  # fmt: skip
    fig = agg_figure("plot_timeline", (12, 6))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    rows = [t for t in TRACKS if spans[t]]
    for y, track in enumerate(rows):
        total = sum(d for _, d in spans[track])
        top.broken_barh(spans[track], (y - 0.4, 0.8), color=_COLORS[track], linewidth=0)
        top.text(1.005, y, f"{total:.1f} s", transform=top.get_yaxis_transform(), va="center", fontsize=8)
    top.set_yticks(range(len(rows)), rows)
    top.invert_yaxis()
    top.set_title("stages (total busy time per track at the right)")
    top.grid(True, axis="x", alpha=0.3)
    for key, label, color in (("rss", "host RSS", "#4c78a8"), ("allocated", "device allocated", "#e45756")):
        ts, values = _counters(events, key)
        if ts:
            bottom.plot(ts, values, label=label, color=color, linewidth=0.8)
    bottom.set_ylabel("MiB")
    bottom.set_xlabel("seconds since the run started")
    bottom.grid(True, alpha=0.3)
    bottom.legend(fontsize=8, loc="upper left")
    return save_png(fig, path)
