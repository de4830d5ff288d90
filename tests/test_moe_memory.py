"""Memory of mixture-of-experts runs: stacked expert solves in chunks sized from the budget, and experts fed
every token only while their Hessians accumulate."""

from __future__ import annotations

import logging

import pytest
import torch

import seqcal.modifiers.solve_chunks as solve_chunks
from seqcal.execution.pipeline import PipelineArgs, run_pipeline
from seqcal.experts import LinearExperts, every_token, linearize_experts
from seqcal.modifiers import GPTQModifier, RunState
from seqcal.plan import make_plan
from test_moe import data, tiny_qwen3_moe

THREE_EXPERTS = solve_chunks.stacked_bytes(3 * 128, 128)  # the gate (or up) rows of three tiny experts


def _calibrate(samples: list[dict[str, list[int]]], **args: object) -> tuple[torch.nn.Module, RunState]:
    """GPTQ W8A16 of the tiny Qwen3-MoE (8 experts, all-experts calibration) through the sequential pipeline."""
    model = tiny_qwen3_moe()
    modifier = GPTQModifier(scheme="W8A16", ignore=["lm_head"])
    linearize_experts(model, calibrate_all=True)
    modifier.validate(model)
    batches = [{"input_ids": torch.tensor([row["input_ids"]])} for row in samples]
    return model, run_pipeline(model, None, [modifier], None, PipelineArgs(**args), batches=batches)


def _chunks(state: RunState, layer: int | None = None) -> set[float]:
    """The chunk counts reported for the experts' gate/up solves (of one layer, or all)."""
    prefix = "" if layer is None else f"model.layers.{layer}."
    return {e["solve_chunks"] for n, e in state.results.module_errors.items()
            if n.startswith(prefix) and n.endswith("experts.0.gate_proj")}  # fmt: skip


def test_chunked_solves_equal_the_unchunked_one(monkeypatch: pytest.MonkeyPatch, caplog) -> None:  # noqa: ANN001
    """A small floor splits a layer's gate/up projections (one Hessian in all-experts mode) into solves of
    three modules; rows are independent given H, so the quantized weights are those of one stacked solve."""
    import seqcal.modifiers.gptq as gptq

    samples = data(2, 16)
    whole, state = _calibrate(samples, max_device_memory=8 << 30)  # room for the whole stack: one solve
    assert _chunks(state) == {1}
    solves: list[int] = []
    solve = gptq.GPTQModifier._solve

    def counting(self, names, model, H, state):  # noqa: ANN001, ANN202
        solves.append(len(names))
        return solve(self, names, model, H, state)

    monkeypatch.setattr(gptq.GPTQModifier, "_solve", counting)
    monkeypatch.setattr(solve_chunks, "SOLVE_MIN_BYTES", THREE_EXPERTS)
    caplog.set_level(logging.INFO, logger="seqcal")
    chunked, state = _calibrate(samples)  # no budget: the q/k/v solve's size (smaller), raised to the floor
    assert max(solves) == 3 and len(solves) > 2 * 2 + 2 * 8  # gate/up of 8 experts in chunks of 3, per layer
    assert _chunks(state) == {6}  # 16 modules, 3 at a time
    assert any(
        "16 modules sharing one Hessian" in r.message and "6 chunks" in r.message for r in caplog.records
    )
    for (name, a), (_, b) in zip(whole.named_parameters(), chunked.named_parameters()):
        assert torch.equal(a, b), name


def test_chunk_is_what_the_device_budget_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """With max_device_memory a solve takes three quarters of what the subgraph's weights, its Hessians and
    the solve's inverse factor leave of it."""
    monkeypatch.setattr(solve_chunks, "SOLVE_MIN_BYTES", 1)
    model = tiny_qwen3_moe()
    layer = sum(p.nbytes for p in model.model.layers[1].parameters())  # the second layer's own subgraph
    # q/k/v, o, gate/up (shared by the experts) and 8 down projections, all reading 128 features; one more
    # [128, 128] for the inverse factor
    hessians = (1 + 1 + 1 + 8 + 1) * 128 * 128 * 4
    left = 4 * THREE_EXPERTS // 3
    _, state = _calibrate(data(1, 16), max_device_memory=layer + hessians + left)
    assert _chunks(state, layer=1) == {6}  # 16 modules, 3 at a time
    assert solve_chunks.chunk_bytes(0, budget=10, resident=20) == 1  # never below the floor


