"""Subgraphs cut before the quantized modules (one pass per module group) and how the pipeline uses them."""

from __future__ import annotations

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
