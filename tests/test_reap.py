"""REAPPruningModifier: the least salient experts of each MoE layer removed, the checkpoint reloads with fewer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from dist_helpers import data, run, stopped_after, tensor_hashes
from save_helpers import tiny_llama
from seqcal.algorithms.reap import add_saliency, plan_drop, retained_experts
from seqcal.checkpoint.streaming import ResumeError
from seqcal.entrypoint import oneshot
from seqcal.experts import linearize_experts
from seqcal.modifiers import REAPPruningModifier
from zoo import ARCHS

ROWS = data(6, 24)
GPTQ = """
GPTQModifier:
  ignore: [lm_head, "re:.*gate$"]
  config_groups:
    g: {targets: [Linear], weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}}
"""
COUNT_KEY = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_local_experts"}


def _keys(folder: Path) -> dict[str, list[int]]:
    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    x = torch.tensor([r["input_ids"] for r in ROWS[:2]])
    with torch.no_grad():
        return model(input_ids=x).logits


def _saliency_of_first_layer(arch: str) -> list[float]:
    """REAP's saliency of layer 0's experts, computed here from the unpruned model's own routing."""
    model = ARCHS[arch].build()
    linearize_experts(model, calibrate_all=False)
    experts = model.model.layers[0].mlp.experts
    seen = []
    handle = experts.register_forward_hook(lambda m, args, out: seen.append(args))
    _logits_all(model)
    handle.remove()
    ((hidden, index, weights),) = seen
    sums, counts = torch.zeros(experts.layout.num_experts), torch.zeros(experts.layout.num_experts)
    with torch.no_grad():
        for e in range(experts.layout.num_experts):
            tokens, slot = torch.where(index == e)
            out = experts._run_expert(experts.get_submodule(str(e)), hidden[tokens])
            sums[e] = (weights[tokens, slot] * out.norm(dim=-1)).sum()
            counts[e] = len(tokens)
    return (sums / counts.clamp(min=1)).tolist()


