"""Mixture-of-experts models: every routed expert is a quantization target, calibrated, and saved per expert."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from save_helpers import checkpoint_tensors
from seqcal.entrypoint import oneshot
from seqcal.execution.pipeline import PipelineArgs, run_pipeline
from seqcal.execution.store import load_offloaded
from seqcal.experts import LinearExperts, every_token, linearize_experts
from seqcal.modifiers import GPTQModifier, QuantizationModifier, RunState
from zoo import ARCHS

MOE = [name for name, spec in ARCHS.items() if name in
       ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "gpt_oss", "granitemoe", "jamba", "qwen3_next")]  # fmt: skip
RECIPE = "GPTQModifier: {scheme: W8A16, ignore: [lm_head]}"


def tiny_qwen3_moe(experts: int = 8, intermediate: int = 128) -> Qwen3MoeForCausalLM:
    """2 layers, 8 experts top-2; widths that W8A16's group of 128 divides."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=intermediate,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=experts, num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    return Qwen3MoeForCausalLM(config).eval()


def data(n: int = 6, length: int = 32) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(3, 256, (length,), generator=g).tolist()} for _ in range(n)]


@pytest.mark.parametrize("arch", MOE)
def test_linearized_experts_compute_what_fused_ones_do(arch: str) -> None:
    """Per-expert Linears give the fused module's outputs (routed and all-experts mode); restore is exact."""
    spec = ARCHS[arch]
    model = spec.build()
    inputs = spec.make_inputs(model, batch=2, seq_len=7, left_pad=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        reference = model(**inputs).logits
        handle = linearize_experts(model, calibrate_all=True)
        projections = [
            n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".experts." in n
        ]
        with every_token(model, projections):  # every expert on every token, as while calibrating
            every = model(**inputs).logits
        for module in handle.replaced.values():
            module.calibrate_all = False
        routed = model(**inputs).logits
        linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".experts." in n]
        layouts = list(handle.replaced.values())
        handle.restore()
        restored = model(**inputs).logits
    per_layer = sum(m.layout.num_experts * 3 for m in layouts)
    assert handle.count == 0 and len(linears) == per_layer > 0
    torch.testing.assert_close(every, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(routed, reference, atol=1e-5, rtol=1e-5)
    assert torch.equal(restored, reference)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert not any(isinstance(m, LinearExperts) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())  # as transformers built them


def test_expert_names_follow_the_original_checkpoint(caplog: pytest.LogCaptureFixture) -> None:
    """Mixtral's checkpoints call the projections w1/w3/w2 (transformers' conversions say so); GPT-OSS stores
    its experts fused, so a per-expert quantized checkpoint is one transformers cannot load: said loudly."""
    caplog.set_level(logging.WARNING, logger="seqcal")
    mixtral = ARCHS["mixtral"].build()
    linearize_experts(mixtral)
    assert "fused in its own checkpoints" not in caplog.text
    names = {n for n, m in mixtral.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {"model.layers.0.mlp.experts.3.w1", "model.layers.0.mlp.experts.3.w3",
            "model.layers.0.mlp.experts.3.w2"} <= names  # fmt: skip
    gpt_oss = ARCHS["gpt_oss"].build()
    expert = gpt_oss.model.layers[0].mlp.experts
    gate_up, bias = expert.gate_up_proj[2].detach().clone(), expert.gate_up_proj_bias[2].detach().clone()
    linearize_experts(gpt_oss)
    assert "GptOssForCausalLM stores its experts fused in its own checkpoints" in caplog.text
    linear = gpt_oss.model.layers[0].mlp.experts.get_submodule("2")
    # GPT-OSS stores [H, 2I] transposed with gate and up interleaved by column
    assert torch.equal(linear.gate_proj.weight, gate_up[:, 0::2].T) and torch.equal(
        linear.up_proj.bias, bias[1::2]
    )


def test_oneshot_quantizes_every_expert_in_memory_and_offloaded(tmp_path: Path) -> None:
    """All 48 expert projections and 8 attention projections come out quantized, per expert, either way."""
    model = tiny_qwen3_moe()
    model.save_pretrained(tmp_path / "src")
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    returned = oneshot(model=model, dataset=data(), recipe=RECIPE, output_dir=str(tmp_path / "a"))
    oneshot(model=str(tmp_path / "src"), dataset=data(), recipe=RECIPE, output_dir=str(tmp_path / "b"))
    a, b = checkpoint_tensors(tmp_path / "a"), checkpoint_tensors(tmp_path / "b")
    packed = [k for k in a if k.endswith("weight_packed")]
    experts = [k for k in packed if ".mlp.experts." in k]
    assert len(experts) == 2 * 8 * 3 and len(packed) == 56
    assert "model.layers.1.mlp.experts.7.down_proj.weight_packed" in a
    assert a["model.layers.1.mlp.experts.7.down_proj.weight_packed"].shape == (128, 128 // 4)  # int8 in int32
    assert not any(".experts.gate_up_proj" in k or k.endswith("experts.down_proj") for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # offloaded == in memory
    # the returned model has its fused experts back, holding the quantized values
    fused = returned.model.layers[1].mlp.experts
    assert type(fused).__name__ == "Qwen3MoeExperts" and fused.gate_up_proj.shape == (8, 256, 128)
    changed = reference["model.layers.1.mlp.experts.down_proj"] - fused.down_proj.detach()
    assert (
        changed.abs().max() > 0
        and changed.norm() / reference["model.layers.1.mlp.experts.down_proj"].norm() < 0.02
    )
    config = json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]
    # the routers are Linear layers in vLLM, which would quantize them unless ignored
    assert config["ignore"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"]


def test_reload_gives_the_fake_quantized_logits(tmp_path: Path) -> None:
    """transformers 5.24 loads the per-expert compressed checkpoint into its fused experts."""
    model = tiny_qwen3_moe(experts=4)
    oneshot(model=model, dataset=data(), recipe=RECIPE, output_dir=str(tmp_path))
    ids = torch.tensor([data(1)[0]["input_ids"]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        got = reloaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "granitemoe"])
def test_offloaded_store_reads_each_expert(arch: str, tmp_path: Path) -> None:
    """Renamed (Mixtral's block_sparse_moe) and fused-on-disk (GPT-OSS, GraniteMoE) experts load offloaded."""
    model = ARCHS[arch].build()
    model.save_pretrained(tmp_path)
    linearize_experts(model)
    want = dict(model.named_parameters())
    skeleton, store = load_offloaded(tmp_path, dtype=torch.float32)
    assert all(p.is_meta for p in skeleton.parameters())
    names = [n for n, _ in skeleton.named_parameters()]
    assert names == list(want) and any(".experts.3." in n for n in names)
    for name in names:
        assert torch.equal(store.read(name), want[name].detach()), name


def channel_gptq(bits: int) -> str:
    """GPTQ of every Linear but lm_head, int per output channel (fits any width of a tiny model)."""
    return (
        "GPTQModifier: {ignore: [lm_head], config_groups: {group_0: {targets: [Linear], weights: "
        f"{{num_bits: {bits}, type: int, symmetric: true, strategy: channel}}}}}}}}"
    )


def test_offloaded_jamba_checks_its_partition(tmp_path: Path) -> None:
    """Jamba's Mamba mixer reads ``dt_proj.bias`` without calling ``dt_proj``: the check of the partition
    against the model's own forward, on offloaded weights, onloads a whole layer around its call."""
    ARCHS["jamba"].build().save_pretrained(tmp_path / "src")
    recipe = channel_gptq(4)
    oneshot(model=str(tmp_path / "src"), dataset=data(2, 16), recipe=recipe, output_dir=str(tmp_path / "out"))
    packed = [
        k for k in checkpoint_tensors(tmp_path / "out") if ".experts." in k and k.endswith("weight_packed")
    ]
    assert len(packed) == 4 * 3  # the one MoE layer's 4 experts


def test_a_parameter_of_the_base_model_does_not_pull_every_layer_into_the_first_subgraph(
    tmp_path: Path,
) -> None:
    """Zaya's base model holds an input scale and bias of its own, read beside its layers: the first subgraph
    used to take the whole base model (onloading every layer, and GPTQ solving layer 1 there, before its
    calibration, round to nearest); each layer now stays in its own subgraph and is calibrated."""
    autozoo = pytest.importorskip("autozoo")
    arch = autozoo.candidates().get("zaya")
    if arch is None:
        pytest.skip("this transformers has no Zaya")
    autozoo.build(arch).save_pretrained(tmp_path / "src")
    recipe = channel_gptq(8)
    oneshot(model=str(tmp_path / "src"), dataset=data(2, 16), recipe=recipe, output_dir=str(tmp_path / "out"))
    report = json.loads((tmp_path / "out" / "quantization_report.json").read_text())
    assert not [line for line in report["log"] if "never called" in line], report["log"][:3]
    packed = [
        k for k in checkpoint_tensors(tmp_path / "out") if ".experts." in k and k.endswith("weight_packed")
    ]
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    assert len(packed) == config["num_hidden_layers"] * config["num_experts"] * 3


def test_a_checkpoint_transformers_merges_on_load_is_refused_offloaded_with_the_way_that_works(
    tmp_path: Path,
) -> None:
    """Kimi-Linear's checkpoint stores q/k/v_conv1d that transformers concatenates into conv1d as it loads:
    the offloaded loader says so and what to do; the model loaded in memory quantizes every expert."""
    from seqcal.errors import ModelLoadError

    autozoo = pytest.importorskip("autozoo")
    arch = autozoo.candidates().get("kimi_linear")
    if arch is None:
        pytest.skip("this transformers has no Kimi-Linear")
    autozoo.build(arch).save_pretrained(tmp_path / "src")
    recipe = channel_gptq(8)
    with pytest.raises(
        ModelLoadError, match=r"conv1d\.weight from checkpoint tensors .*merges or splits .*from_pretrained"
    ):
        oneshot(
            model=str(tmp_path / "src"), dataset=data(2, 16), recipe=recipe, output_dir=str(tmp_path / "a")
        )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    oneshot(model=model, dataset=data(2, 16), recipe=recipe, output_dir=str(tmp_path / "b"))
    packed = [
        k for k in checkpoint_tensors(tmp_path / "b") if ".experts." in k and k.endswith("weight_packed")
    ]
    experts = sum(1 for n, _ in model.named_modules() if n.endswith(".experts"))
    assert experts and len(packed) == experts * model.config.num_experts * 3


class StackedExperts(torch.nn.Module):
    """Experts stacked in a 3-D parameter by a class transformers' experts decorator did not build."""


def test_fused_weights_seqcal_cannot_split_are_refused() -> None:
    """Stacked expert weights outside transformers' experts machinery are refused, not saved dense silently."""
    model = tiny_qwen3_moe(experts=4)
    experts = model.model.layers[0].mlp.experts  # replaced by a stand-in outside transformers' machinery
    stand_in = StackedExperts()
    stand_in.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach().clone())
    model.model.layers[0].mlp.experts = stand_in
    assert linearize_experts(model).count == 4 * 3  # layer 1's experts; layer 0's stand-in stays fused
    with pytest.raises(
        ValueError, match=r"model.layers.0.mlp.experts .*gate_up_proj \[4, 256, 128\].*ignore"
    ):
        QuantizationModifier(scheme="W8A16", ignore=["lm_head"]).validate(model)
    # targets that do not reach it, or an ignore entry, keep it in full precision knowingly
    QuantizationModifier(scheme="W8A16", targets=["re:.*self_attn.*"]).validate(model)
    QuantizationModifier(
        scheme="W8A16", ignore=["lm_head", r"re:model\.layers\.\d+\.mlp\.experts$"]
    ).validate(model)


def test_recipes_reach_experts_by_pattern() -> None:
    model = tiny_qwen3_moe(experts=4)
    linearize_experts(model)
    modifier = QuantizationModifier(scheme="W8A16", targets=["re:.*experts.*down_proj"])
    modifier.validate(model)
    assert sorted(modifier.modules) == sorted(f"model.layers.{i}.mlp.experts.{e}.down_proj"
                                              for i in range(2) for e in range(4))  # fmt: skip
    with pytest.raises(ValueError, match="matches no module"):
        QuantizationModifier(scheme="W8A16", targets=["re:.*experts.*donw_proj"]).validate(model)
    narrow = tiny_qwen3_moe(experts=4)
    narrow.model.layers[1].mlp.experts.down_proj.data = narrow.model.layers[1].mlp.experts.down_proj.data[
        ..., :96
    ]
    linearize_experts(narrow)  # a scheme that does not fit an expert's shape: refused before calibration
    with pytest.raises(
        ValueError, match=r"group_size 128 .* model.layers.1.mlp.experts.0.down_proj \(96 inputs\)"
    ):
        QuantizationModifier(scheme="W8A16").validate(narrow)


def _calibrate(calibrate_all: bool, samples: list[dict[str, list[int]]]) -> tuple[torch.nn.Module, RunState]:
    """GPTQ W8A16 through the sequential pipeline on the tiny Qwen3-MoE; its model (linearized) and state."""
    model = tiny_qwen3_moe()
    modifier = GPTQModifier(scheme="W8A16", ignore=["lm_head"])
    linearize_experts(model, calibrate_all=calibrate_all)
    modifier.validate(model)
    batches = [{"input_ids": torch.tensor([row["input_ids"]])} for row in samples]
    return model, run_pipeline(model, None, [modifier], None, PipelineArgs(), batches=batches)


def test_all_experts_calibration_gives_every_expert_a_hessian() -> None:
    """All-experts mode: every expert's Hessian holds every token; routed mode on 8 tokens leaves experts
    without tokens, which fall back to round-to-nearest and are logged by name."""
    _, every = _calibrate(True, data(1, 8))
    tokens = {n: e["tokens"] for n, e in every.results.module_errors.items() if ".experts." in n}
    assert len(tokens) == 48 and set(tokens.values()) == {8}
    assert not any("never called" in line for line in every.results.log)
    _, routed = _calibrate(False, data(1, 8))
    starved = [line.split(":")[0] for line in routed.results.log if "never called" in line]
    assert starved and all(".mlp.experts." in name for name in starved)  # 16 routings cannot reach 16 experts
    assert all(
        name not in routed.results.module_errors or "tokens" not in routed.results.module_errors[name]
        for name in starved
    )
    seen = [
        e["tokens"] for n, e in routed.results.module_errors.items() if ".experts." in n and "tokens" in e
    ]
    assert seen and max(seen) < 8 * 2


def test_all_experts_calibration_is_not_worse_than_routed() -> None:
    """Output error of the quantized model (vs full precision) on held-out text: all-experts <= routed."""
    reference = tiny_qwen3_moe()
    held_out = torch.tensor([row["input_ids"] for row in data(4, 32)[2:]])
    errors = {}
    for mode in (True, False):
        model, _ = _calibrate(mode, data(2, 16))
        with torch.no_grad():
            got, want = model(input_ids=held_out).logits, reference(input_ids=held_out).logits
        errors[mode] = ((got - want).norm() / want.norm()).item()
    assert errors[True] <= errors[False], errors


def test_moe_calibrate_all_experts_on_the_command_line(tmp_path: Path) -> None:
    """``seqcal oneshot --no-moe-calibrate-all-experts`` calibrates on routed tokens only: on 8 tokens some
    experts get none, and the report names them (round-to-nearest) and counts the tokens of the others."""
    import os
    import subprocess
    import sys

    tiny_qwen3_moe().save_pretrained(tmp_path / "src")
    (tmp_path / "data.jsonl").write_text(json.dumps(data(1, 8)[0]))
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "seqcal.cli", "oneshot", "--model", str(tmp_path / "src"), "--dataset",
         str(tmp_path / "data.jsonl"), "--num-calibration-samples", "1", "--max-seq-length", "8", "--recipe",
         RECIPE, "--output-dir", str(out), "--no-moe-calibrate-all-experts", "--plot", "none"],
        capture_output=True, text=True, env=os.environ, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "quantization_report.json").read_text())
    starved = [line.split(":")[0] for line in report["log"] if "never called" in line]
    assert starved and all(".mlp.experts." in name for name in starved)
    tokens = [e["tokens"] for n, e in report["modules"].items() if ".experts." in n and "tokens" in e]
    assert tokens and max(tokens) < 16


