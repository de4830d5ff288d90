"""See inside a traced model: its graph as JSON, DOT, SVG or a self-contained HTML page, and a text report.

All formats come from one plain dict (``graph_dict``): nodes with their op, target, module, subgraph, inputs
and (given a sample) output shapes and dtypes; edges; subgraphs; opaque spots and failed statements. DOT and
SVG draw a folded view of it (get_attr and getitem nodes merged into their neighbours, each target one box),
so a 30-layer model stays readable.
"""

from __future__ import annotations

import dataclasses
import json
import linecache
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from seqcal.report.render import LAYOUTS as LAYOUTS  # re-exported (seqcal.report)
from seqcal.report.render import MAX_TENSORS_PER_NODE, _names, _short_path, to_dot, to_html, to_svg
from seqcal.tracing.runner import GraphRunner
from seqcal.tracing.tracer import OpaqueCall

if TYPE_CHECKING:
    from seqcal.execution.subgraphs import SubgraphList

FORMATS = ("json", "dot", "svg", "html", "onnx")  # onnx: for Netron (needs the onnx package)


# -- the graph as a dict -----------------------------------------------------------------------------------
def _callable_name(target: Any) -> str:
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    module = "operator" if module == "_operator" else module
    return f"{module}.{name}" if module and name else repr(target)


def node_target(node: fx.Node) -> str:
    """A node's target as text; opaque code reads ``opaque <owner> <file>:<line>``."""
    if isinstance(node.target, OpaqueCall):
        site = node.target.site
        return f"opaque {site.owner} {site.filename}:{site.lineno}"
    if node.op == "call_function":
        return _callable_name(node.target)
    return str(node.target)


def _node_module(node: fx.Node) -> str | None:
    if node.op == "call_module":
        return str(node.target)
    return node.target.site.owner if isinstance(node.target, OpaqueCall) else None


def _describe(value: Any) -> tuple[list[list[int]], list[str]]:
    """Shapes and dtypes of the tensors in ``value`` (nested tuples, lists, dicts), in order."""
    shapes: list[list[int]] = []
    dtypes: list[str] = []
    stack = [value]
    while stack and len(shapes) < MAX_TENSORS_PER_NODE:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            shapes.append(list(item.shape))
            dtypes.append(str(item.dtype))
        elif isinstance(item, (tuple, list)):
            stack[:0] = list(item)
        elif isinstance(item, Mapping):
            stack[:0] = list(item.values())
    return shapes, dtypes


class _RecordingRunner(GraphRunner):
    """A GraphRunner that notes the shapes and dtypes of each node's output as it computes it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.seen: dict[str, tuple[list[list[int]], list[str]]] = {}

    def _call(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        value = super()._call(node, args, kwargs)
        self.seen[node.name] = _describe(value)
        return value


def record_shapes(subgraphs: SubgraphList, sample: Mapping[str, Any]) -> dict[str, tuple[list, list]]:
    """Run the subgraphs once on ``sample`` and return node name -> (output shapes, dtypes).

    Values are dropped once no later subgraph reads them, as in the executor, so memory stays bounded.
    """
    tensors = subgraphs.check_inputs(sample)
    runner = _RecordingRunner(subgraphs.model)
    env: dict[str, Any] = {subgraphs.placeholders[k]: v for k, v in tensors.items()}
    runner.seen.update({name: _describe(v) for name, v in env.items()})
    graph = subgraphs.traced.graph
    for node in graph.nodes:
        if node.op == "get_attr":
            runner.seen[node.name] = _describe(runner.attr(str(node.target)))
    later: list[set[str]] = [set() for _ in range(len(subgraphs) + 1)]
    for i in range(len(subgraphs) - 1, -1, -1):
        later[i] = later[i + 1] | set(subgraphs[i].inputs)
    with torch.no_grad():
        for i, sg in enumerate(subgraphs):
            result = runner.run(sg, env)
            if sg.returns:
                output = next(n for n in sg.nodes if n.op == "output")
                runner.seen[output.name] = _describe(result)
            env = {k: v for k, v in env.items() if k in later[i + 1]}
    return runner.seen


def graph_dict(subgraphs: SubgraphList, sample: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The traced graph as plain JSON-able data (the ``json`` export format).

    Args:
        subgraphs: from ``trace_subgraphs``.
        sample: model inputs to run once, recording each node's output shapes and dtypes (None: shapes null).

    Returns:
        ``{"model", "nodes": [{"name", "op", "target", "module", "class", "subgraph", "inputs", "shapes",
        "dtypes"}], "edges": [[src, dst]], "subgraphs": [...], "opaque_sites": [...], "failures": [...]}``.

    Example:
        >>> data = graph_dict(subgraphs, sample={"input_ids": ids})  # doctest: +SKIP
        >>> data["nodes"][0]["shapes"]  # doctest: +SKIP
        [[1, 8]]
    """
    graph = subgraphs.traced.graph
    seen = record_shapes(subgraphs, sample) if sample is not None else {}
    owner = {node: sg.index for sg in subgraphs for node in sg.nodes}
    named = dict(subgraphs.model.named_modules())
    nodes = []
    for node in graph.nodes:
        index = owner.get(node)
        if node.op == "get_attr" and node.users:  # resolved where used: it belongs to its first reader
            index = min((owner[u] for u in node.users if u in owner), default=None)
        module = _node_module(node)
        shapes, dtypes = seen.get(node.name, (None, None))
        nodes.append({
            "name": node.name, "op": node.op, "target": node_target(node), "module": module,
            "class": type(named[module]).__name__ if node.op == "call_module" and module in named else None,
            "subgraph": index, "inputs": [n.name for n in node.all_input_nodes],
            "shapes": shapes, "dtypes": dtypes,
        })  # fmt: skip
    fields = ("index", "targets", "inputs", "outputs", "frees", "modules", "returns")
    return {
        "model": type(subgraphs.model).__name__,
        "targets": subgraphs.targets,
        "nodes": nodes,
        "edges": [[n.name, node.name] for node in graph.nodes for n in node.all_input_nodes],
        "subgraphs": [{f: getattr(sg, f) for f in fields} for sg in subgraphs],
        "opaque_sites": [dataclasses.asdict(site) for site in subgraphs.traced.opaque_sites],
        "failures": [
            {
                "file": f,
                "line": line,
                "column": col,
                "error": err,
                "source": linecache.getline(f, line).strip(),
            }
            for (f, line, col), err in subgraphs.traced.failures.items()
        ],
    }


