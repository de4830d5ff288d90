"""trace_into: tracing into chosen modules or all of them (the full graph), leaves, depth and diagnostics."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from seqcal import trace_subgraphs
from seqcal.entrypoint import oneshot
from seqcal.modifiers import GPTQModifier
from seqcal.report import export_graph
from seqcal.tracing.partition import target_ends
from test_oneshot import tiny_llama as oneshot_llama
from test_oneshot import token_data
from test_trace_equivalence import assert_same_outputs
from test_tracing import sample, tiny_llama

SDPA = "transformers.integrations.sdpa_attention.sdpa_attention_forward"
ROTARY = "transformers.models.llama.modeling_llama.apply_rotary_pos_emb"


def _nodes(subgraphs, op: str) -> list[str]:
    return [str(n.target) for n in subgraphs.traced.graph.nodes if n.op == op]


def _functions(subgraphs) -> list[str]:
    return [
        f"{getattr(n.target, '__module__', '')}.{getattr(n.target, '__name__', '')}"
        for n in subgraphs.traced.graph.nodes
        if n.op == "call_function"
    ]


def _equal_to_eager(model: torch.nn.Module, subgraphs) -> None:
    for batch, seq, pad in [(2, 9, 3), (1, 6, 0)]:
        inputs = sample(batch, seq, pad)
        with torch.no_grad():
            want = model(**inputs)
        assert_same_outputs(subgraphs.run(**inputs), want)


def test_full_trace_json_shows_attention_internals(tmp_path: Path) -> None:
    model = tiny_llama(layers=2)
    full = trace_subgraphs(model, sample(), trace_into="all")
    data = json.loads(export_graph(full, "json", tmp_path / "full.json").read_text())
    targets = [n["target"] for n in data["nodes"]]
    modules = [n["target"] for n in data["nodes"] if n["op"] == "call_module"]
    assert SDPA in targets and ROTARY in targets  # the attention's operations, sdpa kept (invariant 4)
    for layer in ("model.layers.0", "model.layers.1"):
        # no opaque attention or layer node
        assert f"{layer}.self_attn" not in modules and layer not in modules
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert modules.count(f"{layer}.self_attn.{proj}") == 1  # Linear stays one node
        assert modules.count(f"{layer}.mlp.down_proj") == 1
    # Without trace_into the layers stay single nodes, as before.
    default = trace_subgraphs(model, sample())
    assert _nodes(default, "call_module").count("model.layers.0") == 1 and SDPA not in _functions(default)
    assert model.config._attn_implementation == "sdpa"


def test_full_trace_keeps_targets_and_equals_eager() -> None:
    model = tiny_llama(layers=3)
    full = trace_subgraphs(model, sample(), trace_into="all")
    assert full.targets == [f"model.layers.{i}" for i in range(3)]
    assert [sg.targets for sg in full] == [[t] for t in full.targets] + [[]]  # each in its own subgraph
    for sg, target in zip(full, full.targets):
        # the layer's own nodes end its subgraph: nothing of layer i+1 is computed before layer i is done
        layer_nodes = [n for n in sg.nodes if n.meta.get("seqcal_module", "").startswith(target)]
        assert layer_nodes and sg.nodes[-1] is layer_nodes[-1]
        assert target_ends(sg.nodes, sg.targets) == {layer_nodes[-1]: target}  # the layer's output node
    assert "model.layers.0.self_attn" in full.traced.traced_into and not full.traced.not_traced_into
    _equal_to_eager(model, full)


def test_chosen_modules_are_opened_and_the_rest_stays_closed() -> None:
    model = tiny_llama(layers=2)
    attention = trace_subgraphs(model, sample(), trace_into=["LlamaAttention"])
    modules = _nodes(attention, "call_module")
    assert ROTARY in _functions(attention) and "model.layers.0.self_attn.q_proj" in modules
    assert "model.layers.0.mlp" in modules and "model.layers.0.input_layernorm" in modules
    mlp = trace_subgraphs(model, sample(), trace_into=[r"re:.*\.mlp$"])
    modules = _nodes(mlp, "call_module")
    assert "model.layers.1.mlp.gate_proj" in modules and "model.layers.1.self_attn" in modules
    assert ROTARY not in _functions(mlp)
    _equal_to_eager(model, attention)
    _equal_to_eager(model, mlp)


def test_leaf_modules_stay_closed_in_a_full_trace() -> None:
    model = tiny_llama(layers=2)
    sg = trace_subgraphs(model, sample(), trace_into="all", leaf_modules=["LlamaMLP"])
    modules = _nodes(sg, "call_module")
    assert "model.layers.0.mlp" in modules and "model.layers.0.mlp.gate_proj" not in modules
    assert "model.layers.0.self_attn.q_proj" in modules
    assert "lm_head" in modules and "model.layers.0.input_layernorm" not in modules  # RMSNorm opened
    _equal_to_eager(model, sg)


def test_depth_limits_how_far_all_opens() -> None:
    model = tiny_llama(layers=2)
    shallow = trace_subgraphs(model, sample(), trace_into="all", trace_depth=1)
    modules = _nodes(shallow, "call_module")
    assert "model.layers.0" not in modules and "model.layers.0.self_attn" in modules  # layer open, attn not
    _equal_to_eager(model, shallow)
    with pytest.raises(ValueError, match="trace_depth"):
        trace_subgraphs(model, sample(), trace_depth=2)


@pytest.mark.parametrize(
    "trace_into, match",
    [
        (["NoSuchModule"], "matches no module.*LlamaAttention"),
        (["Linear"], "torch.nn modules"),
        (3, "not valid"),
    ],
)
def test_bad_trace_into_is_explained(trace_into: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        trace_subgraphs(tiny_llama(layers=1), sample(), trace_into=trace_into)  # type: ignore[arg-type]


class Gate(torch.nn.Module):
    """A block whose forward cannot be traced: an early return on a runtime value."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if y.sum() > 0:  # GATE_LINE
            return y
        return -y


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = x.shape[0]  # a store into the module: runs at execution time, never on a proxy
        return x + self.gate(self.norm(x))


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_module_that_cannot_be_traced_into_stays_one_node_and_is_reported(caplog) -> None:
    torch.manual_seed(0)
    model = Stack().eval()
    with caplog.at_level(logging.WARNING, logger="seqcal"):
        sg = trace_subgraphs(model, {"x": torch.randn(2, 8)}, sequential_targets=["Block"], trace_into="all")
    line = next(
        i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "# GATE_LINE" in text
    )
    [problem] = sg.traced.not_traced_into
    assert problem.where.startswith(f"{__file__}:{line}") and "Gate" in problem.what and "fix" in str(problem)
    assert f"test_trace_into.py:{line}" in caplog.text
    modules = _nodes(sg, "call_module")
    assert [m for m in modules if m.endswith(".gate")] == [f"layers.{i}.gate" for i in range(3)]
    assert "layers.0.norm" in modules and "layers.0" not in modules  # the blocks themselves were traced into
    assert not any(isinstance(v, torch.fx.Proxy) for b in model.layers for v in vars(b).values())
    for x in (torch.randn(4, 8), -torch.ones(1, 8)):  # both branches of Gate, another batch size
        with torch.no_grad():
            want = model(x)
        assert torch.allclose(sg.run(x=x), want)
        assert model.layers[0].calls == x.shape[0]