def test_plan_counts_one_gate_up_hessian_per_layer_with_all_experts() -> None:
    """``seqcal plan`` / dry_run: all-experts calibration holds one gate/up Hessian per MoE layer, not E."""
    from seqcal.plan import make_plan

    hessians = {}
    for mode in (True, False):
        model = tiny_qwen3_moe(intermediate=256)  # gate/up read 128 features, down 256
        linearize_experts(model, calibrate_all=mode)
        modifier = GPTQModifier(scheme="W8A16", ignore=["lm_head"])
        modifier.validate(model)
        plan = make_plan(model, [modifier], num_samples=4, seq_len=16, batch_size=1, sequential_targets=None,
                         tracing_ignore=[])  # fmt: skip
        hessians[mode] = max(row.hessians for row in plan.rows)
    # per layer: the attention's (the plan keys them by parent and width: one), gate/up's (shared by the 8
    # experts, or one per expert) and 8 down projections'
    one, down = 128 * 128 * 4, 8 * 256 * 256 * 4
    assert hessians == {True: 1 * one + one + down, False: 1 * one + 8 * one + down}


def test_one_pass_cut_declines_for_routed_experts(caplog: pytest.LogCaptureFixture) -> None:
    """Experts run in a loop over their routed tokens: the pipeline cuts at layers, and says why."""
    from seqcal.execution.pipeline import one_pass_subgraphs

    caplog.set_level(logging.INFO, logger="seqcal")
    model = tiny_qwen3_moe(experts=4)
    linearize_experts(model)
    modifier = GPTQModifier(scheme="W8A16", ignore=["lm_head"])
    modifier.validate(model)
    sample = {"input_ids": torch.tensor([data(1, 8)[0]["input_ids"]]), "use_cache": False}
    assert one_pass_subgraphs(model, sample, [modifier], PipelineArgs()) is None
    assert "model.layers.0.mlp.experts.0.down_proj run in a data-dependent loop" in caplog.text
