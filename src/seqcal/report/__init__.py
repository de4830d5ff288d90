"""See inside a run: graph export (JSON/DOT/SVG/HTML), trace report, Chrome-trace profiler and its timeline, error plot.

Names load lazily from their submodule: the executor imports ``seqcal.report.profile`` while
``seqcal.report.graph`` imports the executor, so this package must not import ``graph`` eagerly.

Example:
    >>> from seqcal.report import export_graph, trace_report, Profiler, plot_errors
    >>> export_graph(subgraphs, "html", "graph.html", sample=sample)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from seqcal.report.graph import (
        FORMATS,
        LAYOUTS,
        export_graph,
        format_subgraph_table,
        graph_dict,
        record_shapes,
        to_dot,
        to_svg,
        trace_report,
    )
    from seqcal.report.plot import plot_errors
    from seqcal.report.profile import NO_SPAN, TRACKS, NullProfiler, Profiler, tensor_bytes
    from seqcal.report.timeline import plot_timeline

_EXPORTS = {
    "FORMATS": "graph", "LAYOUTS": "graph", "export_graph": "graph", "format_subgraph_table": "graph",
    "graph_dict": "graph", "record_shapes": "graph", "to_dot": "graph", "to_svg": "graph",
    "trace_report": "graph", "plot_errors": "plot", "plot_timeline": "timeline", "NO_SPAN": "profile", "TRACKS": "profile",
    "NullProfiler": "profile", "Profiler": "profile", "tensor_bytes": "profile",
}  # fmt: skip
__all__ = [
    "FORMATS",
    "LAYOUTS",
    "NO_SPAN",
    "NullProfiler",
    "Profiler",
    "TRACKS",
    "export_graph",
    "format_subgraph_table",
    "graph_dict",
    "plot_errors",
    "plot_timeline",
    "record_shapes",
    "tensor_bytes",
    "to_dot",
    "to_svg",
    "trace_report",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'seqcal.report' has no attribute {name!r}; it exports {__all__}")
    return getattr(importlib.import_module(f"seqcal.report.{module}"), name)
