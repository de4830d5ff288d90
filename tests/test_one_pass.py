"""Subgraphs cut before the quantized modules (one pass per module group) and how the pipeline uses them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from seqcal import trace_subgraphs
from seqcal.entrypoint import oneshot
from seqcal.execution.pipeline import PipelineArgs, one_pass_subgraphs
from seqcal.experts import linearize_experts
from seqcal.modifiers import GPTQModifier, QuantizationModifier
from seqcal.tracing.partition import OnePassError, partition
from test_oneshot import tiny_llama, token_data
from test_trace_equivalence import SUPPORTED, assert_same_outputs
from zoo import ARCHS


def _sample(ids: torch.Tensor) -> dict[str, Any]:
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}


def test_groups_follow_shared_inputs_and_read_them_from_the_cache() -> None:
    model = tiny_llama()
    subgraphs = trace_subgraphs(model, _sample(torch.randint(0, 256, (1, 16))), ["re:.*_proj$"], cut="before")
    groups = [[t.rsplit(".", 1)[1] for t in sg.targets] for sg in subgraphs]
    assert (
        groups
        == [[]] + [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]] * 2
    )
    for sg in subgraphs[1:]:
        assert sg.target_inputs and all(name in sg.inputs for name in sg.target_inputs)
        assert sorted(n for names in sg.target_inputs.values() for n in names) == sorted(sg.targets)
        assert sg.nodes[0].op == "call_module" and sg.nodes[0].target == sg.targets[0]  # starts with a target
    # The attention module handed to sdpa_attention_forward is used as itself, not as its whole layer:
    # the q/k/v subgraph must not onload the MLP.
    qkv = subgraphs[1]
    assert "model.layers.0.self_attn" in qkv.modules and "model.layers.0" not in qkv.modules
    assert not any(".mlp" in m for m in qkv.modules)
    ids = torch.randint(0, 256, (2, 11))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert_same_outputs(subgraphs.run(input_ids=ids, attention_mask=mask, use_cache=False), want)


def test_a_module_called_twice_cannot_be_cut_before() -> None:
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(torch.relu(self.proj(x)))

    graph = torch.fx.symbolic_trace(Twice()).graph
    with pytest.raises(OnePassError, match="proj is called more than once"):
        partition(graph, ["proj"], cut="before")


@pytest.mark.parametrize("name", SUPPORTED)
def test_zoo_cut_before_modules_equals_eager_or_declines(name: str) -> None:
    """Every architecture either runs cut before its Linear modules exactly as eager, or keeps the layer cut."""
    spec = ARCHS[name]
    model = spec.build()
    linearize_experts(model)  # MoE experts as per-expert Linears, as oneshot quantizes them
    # per channel (W8A8's weights): the tiny zoo models' widths are not multiples of a group of 128
    gptq = GPTQModifier(scheme="W8A8", ignore=["re:.*lm_head", "re:.*embed.*", "re:.*(vision|visual).*"])
    try:
        gptq.validate(model)
    except ValueError as err:
        if "no Linear layer matches" not in str(err):
            raise
        pytest.skip(f"{name} has no Linear module to quantize")
    subgraphs = one_pass_subgraphs(
        model, spec.make_inputs(model, batch=1, seq_len=12), [gptq], PipelineArgs()
    )
    if subgraphs is None:  # declined (logged); the pipeline then cuts after each layer
        return
    inputs = spec.make_inputs(model, batch=2, seq_len=9, left_pad=3)
    with torch.no_grad():
        want = model(**inputs)
    assert_same_outputs(subgraphs.run(**inputs), want)
    assert sorted(subgraphs.targets) == sorted(gptq.modules)


def _count_calls(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_each_layer_runs_once_per_batch_with_one_pass_and_twice_with_the_layer_cut() -> None:
    for one_pass, passes in [(True, 1), (False, 2)]:
        model = tiny_llama()
        norm = _count_calls(model.model.layers[1].post_attention_layernorm)
        oneshot(
            model=model,
            dataset=token_data(6),
            recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
            one_pass=one_pass,
            batch_size=1,
        )  # fmt: skip  (per sample, also where CUDA makes it "auto")
        assert norm[0] == passes * 6 + 2  # + the check before calibrating: one eager, one partitioned run


def test_round_to_nearest_runs_no_forward_pass() -> None:
    model = tiny_llama()
    reference = tiny_llama()
    layer = _count_calls(model.model.layers[0].self_attn.o_proj)
    oneshot(
        model=model, dataset=token_data(4), recipe=QuantizationModifier(scheme="W4A16", ignore=["lm_head"])
    )
    assert layer[0] == 0
    datafree = tiny_llama()
    oneshot(
        model=datafree, recipe=QuantizationModifier(scheme="W4A16", ignore=["lm_head"]), pipeline="datafree"
    )
    for (name, a), b in zip(model.named_parameters(), datafree.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(
        model.model.layers[0].self_attn.o_proj.weight, reference.model.layers[0].self_attn.o_proj.weight
    )


def test_one_pass_gptq_is_at_least_as_good_as_the_layer_cut() -> None:
    from test_oneshot import _output_error

    reference = tiny_llama()
    errors = {}
    for one_pass in (True, False):
        model = tiny_llama()
        oneshot(model=model, dataset=token_data(32, 48), recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
                one_pass=one_pass)  # fmt: skip
        errors[one_pass] = _output_error(model, reference)
    assert errors[True] <= 1.05 * errors[False]


def test_modules_outside_the_layers_keep_the_layer_cut() -> None:
    model = tiny_llama()
    gptq = GPTQModifier(scheme="W4A16")  # lm_head too: it is not inside a decoder layer
    gptq.validate(model)
    sample = _sample(torch.randint(0, 256, (1, 8)))
    assert one_pass_subgraphs(model, sample, [gptq], PipelineArgs()) is None
    assert one_pass_subgraphs(model, sample, [gptq], PipelineArgs(one_pass=False)) is None


def test_a_target_whose_parent_runs_before_its_group_keeps_the_layer_cut(tmp_path: Path) -> None:
    # o_proj and down_proj only: the first subgraph reads self_attn (q/k/v are not targets), so it holds o_proj;
    # compressing it there would quantize o_proj round-to-nearest before any of its inputs were seen.
    model = tiny_llama()
    gptq = GPTQModifier(targets=["re:.*o_proj$", "re:.*down_proj$"], scheme="W4A16", ignore=["lm_head"])
    gptq.validate(model)
    sample = _sample(torch.randint(0, 256, (1, 8)))
    assert one_pass_subgraphs(model, sample, [gptq], PipelineArgs()) is None
    run = GPTQModifier(targets=["re:.*o_proj$", "re:.*down_proj$"], scheme="W4A16", ignore=["lm_head"])
    oneshot(model=tiny_llama(), dataset=token_data(8), recipe=run, num_calibration_samples=8, max_seq_length=32,
            output_dir=tmp_path)  # fmt: skip
    report = json.loads((tmp_path / "quantization_report.json").read_text())
    assert not [line for line in report["log"] if "never called" in line], report["log"]


def test_no_cached_input_is_held_through_the_solve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A subgraph calibrated from its cached inputs lets each fetched batch go after observing it: none is alive
    while its modules are solved (on a GPU that is a batch of inputs beside the solve's temporaries). The disk tier
    hands out fresh tensors, so a tensor the executor still holds shows as alive."""
    import weakref

    observed: list[weakref.ref] = []
    alive_at_solve: list[int] = []
    observe, compress = GPTQModifier.observe, GPTQModifier.compress

    def observing(self, names, x, state, batch):  # noqa: ANN001, ANN202
        observed.append(weakref.ref(x))
        return observe(self, names, x, state, batch)

    def compressing(self, subgraph, model, state):  # noqa: ANN001, ANN202
        if observed:  # a subgraph whose modules were calibrated from cached inputs
            alive_at_solve.append(sum(ref() is not None for ref in observed))
            observed.clear()
        return compress(self, subgraph, model, state)

    monkeypatch.setattr(GPTQModifier, "observe", observing)
    monkeypatch.setattr(GPTQModifier, "compress", compressing)
    oneshot(model=tiny_llama(), dataset=token_data(4, 16), recipe=GPTQModifier(scheme="W8A16", ignore=["lm_head"]),
            num_calibration_samples=4, max_seq_length=16, offload="disk", batch_size=1)  # fmt: skip
    assert len(alive_at_solve) == 8 and alive_at_solve == [0] * 8  # 2 layers x 4 module groups


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_subgraph_runs_drop_each_value_after_its_last_read() -> None:
    """``GraphRunner.run(..., release=keep)`` frees values as eager code does: after a run only the outputs and
    the kept values are left, a value is gone once the node reading it last has run (the MLP's gate output before
    the product is made), and the outputs are those of a run that keeps every value, bit for bit."""
    from seqcal.recipe import parse_recipe
    from seqcal.tracing.runner import GraphRunner

    model = tiny_llama()
    sample = _sample(torch.randint(0, 256, (2, 16)))
    recipe = parse_recipe("GPTQModifier: {scheme: W8A16, ignore: [lm_head]}")
    recipe.validate(model)
    subgraphs = one_pass_subgraphs(model, sample, recipe.modifiers, PipelineArgs())
    alive: dict[str, set[str]] = {}

    class Watching(GraphRunner):
        def _call(self, node, args, kwargs):  # noqa: ANN001, ANN202
            alive[node.name] = set(self.env)  # the values alive when the node runs
            return super()._call(node, args, kwargs)

    runner = Watching(model)
    env_all = {subgraphs.placeholders[k]: v for k, v in sample.items() if k in subgraphs.placeholders}
    env_rel = dict(env_all)
    with torch.no_grad():
        for sg in subgraphs:
            full = {n: env_all[n] for n in sg.inputs}
            runner.env = {n: env_rel[n] for n in sg.inputs}
            a, b = GraphRunner(model).run(sg, full), runner.run(sg, runner.env, release=())
            assert set(runner.env) <= set(sg.outputs), sg.index
            for name in sg.outputs:
                assert _same(full[name], runner.env[name]), (sg.index, name)
                env_all[name], env_rel[name] = full[name], runner.env[name]
            if sg.returns:
                assert _same(a.logits, b.logits)
    mlp = subgraphs[3]  # gate/up of the first layer
    gate = next(n for n in mlp.nodes if n.op == "call_module" and str(n.target).endswith("gate_proj"))
    (act,) = [n for n in mlp.nodes if gate in n.all_input_nodes]
    (product,) = [n for n in mlp.nodes if act in n.all_input_nodes]
    assert gate.name in alive[act.name] and gate.name not in alive[product.name]
    # a value the caller reads after the run (the executor: the last target's output for the error sample)
    inputs = {n: env_all[n] for n in mlp.inputs}
    with torch.no_grad():
        GraphRunner(model).run(mlp, inputs, release=[gate.name])
    assert set(inputs) == {*mlp.outputs, gate.name}
