"""seqcal.report: graph export (JSON/DOT/SVG/HTML), trace report, Chrome-trace profiler, error plot."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
import time
import tracemalloc
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from seqcal import SubgraphList, trace_subgraphs
from seqcal.report import (
    NO_SPAN,
    TRACKS,
    NullProfiler,
    Profiler,
    export_graph,
    graph_dict,
    plot_errors,
    tensor_bytes,
    to_dot,
    to_svg,
    trace_report,
)
from seqcal.tracing.runner import GraphRunner

LAYERS, HIDDEN, VOCAB = 3, 32, 128


@pytest.fixture(scope="module")
def subgraphs() -> SubgraphList:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return trace_subgraphs(LlamaForCausalLM(cfg).eval(), _sample(1, 10))


def _sample(batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seq))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


# -- graph export --------------------------------------------------------------------------------------------
def test_json_has_every_node_and_edge_with_shapes(subgraphs, tmp_path: Path) -> None:
    path = export_graph(subgraphs, "json", tmp_path / "g.json", sample=_sample(2, 7))
    data = json.loads(path.read_text())
    graph = subgraphs.traced.graph
    assert [n["name"] for n in data["nodes"]] == [n.name for n in graph.nodes]
    want_edges = {(i.name, n.name) for n in graph.nodes for i in n.all_input_nodes}
    assert {tuple(e) for e in data["edges"]} == want_edges and len(data["edges"]) == len(want_edges)
    nodes = {n["name"]: n for n in data["nodes"]}
    assert all(n["shapes"] is not None and len(n["shapes"]) == len(n["dtypes"]) for n in nodes.values())
    assert nodes[subgraphs.placeholders["input_ids"]]["shapes"] == [[2, 7]]
    assert nodes[subgraphs.placeholders["input_ids"]]["dtypes"] == ["torch.int64"]
    targets = [n for n in nodes.values() if n["op"] == "call_module" and n["target"] in subgraphs.targets]
    assert [n["target"] for n in targets] == subgraphs.targets
    assert all(n["shapes"][0] == [2, 7, HIDDEN] and n["module"] == n["target"] for n in targets)
    assert [n["subgraph"] for n in targets] == list(range(LAYERS))
    assert [VOCAB] == nodes["output"]["shapes"][0][-1:]  # logits [2, 7, VOCAB]
    assert len(data["subgraphs"]) == len(subgraphs)
    assert data["subgraphs"][-1]["returns"] and data["subgraphs"][0]["targets"] == [subgraphs.targets[0]]
    opaque = [n for n in nodes.values() if n["target"].startswith("opaque ")]
    owners = {s.owner for s in subgraphs.traced.opaque_sites}
    assert opaque and all(n["module"] in owners and ".py:" in n["target"] for n in opaque)
    assert len(data["opaque_sites"]) == len(subgraphs.traced.opaque_sites)


def test_json_without_sample_has_null_shapes(subgraphs) -> None:
    data = graph_dict(subgraphs)
    assert all(n["shapes"] is None and n["dtypes"] is None for n in data["nodes"])
    json.dumps(data)  # plain JSON


def test_dot_one_cluster_per_subgraph_and_noise_folded(subgraphs, tmp_path: Path) -> None:
    text = export_graph(subgraphs, "dot", tmp_path / "g.dot").read_text()
    assert text.count("subgraph cluster_") == len(subgraphs)
    assert all(f'"{t}' in text for t in subgraphs.targets)
    data = graph_dict(subgraphs)
    noise = [n["name"] for n in data["nodes"] if n["op"] == "get_attr" or n["target"] == "operator.getitem"]
    assert noise, "the tiny Llama graph has getitem nodes to fold"
    assert not any(f'"{name}" [' in text for name in noise)
    full = to_dot(data, collapse_targets=False)
    assert all(f'"{n["name"]}" [' in full for n in data["nodes"])
    assert full.count(" -> ") == len(data["edges"]) > text.count(" -> ")


def test_dot_draws_values_every_layer_reads_once(subgraphs) -> None:
    # The mask and rotary tables feed every layer: drawn as an edge to the first reader only, then as a note.
    text = to_dot(graph_dict(subgraphs))
    cluster, members = None, {}
    for line in text.splitlines():
        if line.startswith("  subgraph cluster_"):
            cluster = int(line.split("_")[1].split()[0])
        elif line == "  }":
            cluster = None
        elif line.endswith("];") and cluster is not None:
            members[line.strip().split('"')[1]] = cluster
    readers = {}
    for line in text.splitlines():
        if " -> " in line:
            a, b = (part.strip(' ";') for part in line.split(" -> "))
            if a in members and members[b] != members[a]:
                readers.setdefault(a, set()).add(members[b])
    assert readers and max(len(r) for r in readers.values()) <= 2
    assert text.count("shared inputs") >= LAYERS - 1


@pytest.mark.parametrize("layout", ["builtin", "graphviz"])
def test_svg_is_well_formed(subgraphs, tmp_path: Path, layout: str) -> None:
    if layout == "graphviz" and shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` is not installed")
    path = export_graph(subgraphs, "svg", tmp_path / "g.svg", sample=_sample(1, 5), layout=layout)
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert all(t in texts for t in subgraphs.targets)


def test_svg_without_graphviz_falls_back_to_builtin(subgraphs, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    data = graph_dict(subgraphs)
    assert to_svg(data) == to_svg(data, layout="builtin")
    with pytest.raises(FileNotFoundError, match="apt-get install graphviz"):
        to_svg(data, layout="graphviz")
    with pytest.raises(ValueError, match="builtin"):
        to_svg(data, layout="neato")


def test_builtin_svg_draws_every_visible_node_and_edge(subgraphs, tmp_path: Path) -> None:
    root = ET.parse(export_graph(subgraphs, "svg", tmp_path / "g.svg", layout="builtin")).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    data = graph_dict(subgraphs)
    folded = ("operator.getitem", "builtins.getattr")
    visible = [n for n in data["nodes"] if not (n["op"] == "get_attr" or n["target"] in folded)]
    assert len(list(root.iter(f"{ns}rect"))) == len(visible)
    assert len([p for p in root.iter(f"{ns}path") if p.get("marker-end")]) >= len(subgraphs)


def test_html_is_self_contained_and_well_formed(subgraphs, tmp_path: Path) -> None:
    path = export_graph(subgraphs, "html", tmp_path / "g.html", layout="builtin")
    text = path.read_text()
    root = ET.fromstring(text.split("\n", 1)[1])  # polyglot XHTML after the <!DOCTYPE html> line
    assert root.tag == "html"
    tables = list(root.iter("table"))
    assert len(tables[0].findall("tr")) == len(subgraphs) + 1  # header + one row per subgraph
    assert len(tables[1].findall("tr")) == len(subgraphs.traced.opaque_sites) + 1
    assert len(list(root.iter("{http://www.w3.org/2000/svg}svg"))) == 1
    assert "<script" not in text and "<link" not in text and "src=" not in text  # nothing fetched


def test_unknown_format_lists_valid_ones(subgraphs, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="json.*dot.*svg.*html"):
        export_graph(subgraphs, "png", tmp_path / "g.png")


def test_trace_report_lists_sites_and_failures(subgraphs) -> None:
    text = trace_report(subgraphs)
    assert all(t in text for t in subgraphs.targets)
    for site in subgraphs.traced.opaque_sites:
        assert f":{site.lineno}  {site.owner}: {site.reason}" in text
    assert f"{len(subgraphs.traced.failures)} statement(s) failed symbolic tracing" in text
    for (_, line, col), err in subgraphs.traced.failures.items():
        assert f":{line}:{col}  {err}" in text


def test_trace_report_and_html_show_failed_statements(subgraphs, tmp_path: Path) -> None:
    # The tiny Llama traces without failures; give it one, at a real line of this file, to see it reported.
    line = test_trace_report_and_html_show_failed_statements.__code__.co_firstlineno
    failure = {(__file__, line, 0): "TraceError: symbolically traced variables cannot be used as inputs"}
    traced = dataclasses.replace(subgraphs.traced, failures=failure)
    failing = SubgraphList(subgraphs.model, traced, list(subgraphs))
    text = trace_report(failing)
    assert "1 statement(s) failed symbolic tracing" in text
    assert f"test_report.py:{line}:0  TraceError: symbolically traced" in text
    assert "def test_trace_report_and_html_show_failed_statements" in text  # the source line
    page = export_graph(failing, "html", tmp_path / "f.html", layout="builtin").read_text()
    assert len(list(ET.fromstring(page.split("\n", 1)[1]).iter("table"))[2].findall("tr")) == 2


# -- profiler ------------------------------------------------------------------------------------------------
def _profiled_run(subgraphs, profiler: Profiler) -> None:
    """A calibration-like loop: spans on several tracks, cache spans inside calibration spans."""
    runner = GraphRunner(subgraphs.model)
    tensors = subgraphs.check_inputs(_sample(1, 6))
    env = {subgraphs.placeholders[k]: v for k, v in tensors.items()}
    with torch.no_grad():
        for sg in subgraphs:
            with profiler.span("onload", f"subgraph {sg.index}", subgraph=sg.index):
                pass
            with profiler.span("calibration", f"subgraph {sg.index}", subgraph=sg.index) as args:
                with profiler.span("cache", "fetch", subgraph=sg.index) as cache_args:
                    cache_args["bytes"] = tensor_bytes(env)
                runner.run(sg, env)
                args["batches"] = 1
            with profiler.span("compress", f"subgraph {sg.index}", subgraph=sg.index):
                time.sleep(0.001)
            with profiler.span("offload", f"subgraph {sg.index}", subgraph=sg.index):
                pass
    with profiler.span("save", "checkpoint"):
        pass


def test_chrome_trace_spans_never_overlap_per_track(subgraphs, tmp_path: Path) -> None:
    with Profiler(tmp_path / "trace.json") as prof:
        _profiled_run(subgraphs, prof)
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["displayTimeUnit"] == "ms"
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 5 * len(subgraphs) + 1
    assert {e["cat"] for e in spans} == {"onload", "calibration", "cache", "compress", "offload", "save"}
    for tid in {e["tid"] for e in spans}:
        track = sorted((e for e in spans if e["tid"] == tid), key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(track, track[1:]))
    assert all(e["dur"] >= 1000 for e in spans if e["cat"] == "compress")  # slept 1 ms, in microseconds
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    rss = [e["args"]["rss"] for e in counters if "rss" in e["args"]]  # with CUDA, device counters come too
    assert rss and all(value > 1 for value in rss)  # MiB of a live Python process
    assert all(e["args"]["bytes"] > 0 for e in spans if e["cat"] == "cache")
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == set(TRACKS)


def test_span_nesting_on_one_track_and_unknown_track_raise(tmp_path: Path) -> None:
    prof = Profiler(tmp_path / "t.json")
    with pytest.raises(ValueError, match="onload"):
        prof.span("gptq", "x")
    with prof.span("cache", "outer"):
        with pytest.raises(RuntimeError, match="already has the open span 'outer'"):
            with prof.span("cache", "inner"):
                pass
    with pytest.raises(KeyError):
        with prof.span("compress", "fails", subgraph=0):
            raise KeyError("boom")
    failed = [e for e in prof.events if e.get("name") == "fails"]
    assert failed[0]["args"]["error"] == "KeyError"
    assert prof.close() == tmp_path / "t.json" and prof.close() == tmp_path / "t.json"


def test_summary_per_subgraph_and_top_gptq_modules(subgraphs, tmp_path: Path) -> None:
    prof = Profiler(tmp_path / "t.json")
    _profiled_run(subgraphs, prof)
    report = {
        "subgraphs": [{"index": i, "targets": sg.targets, "rel_error": 0.01, "seconds": 0.1}
                      for i, sg in enumerate(subgraphs)],  # fmt: skip
        "modules": {"model.layers.0.mlp.up_proj": {"gptq_loss": 2.5, "gptq_seconds": 0.3},
                    "model.layers.1.self_attn.q_proj": {"gptq_loss": "nan", "gptq_seconds": 0.9}},
    }  # fmt: skip
    prof.close()
    assert Profiler.load(tmp_path / "t.json").summary(report) == prof.summary(report)
    lines = prof.summary(report).splitlines()
    rows = [line for line in lines[1:] if line[:3].strip().isdigit()]
    assert len(rows) == len(subgraphs) and "model.layers.0" in rows[0]
    assert all(float(row.split()[-2]) > 1 for row in rows)  # peak RSS in MiB
    top = lines.index("top 2 modules by GPTQ time:")
    assert lines[top + 2].startswith("model.layers.1.self_attn.q_proj") and "nan" in lines[top + 2]


def test_summary_names_the_span_of_the_device_peak(tmp_path: Path, monkeypatch) -> None:
    """The device counter carries torch's running peak; the summary names the span in which it was reached,
    which the samples of what is allocated between spans miss."""
    allocated, peak = iter([10, 20, 15, 12, 30, 12] * 2), iter([10, 400, 900, 900, 900, 900] * 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: next(allocated) * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: next(peak) * 2**20)
    prof = Profiler(tmp_path / "t.json")
    prof._cuda = True  # as on a machine with CUDA
    for index, tracks in enumerate([("propagation", "calibration"), ("calibration", "compress")]):
        for track in tracks:
            with prof.span(track, f"subgraph {index}", subgraph=index):
                pass
    with prof.span("compress", "subgraph 2", subgraph=2):
        pass
    prof.close()
    summary = Profiler.load(tmp_path / "t.json").summary()
    assert "peak device memory 900 MiB, reached in calibration of subgraph 1" in summary
    assert "peak device memory" not in Profiler(tmp_path / "cpu.json").summary()  # no CUDA, no line


def test_disabled_profiler_is_a_shared_noop(tmp_path: Path) -> None:
    for prof in (Profiler(None), NullProfiler()):
        assert prof.span("cache", "a", bytes=1) is NO_SPAN and prof.span("onload", "b") is NO_SPAN
        prof.span("not-a-track", "c")  # disabled: not even validated, nothing to pay for
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(2000):
                with prof.span("cache", "fetch", subgraph=3) as args:
                    args["bytes"] = 10
            retained = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert retained < 256  # nothing kept per span (the loop variable's int at most)
        assert prof.events == [] and prof.close() is None and prof.summary() == ""
    assert not list(tmp_path.iterdir())


def test_disabled_profiler_overhead_is_negligible() -> None:
    """A disabled span costs about what an empty ``with`` block does (no clock read, no record). Measured against
    that block in the same process, interleaved, so a busy machine slows both alike (an absolute bound flaked)."""
    prof, n = Profiler(None), 20_000

    def timed(make: Any) -> float:
        start = time.perf_counter()
        for _ in range(n):
            with make():
                pass
        return (time.perf_counter() - start) / n

    span, empty = [], []
    for _ in range(5):
        span.append(timed(lambda: prof.span("cache", "fetch", subgraph=1)))
        empty.append(timed(contextlib.nullcontext))
    assert min(span) < 3 * min(empty), (min(span), min(empty))


# -- error plot ----------------------------------------------------------------------------------------------
REPORT = {
    "subgraphs": [{"index": i, "targets": [f"model.layers.{i}"], "rel_error": 0.01 * (i + 1), "seconds": 0.1}
                  for i in range(4)] + [{"index": 4, "targets": [], "rel_error": None, "seconds": 0.0}],
    "modules": {f"model.layers.{i}.{m}": {"gptq_loss": 0.5 * (i + 1), "gptq_seconds": 0.1}
                for i in range(4) for m in ("self_attn.q_proj", "mlp.down_proj")}
    | {"model.layers.3.mlp.up_proj": {"gptq_loss": "nan", "gptq_seconds": 0.1}},
}  # fmt: skip


@pytest.mark.parametrize("report", [REPORT, {"subgraphs": [], "modules": {}}], ids=["full", "empty"])
def test_plot_errors_writes_png(tmp_path: Path, report: dict) -> None:
    pytest.importorskip("matplotlib")
    path = plot_errors(report, tmp_path / "plots" / "errors.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_errors_without_matplotlib_says_how_to_install(tmp_path: Path, monkeypatch) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_errors(REPORT, tmp_path / "e.png")
    with pytest.raises(TypeError, match="report must be a dict"):
        plot_errors([1, 2], tmp_path / "e.png")


def test_onnx_export_has_every_node_with_shapes_for_netron(subgraphs, tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    path = export_graph(subgraphs, "onnx", tmp_path / "g.onnx", sample=_sample(1, 7))
    model = onnx.load(str(path))
    data = graph_dict(subgraphs, _sample(1, 7))
    inner = [n for n in data["nodes"] if n["op"] not in ("placeholder", "output")]
    assert [n.name for n in model.graph.node] == [n["name"] for n in inner]
    assert {n.op_type for n in model.graph.node} >= {"LlamaDecoderLayer", "LlamaRMSNorm", "Opaque", "getitem"}
    assert [i.name for i in model.graph.input] == [
        n["name"] for n in data["nodes"] if n["op"] == "placeholder"
    ]
    shaped = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.value_info}
    layer = next(n for n in inner if n["class"] == "LlamaDecoderLayer")
    assert shaped[layer["name"]] == layer["shapes"][0] == [1, 7, HIDDEN]
    for node in model.graph.node:  # edges: every input is a graph input or an earlier node's output
        assert all(name in shaped or name in {i.name for i in model.graph.input} or name in
                   {m.name for m in model.graph.node} for name in node.input)  # fmt: skip


def test_profiler_synchronizes_cuda_around_stages_not_cache_spans(tmp_path: Path, monkeypatch) -> None:
    """Real durations on a GPU without stalling it: stage spans synchronize, the many cache spans do not."""
    syncs: list[int] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
    prof = Profiler(tmp_path / "t.json")
    prof._cuda = True  # as on a machine with CUDA
    for _ in range(50):
        with prof.span("cache", "fetch"):
            pass
    assert syncs == []
    with prof.span("propagation", "subgraph 0", subgraph=0):
        pass
    assert len(syncs) == 2  # at its start and at its end
