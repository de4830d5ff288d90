"""See inside a run: graph export (JSON/DOT/SVG/HTML), trace report, Chrome-trace profiler, error plot.

Example:
    >>> from seqcal.report import export_graph, trace_report, Profiler, plot_errors
    >>> export_graph(subgraphs, "html", "graph.html", sample=sample)  # doctest: +SKIP
"""

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

__all__ = [
    "FORMATS",
    "LAYOUTS",
    "NO_SPAN",
    "TRACKS",
    "NullProfiler",
    "Profiler",
    "export_graph",
    "format_subgraph_table",
    "graph_dict",
    "plot_errors",
    "record_shapes",
    "tensor_bytes",
    "to_dot",
    "to_svg",
    "trace_report",
]