def _logits_all(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model(input_ids=torch.tensor([r["input_ids"] for r in ROWS]))


def test_saliency_math() -> None:
    sums, counts = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    add_saliency(sums, counts, 1, torch.tensor([0.5, 1.0]), torch.tensor([[3.0, 4.0], [0.0, 2.0]]))
    assert sums.tolist() == [0.0, 4.5, 0.0, 0.0] and counts.tolist() == [0.0, 2.0, 0.0, 0.0]
    # mean saliency, not the sum: expert 0 has the larger sum over more tokens but the lower mean
    assert retained_experts(torch.tensor([6.0, 4.0, 9.0, 1.0]), torch.tensor([6.0, 2.0, 3.0, 1.0]), 2) == [
        1,
        2,
    ]
    assert retained_experts(torch.tensor([1.0, 1.0, 1.0]), torch.ones(3), 1) == [
        1,
        2,
    ]  # ties: lower index goes
    assert retained_experts(torch.tensor([3.0, 1.0, 2.0, 4.0]), torch.ones(4), 2, 1, 2) == [0, 3]
    assert plan_drop(8, 0.25, 2).drop == 2
    assert plan_drop(8, 0.5, 2, groups=2, top_k_groups=2) == plan_drop(8, 0.5, 2, 2, 2)
    assert plan_drop(8, 0.5, 2, groups=2, top_k_groups=2).per_group == 2
    for args, match in [((4, 0.2, 2), "removes no expert"), ((4, 0.75, 2), "fewer than the 2"),
                        ((6, 0.5, 1, 4, 1), "equal routing groups"), ((8, 0.2, 1, 4, 1), "from each of the 4"),
                        ((8, 0.5, 4, 4, 2), "leaves 2 experts")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            plan_drop(*args)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_reap_prunes_the_least_salient_experts_and_the_checkpoint_reloads(arch: str, tmp_path: Path) -> None:
    model = ARCHS[arch].build()
    before = _logits(model)
    report = tmp_path / "report" / "kept.json"
    oneshot(model=model, dataset=ROWS, recipe=f"REAPPruningModifier: {{sparsity: 0.5, report_path: {report}}}",
            max_seq_length=24, output_dir=str(tmp_path / "out"))  # fmt: skip
    kept = json.loads(report.read_text())
    saliency = _saliency_of_first_layer(arch)
    first = kept["model.layers.0.mlp"]
    assert len(first) == 2 and min(saliency[e] for e in first) > max(
        s for e, s in enumerate(saliency) if e not in first
    )
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config[COUNT_KEY[arch]] == 2 and "quantization_config" not in config, config
    keys = _keys(tmp_path / "out")
    experts = {k.split(".experts.")[1].split(".")[0] for k in keys if ".experts." in k}
    assert experts == {"0", "1"}
    assert [s[0] for k, s in keys.items() if k.endswith("mlp.gate.weight") or "moe.gate.weight" in k] == [
        2
    ] * 3
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert torch.equal(_logits(reloaded), _logits(model))
    assert not torch.allclose(_logits(model), before)  # experts are gone: the model computes something else


def test_reap_then_gptq_in_one_recipe_in_either_cut(tmp_path: Path) -> None:
    """REAP reads the experts' outputs, so a run asked for the one-pass cut cuts after each layer: same bytes."""
    recipe = "REAPPruningModifier: {sparsity: 0.5}\n" + GPTQ
    models = {}
    for one_pass in (True, False):
        models[one_pass] = ARCHS["mixtral"].build()
        oneshot(model=models[one_pass], dataset=ROWS, recipe=recipe, max_seq_length=24,
                output_dir=str(tmp_path / str(one_pass)), one_pass=one_pass)  # fmt: skip
    assert tensor_hashes(tmp_path / "True") == tensor_hashes(tmp_path / "False")
    keys = _keys(tmp_path / "True")
    packed = [k for k in keys if ".experts." in k and k.endswith("weight_packed")]
    assert len(packed) == 3 * 2 * 3  # 3 layers, 2 experts kept, 3 projections, every one quantized
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "True").eval()
    torch.testing.assert_close(_logits(reloaded), _logits(models[True]), atol=1e-5, rtol=1e-5)


def test_reap_gives_the_same_bytes_from_a_directory_and_for_1_and_2_processes(tmp_path: Path) -> None:
    ARCHS["mixtral"].build().save_pretrained(tmp_path / "model")
    args = {
        "dataset": data(5, 24),
        "recipe": "REAPPruningModifier: {sparsity: 0.5}\n" + GPTQ,
        "max_seq_length": 24,
    }
    oneshot(model=ARCHS["mixtral"].build(), output_dir=str(tmp_path / "ram"), **args)
    run(1, tmp_path / "e1", model=str(tmp_path / "model"), output_dir=str(tmp_path / "w1"), **args)
    run(2, tmp_path / "e2", model=str(tmp_path / "model"), output_dir=str(tmp_path / "w2"), **args)
    one = tensor_hashes(tmp_path / "w1")
    assert len(one) > 50 and one == tensor_hashes(tmp_path / "w2") == tensor_hashes(tmp_path / "ram")


def test_reap_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    for kwargs, match in [({}, "sparsity must be a number"), ({"sparsity": 1.0}, r"must be in \(0, 1\)"),
                          ({"sparsity": 0.5, "report_path": "kept.txt"}, "must name a .json file"),
                          ({"sparsity": 0.5, "ignore": [3]}, "list of patterns")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            REAPPruningModifier(**kwargs)
    cases = [
        (tiny_llama(), "REAPPruningModifier: {sparsity: 0.5}", "has no mixture-of-experts layer"),
        (ARCHS["mixtral"].build(), "REAPPruningModifier: {sparsity: 0.5, ignore: ['layers\\.0\\.']}",
         "ignore leaves model.layers.0.mlp unpruned"),
        (ARCHS["mixtral"].build(), "REAPPruningModifier: {sparsity: 0.75}", "fewer than the 2 it picks"),
    ]  # fmt: skip
    for model, recipe, match in cases:
        with pytest.raises(ValueError, match=match):
            oneshot(model=model, dataset=ROWS, recipe=recipe, max_seq_length=24)
    # every MoE layer ignored: nothing to prune, the model is left whole
    model = ARCHS["mixtral"].build()
    before = _logits(model)
    oneshot(model=model, dataset=ROWS, recipe="REAPPruningModifier: {sparsity: 0.5, ignore: ['re:.*']}",
            max_seq_length=24)  # fmt: skip
    assert torch.equal(_logits(model), before)


def test_reap_prunes_each_routing_group_of_a_group_limited_router(tmp_path: Path) -> None:
    """DeepSeek-V3 routes within groups of experts: each group loses as many, the correction bias follows."""
    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                              n_shared_experts=1, n_group=2, topk_group=2, num_experts_per_tok=2,
                              first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=16, tie_word_embeddings=False)  # fmt: skip
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_()  # routing that depends on it
    report = tmp_path / "kept.json"
    oneshot(model=model, dataset=ROWS, recipe=f"REAPPruningModifier: {{sparsity: 0.5, report_path: {report}}}",
            max_seq_length=24, output_dir=str(tmp_path / "out"))  # fmt: skip
    (kept,) = json.loads(report.read_text()).values()
    assert sum(e < 4 for e in kept) == sum(e >= 4 for e in kept) == 2
    assert json.loads((tmp_path / "out" / "config.json").read_text())["n_routed_experts"] == 4
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert torch.equal(_logits(reloaded), _logits(model))


def test_reap_refuses_to_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = {"dataset": ROWS, "recipe": "REAPPruningModifier: {sparsity: 0.5}", "max_seq_length": 24,
            "output_dir": str(tmp_path / "out")}  # fmt: skip
    stopped_after(monkeypatch, 2, model=ARCHS["mixtral"].build(), **args)
    with pytest.raises(ResumeError, match="REAPPruningModifier, which cannot be resumed"):
        oneshot(model=ARCHS["mixtral"].build(), resume=True, **args)