def test_plan_shows_expert_chunks_under_a_small_budget() -> None:
    """``seqcal plan`` / dry_run: a layer of 128 experts under a small budget is solved in chunks (column
    ``chunks``); with room enough, in one."""
    model = tiny_qwen3_moe(experts=128)
    linearize_experts(model)
    modifier = GPTQModifier(scheme="W8A16", ignore=["lm_head"])
    modifier.validate(model)
    plans = {
        budget: make_plan(
            model,
            [modifier],
            num_samples=4,
            seq_len=16,
            batch_size=1,
            sequential_targets=None,
            tracing_ignore=[],
            max_device_memory=budget,
        )  # fmt: skip
        for budget in (60 * 10**6, 8 * 10**9)
    }
    small, large = plans.values()
    stack = solve_chunks.stacked_bytes(128 * 2 * 128, 128)  # gate/up of 128 experts: 64 MiB
    layers = [r for r in small.rows if r.targets]
    assert all(r.chunks == -(-stack // r.chunk_bytes) >= 4 for r in layers), small.table()
    assert f"{layers[0].chunks}x{layers[0].chunk_bytes / 2**20:.0f}M" in small.table()
    assert small.device_peak <= 60 * 10**6 < large.device_peak
    assert all(r.chunks == 1 for r in large.rows)


def test_plan_over_budget_cuts_a_qwen3_moe_layer_at_its_children() -> None:
    """A budget the layer cut exceeds makes the plan cut at attention and MoE block, not at the RMSNorm
    class that is also inside the attention (q/k norms: nested targets)."""
    model = tiny_qwen3_moe(experts=128)
    linearize_experts(model)
    modifier = GPTQModifier(scheme="W8A16", ignore=["lm_head"])
    modifier.validate(model)
    plan = make_plan(model, [modifier], num_samples=4, seq_len=16, batch_size=1, sequential_targets=None,
                     tracing_ignore=[], max_device_memory=10**6)  # fmt: skip
    assert plan.targets == ["Qwen3MoeAttention", "Qwen3MoeSparseMoeBlock"]


def test_experts_see_every_token_only_while_hessians_accumulate() -> None:
    """The calibration pass runs each expert on all tokens (8 experts x 16 tokens per layer), the
    propagation pass only on the routed ones (16 tokens x top-2), and outputs do not change."""
    model = tiny_qwen3_moe()
    linearize_experts(model, calibrate_all=True)
    seen: list[int] = []
    gates = [m for n, m in model.named_modules() if n.endswith("gate_proj") and ".experts." in n]
    for gate in gates:
        gate.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    ids = torch.tensor([data(1, 16)[0]["input_ids"]])
    with torch.no_grad():
        routed = model(input_ids=ids).logits
        assert sum(seen) == 2 * 16 * 2  # per layer: 16 tokens, top-2
        seen.clear()
        with every_token(model, [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]):
            every = model(input_ids=ids).logits
        assert sum(seen) == 2 * 16 * 8
    torch.testing.assert_close(every, routed, atol=1e-5, rtol=1e-5)
    assert not any(m.observed for m in model.modules() if isinstance(m, LinearExperts))

    seen.clear()
    modifier = GPTQModifier(scheme="W8A16", ignore=["lm_head"])
    modifier.validate(model)
    run_pipeline(model, None, [modifier], None, PipelineArgs(verify=False), batches=[{"input_ids": ids}])
    # per layer: the calibration pass runs the 8 experts on 16 tokens each, the propagation the routed ones
    assert seen[:8] == [16] * 8 and sum(seen) == 2 * (16 * 8 + 16 * 2)
