"""See inside a traced model: its graph as JSON, DOT, SVG or a self-contained HTML page, and a text report.

All formats come from one plain dict (``graph_dict``): nodes with their op, target, module, subgraph, inputs
and (given a sample) output shapes and dtypes; edges; subgraphs; opaque spots and failed statements. DOT and
SVG draw a folded view of it (get_attr and getitem nodes merged into their neighbours, each target one box),
so a 30-layer model stays readable.
"""

from __future__ import annotations

import dataclasses
import html
import json
import linecache
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from seqcal.executor import GraphRunner
from seqcal.tracing.tracer import OpaqueCall

if TYPE_CHECKING:
    from seqcal.subgraphs import SubgraphList

FORMATS = ("json", "dot", "svg", "html")
LAYOUTS = ("auto", "graphviz", "builtin")  # SVG: graphviz when `dot` exists (auto), or the built-in layout
MAX_TENSORS_PER_NODE = 16  # a node returning a cache or many tensors lists only its first ones
SHARED_FANOUT = 3  # a value read by this many other subgraphs is drawn as a note on its later readers
_COLORS = {"input": "#e3ecfa", "target": "#ffe7b3", "module": "#eeeeee", "opaque": "#f7c6c6",
           "op": "#ffffff", "output": "#d5f0d5"}  # fmt: skip


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
@dataclass
class _Box:
    name: str
    label: list[str]  # lines
    kind: str  # key of _COLORS
    subgraph: int | None  # None: a model input, drawn outside the subgraphs
    tooltip: str


def _is_noise(node: Mapping[str, Any]) -> bool:
    """get_attr, ``x[i]`` and ``x.attr`` on outputs: structure, not computation."""
    return node["op"] == "get_attr" or node["target"] in ("operator.getitem", "builtins.getattr")