def _layer_errors(out: Path) -> list[float | None]:
    report = json.loads((out / "quantization_report.json").read_text())
    return [row["rel_error"] for row in report["subgraphs"]]


def _checkpoint(tmp_path: Path, name: str, **kw: object) -> dict[str, torch.Tensor]:
    out = tmp_path / name
    recipe = GPTQModifier(scheme="W4A16", ignore=["lm_head"])
    oneshot(model=oneshot_llama(), dataset=token_data(8), recipe=recipe, output_dir=str(out), **kw)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.parametrize("one_pass", [True, False])
def test_oneshot_full_trace_writes_the_same_checkpoint(tmp_path: Path, one_pass: bool, caplog) -> None:
    want = _checkpoint(tmp_path, "default", one_pass=one_pass)
    with caplog.at_level(logging.INFO, logger="seqcal"):
        got = _checkpoint(tmp_path, "full", one_pass=one_pass, trace_into="all")
    assert "cutting at layers" not in caplog.text  # one pass kept working with the full trace
    assert got.keys() == want.keys() and any(k.endswith("weight_packed") for k in want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
    # The per-layer errors are measured at a target's end also when the target is a region of nodes.
    errors = {name: _layer_errors(tmp_path / name) for name in ("default", "full")}
    assert errors["full"] == errors["default"] and any(e is not None for e in errors["full"])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "seqcal.cli", *args], capture_output=True, text=True, timeout=600
    )


def test_cli_trace_into_all(tokenized_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "full.json"
    run = _cli(
        "trace", "--model", str(tokenized_llama_dir), "--trace-into", "all", "--output", str(out), "--check"
    )
    assert run.returncode == 0, run.stderr
    assert "OK" in run.stdout
    nodes = json.loads(out.read_text())["nodes"]
    assert any(n["target"] == SDPA for n in nodes)
    assert not any(n["op"] == "call_module" and n["target"] == "model.layers.0.self_attn" for n in nodes)
    bad = _cli("trace", "--model", str(tokenized_llama_dir), "--trace-into", "NoSuchModule")
    assert bad.returncode == 2 and "matches no module" in bad.stderr and "Traceback" not in bad.stderr
    depth = _cli("trace", "--model", str(tokenized_llama_dir), "--trace-depth", "1")
    assert depth.returncode == 2 and "--trace-into" in depth.stderr


def test_cli_oneshot_passes_trace_into_on(tokenized_llama_dir: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("GPTQModifier: {scheme: W4A16, ignore: [lm_head]}\n")
    common = ["oneshot", "--model", str(tokenized_llama_dir), "--recipe", str(recipe), "--num-calibration-samples", "2",
              "--max-seq-length", "16", "--plot", "none"]  # fmt: skip
    run = _cli(*common, "--output-dir", str(tmp_path / "full"), "--trace-into", "all")
    assert run.returncode == 0, run.stderr
    assert any((tmp_path / "full").glob("*.safetensors"))
    # the keyword reaches the tracer: a pattern that matches nothing is refused before calibrating
    bad = _cli(*common, "--output-dir", str(tmp_path / "bad"), "--trace-into", "NoSuchModule")
    assert (
        bad.returncode == 2
        and "Traceback" not in bad.stderr
        and "trace_into pattern 'NoSuchModule' matches no module" in bad.stderr
    )