# -- a folded view, drawn by DOT and by the built-in SVG layout --------------------------------------------
def format_subgraph_table(rows: list[dict[str, Any]]) -> str:
    """Subgraph table (from ``SubgraphList.table()``): index, target, parameters, nodes, inputs -> outputs."""
    lines = [f"{'#':>3}  {'target':<34} {'params':>12}  {'nodes':>5}  inputs -> outputs"]
    for row in rows:
        target, ins, outs = (_names(row[k]) for k in ("targets", "inputs", "outputs"))
        lines.append(
            f"{row['index']:>3}  {target:<34} {row['params']:>12,}  {row['nodes']:>5}  {ins} -> {outs}"
        )
    return "\n".join(lines)


def trace_report(subgraphs: SubgraphList) -> str:
    """What tracing decided, as text: the subgraph table, every opaque spot and every failed statement.

    Example:
        >>> print(trace_report(trace_subgraphs(model, sample)))  # doctest: +SKIP
    """
    traced = subgraphs.traced
    lines = [
        f"{type(subgraphs.model).__name__}: {len(subgraphs.targets)} targets -> {len(subgraphs)} subgraphs",
        format_subgraph_table(subgraphs.table()),
        f"\n{len(traced.opaque_sites)} opaque spot(s) (run at execution time with real values):",
    ]
    for site in traced.opaque_sites:
        lines.append(
            f"  {_short_path(site.filename)}:{site.lineno}  {site.owner}: {site.reason}: {site.source}"
        )
    lines.append(f"\n{len(traced.failures)} statement(s) failed symbolic tracing (made opaque):")
    for (file, line, col), err in traced.failures.items():
        lines.append(f"  {_short_path(file)}:{line}:{col}  {err}")
        if code := linecache.getline(file, line).strip():
            lines.append(f"      {code}")
    return "\n".join(lines)


def export_graph(
    subgraphs: SubgraphList,
    fmt: str,
    path: str | os.PathLike[str],
    collapse_targets: bool = True,
    sample: Mapping[str, Any] | None = None,
    layout: str = "auto",
) -> Path:
    """Write the traced graph to ``path`` as JSON, DOT, SVG, one self-contained HTML page or ONNX (Netron).

    Args:
        subgraphs: from ``trace_subgraphs``.
        fmt: "json" (every node and edge), "dot", "svg", "html" or "onnx" (structure and shapes for Netron,
            no weights; needs the onnx package).
        path: the file to write (parent folders are created).
        collapse_targets: DOT/SVG/HTML draw each target as one box and fold get_attr and getitem nodes into
            their neighbours (readable for deep models); False draws every graph node.
        sample: model inputs run once to record each node's output shapes and dtypes (None: no shapes).
        layout: SVG/HTML picture: "auto" (Graphviz if its `dot` program exists, else built in), "graphviz"
            or "builtin".

    Returns:
        The path written.

    Example:
        >>> export_graph(subgraphs, "html", "graph.html", sample=sample)  # doctest: +SKIP
        PosixPath('graph.html')
    """
    if fmt not in FORMATS:
        raise ValueError(f"export_graph: fmt={fmt!r} is not a format; valid: {list(FORMATS)}")
    data = graph_dict(subgraphs, sample)
    out = Path(path)
    if fmt == "onnx":
        from seqcal.report.onnx_graph import to_onnx

        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(to_onnx(data))
        return out
    if fmt == "json":
        text = json.dumps(data, indent=1) + "\n"
    elif fmt == "dot":
        text = to_dot(data, collapse_targets)
    else:
        svg = to_svg(data, collapse_targets, layout)
        text = svg if fmt == "svg" else to_html(subgraphs, data, svg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out