def _short_path(filename: str) -> str:
    """``.../site-packages/transformers/x.py`` -> ``transformers/x.py``: reports stay one line wide."""
    for marker in ("site-packages/", "dist-packages/", "src/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    return filename


def _box(node: Mapping[str, Any], targets: set[str]) -> _Box:
    op, target = node["op"], node["target"]
    if op == "placeholder":
        kind, label = "input", [node["name"]]
    elif op == "output":
        kind, label = "output", ["output"]
    elif op == "call_module":
        kind = "target" if target in targets else "module"
        label = [target, node["class"] or ""]
    elif target.startswith("opaque "):
        _, owner, where = target.split(" ", 2)
        kind, label = "opaque", [f"opaque {owner}", _short_path(where).rsplit("/", 1)[-1]]
    else:
        kind, label = "op", [target.rsplit(".", 1)[-1] if op == "call_function" else f".{target}()"]
    if node["shapes"]:
        label.append(" ".join("x".join(map(str, s)) for s in node["shapes"][:2]))
    tip = f"{node['name']}: {op} {target}" + (
        f"\nshapes {node['shapes']} {node['dtypes']}" if node["shapes"] else ""
    )
    return _Box(node["name"], [line for line in label if line], kind, node["subgraph"], tip)


def _view(data: Mapping[str, Any], fold: bool) -> tuple[list[_Box], list[tuple[str, str]]]:
    """Boxes in graph order and edges between them; with ``fold``, noise nodes pass their inputs through."""
    nodes = {n["name"]: n for n in data["nodes"]}
    hidden = {name for name, n in nodes.items() if fold and _is_noise(n)}

    def sources(name: str) -> list[str]:
        if name not in hidden:
            return [name]
        return [s for i in nodes[name]["inputs"] for s in sources(i)]

    targets = set(data["targets"])
    boxes = [_box(n, targets) for n in data["nodes"] if n["name"] not in hidden]
    edges = [
        (s, n["name"])
        for n in data["nodes"]
        if n["name"] not in hidden
        for i in n["inputs"]
        for s in sources(i)
    ]
    edges = list(dict.fromkeys(edges))
    return boxes, _fold_shared(boxes, edges) if fold else edges


def _fold_shared(boxes: list[_Box], edges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Values every layer reads (mask, rotary tables) keep the edge to their first reading subgraph; later
    readers get a "+k shared inputs" line instead of one long edge each, so deep models draw as a column."""
    where = {b.name: b.subgraph for b in boxes}
    readers: dict[str, set[int]] = {}
    for s, d in edges:
        if where[s] is not None and where[d] is not None and where[d] != where[s]:
            readers.setdefault(s, set()).add(where[d])
    shared = {s for s, r in readers.items() if len(r) >= SHARED_FANOUT}
    kept, notes = [], {}
    for s, d in edges:
        if s in shared and where[d] not in (where[s], min(readers[s])):
            notes.setdefault(d, []).append(s)
        else:
            kept.append((s, d))
    for box in boxes:
        if box.name in notes:
            box.label.append(f"+{len(notes[box.name])} shared inputs")
            box.tooltip += "\nalso reads: " + ", ".join(notes[box.name])
    return kept


def _dot_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(data: Mapping[str, Any], collapse_targets: bool = True) -> str:
    """Graphviz DOT text of ``graph_dict`` output: one ``cluster_<i>`` per subgraph, model inputs outside."""
    boxes, edges = _view(data, collapse_targets)
    lines = [
        "digraph seqcal {",
        f'  graph [label={_dot_str(data["model"])}, labelloc=t, fontname="Helvetica", newrank=true];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [color="#666666", arrowsize=0.6];',
    ]

    def node_line(box: _Box, indent: str) -> str:
        return (f'{indent}{_dot_str(box.name)} [label={_dot_str(chr(10).join(box.label))}, '
                f'fillcolor="{_COLORS[box.kind]}", tooltip={_dot_str(box.tooltip)}];')  # fmt: skip

    lines += [node_line(b, "  ") for b in boxes if b.subgraph is None]
    for sg in data["subgraphs"]:
        title = f"subgraph {sg['index']}: " + (", ".join(sg["targets"]) or "(no target)")
        lines.append(f"  subgraph cluster_{sg['index']} {{")
        lines.append(f'    label={_dot_str(title)}; style="rounded"; color="#999999"; fontsize=11;')
        lines += [node_line(b, "    ") for b in boxes if b.subgraph == sg["index"]]
        lines.append("  }")
    lines += [f"  {_dot_str(a)} -> {_dot_str(b)};" for a, b in edges]
    return "\n".join(lines + ["}"]) + "\n"


# -- SVG: graphviz, else a small built-in layout -----------------------------------------------------------
_W, _H, _GAP_X, _GAP_Y, _TOP, _PAD = 180, 50, 70, 14, 44, 20


def _layout_svg(data: Mapping[str, Any], collapse_targets: bool) -> str:
    """Boxes in one column per subgraph (model inputs in a first column), curved arrows between them."""
    boxes, edges = _view(data, collapse_targets)
    columns: dict[int, list[_Box]] = {}
    for box in boxes:
        columns.setdefault(-1 if box.subgraph is None else box.subgraph, []).append(box)
    order = sorted(columns)
    at: dict[str, tuple[float, float]] = {}
    for col, key in enumerate(order):
        for row, box in enumerate(columns[key]):
            at[box.name] = (_PAD + col * (_W + _GAP_X), _TOP + row * (_H + _GAP_Y))
    width = _PAD * 2 + len(order) * (_W + _GAP_X) - _GAP_X
    height = _TOP + max(len(c) for c in columns.values()) * (_H + _GAP_Y) + _PAD
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="10">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" '
        'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#666"/></marker></defs>',
        f"<title>{html.escape(data['model'])}</title>",
    ]
    for col, key in enumerate(order):
        x = _PAD + col * (_W + _GAP_X)
        title = "inputs" if key < 0 else f"subgraph {key}"
        names = html.escape(_clip(", ".join([] if key < 0 else data["subgraphs"][key]["targets"]), 34))
        out.append(
            f'<g class="column"><text x="{x}" y="{_TOP - 22}" font-weight="bold">{title}</text>'
            f'<text x="{x}" y="{_TOP - 9}" fill="#555">{names}</text></g>'
        )
    for src, dst in edges:
        out.append(_edge_path(at[src], at[dst]))
    for box in boxes:
        x, y = at[box.name]
        rect = f'x="{x}" y="{y}" width="{_W}" height="{_H}" rx="5" fill="{_COLORS[box.kind]}" stroke="#555"'
        out.append(f'<g class="node"><title>{html.escape(box.tooltip)}</title><rect {rect}/>')
        for i, line in enumerate(box.label[:4]):
            out.append(f'<text x="{x + 6}" y="{y + 12 + i * 11}">{html.escape(_clip(line, 32))}</text>')
        out.append("</g>")
    return "\n".join(out + ["</svg>"]) + "\n"


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _edge_path(a: tuple[float, float], b: tuple[float, float]) -> str:
    (ax, ay), (bx, by) = a, b
    if ax == bx:  # same column: down the right side, bulging out further the more rows it skips
        x0, y0, y1 = ax + _W, ay + _H / 2, by + _H / 2
        bulge = 12 + (y1 - y0) / 8
        d = f"M {x0} {y0} C {x0 + bulge} {y0}, {x0 + bulge} {y1}, {x0} {y1}"
    else:  # a later column: from the right edge to the left edge
        x0, y0, x1, y1 = ax + _W, ay + _H / 2, bx, by + _H / 2
        d = f"M {x0} {y0} C {x0 + _GAP_X / 2} {y0}, {x1 - _GAP_X / 2} {y1}, {x1} {y1}"
    return f'<path d="{d}" fill="none" stroke="#666" stroke-opacity="0.6" marker-end="url(#arrow)"/>'


def to_svg(data: Mapping[str, Any], collapse_targets: bool = True, layout: str = "auto") -> str:
    """SVG text of ``graph_dict`` output: Graphviz ``dot -Tsvg`` if available (layout "auto"), else built in.

    Raises:
        ValueError: unknown layout; FileNotFoundError: layout "graphviz" without the ``dot`` program.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    dot = shutil.which("dot")
    if layout == "graphviz" and dot is None:
        raise FileNotFoundError(
            "to_svg: layout='graphviz' needs Graphviz's `dot` program: apt-get install graphviz, "
            "or use layout='builtin'"
        )
    if layout == "builtin" or dot is None:
        return _layout_svg(data, collapse_targets)
    text = to_dot(data, collapse_targets)
    done = subprocess.run(
        [dot, "-Tsvg"], input=text, capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"to_svg: `dot -Tsvg` failed ({done.returncode}): {done.stderr.strip()[:500]}; "
            "retry with layout='builtin'"
        )
    return done.stdout[done.stdout.index("<svg") :]  # drop the XML prolog and DOCTYPE: embeddable in HTML


# -- HTML page and text report -----------------------------------------------------------------------------
_CSS = """body{font:14px/1.4 Helvetica,Arial,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse;margin:8px 0 20px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#f3f3f3}code{font-size:12px}.graph{overflow:auto;border:1px solid #ccc}"""


def _table(head: list[str], rows: list[list[str]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def to_html(subgraphs: SubgraphList, data: Mapping[str, Any], svg: str) -> str:
    """One offline HTML page (inline CSS and SVG): subgraph table, opaque spots, failed statements, picture."""
    rows = [
        [
            r["index"],
            _names(r["targets"]),
            f"{r['params']:,}",
            r["nodes"],
            _names(r["inputs"]),
            _names(r["outputs"]),
        ]
        for r in subgraphs.table()
    ]
    sites = [
        [f"{_short_path(s['filename'])}:{s['lineno']}", s["owner"], s["reason"], s["source"]]
        for s in data["opaque_sites"]
    ]
    fails = [[f"{_short_path(f['file'])}:{f['line']}", f["error"], f["source"]] for f in data["failures"]]
    title = f"seqcal: {data['model']}"
    return "\n".join([
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"/>',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{len(subgraphs.targets)} targets, {len(subgraphs)} subgraphs, {len(data['nodes'])} nodes.</p>",
        "<h2>Subgraphs</h2>", _table(["#", "targets", "params", "nodes", "inputs", "outputs"], rows),
        f"<h2>Opaque spots ({len(sites)})</h2><p>Run at execution time with real values.</p>",
        _table(["where", "owner", "why", "code"], sites),
        f"<h2>Statements that failed symbolic tracing ({len(fails)})</h2>",
        _table(["where", "error", "code"], fails),
        f'<h2>Graph</h2><div class="graph">{svg}</div>', "</body></html>\n",
    ])  # fmt: skip


def _names(names: list[str]) -> str:
    return ", ".join(names) or "-"


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
    """Write the traced graph to ``path`` as JSON, DOT, SVG or one self-contained HTML page.

    Args:
        subgraphs: from ``trace_subgraphs``.
        fmt: "json" (every node and edge), "dot", "svg" or "html".
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
    if fmt == "json":
        text = json.dumps(data, indent=1) + "\n"
    elif fmt == "dot":
        text = to_dot(data, collapse_targets)
    else:
        svg = to_svg(data, collapse_targets, layout)
        text = svg if fmt == "svg" else to_html(subgraphs, data, svg)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out
