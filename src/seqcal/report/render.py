"""Drawing a graph dict (see graph.py): DOT text, SVG (Graphviz when installed, else a built-in layout), HTML."""

from __future__ import annotations

import html
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from seqcal.execution.subgraphs import SubgraphList

LAYOUTS = ("auto", "graphviz", "builtin")  # SVG: graphviz when `dot` exists (auto), or the built-in layout
MAX_TENSORS_PER_NODE = 16  # a node returning a cache or many tensors lists only its first ones
SHARED_FANOUT = 3  # a value read by this many other subgraphs is drawn as a note on its later readers
_COLORS = {"input": "#e3ecfa", "target": "#ffe7b3", "module": "#eeeeee", "opaque": "#f7c6c6",
           "op": "#ffffff", "output": "#d5f0d5"}  # fmt: skip


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
