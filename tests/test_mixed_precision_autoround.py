"""Mixed precision as AutoRound's option: each unit's width chosen in the pass from min-max error curves (the ranges
AutoRound learns from), within the budget, reloaded by transformers at every width, replayed as an AutoRound
recipe; a candidate AutoRound cannot learn, or a per-tensor one AWQ's duo scaling cannot take, is refused before
calibration."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from save_helpers import checkpoint_tensors
from seqcal.entrypoint import oneshot
from seqcal.modifiers import AutoRoundModifier
from seqcal.modifiers.mixed_allocator import RECIPE_FILENAME
from seqcal.modifiers.mixed_schemes import candidate_scheme
from test_mixed_precision import CANDIDATES, data, report, stored_module_bits, tiny_llama


def _recipe(**mixed: object) -> AutoRoundModifier:
    arguments = {"average_bits": 3.8, "candidates": CANDIDATES, **mixed}
    return AutoRoundModifier(iters=2, amp=False, ignore=["lm_head"], mixed_precision=arguments)


def test_autoround_mixed_meets_budget_reloads_and_replays(tmp_path: Path) -> None:
    out = tmp_path / "out"
    quantized = oneshot(model=tiny_llama(), dataset=data(), recipe=_recipe(), output_dir=str(out), verify=False)
    modules = report(out)
    names = [n for n in modules if modules[n].get("scheme")]
    params = sum(quantized.get_submodule(n).weight.numel() for n in names)
    assert len(names) == 21 and stored_module_bits(out, names) / params <= 3.8
    assert len({modules[n]["scheme"] for n in names}) >= 2
    for layer in range(3):  # q/k/v and gate/up: one width each, as a serving engine fuses them
        for parent, group in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
            assert len({modules[f"model.layers.{layer}.{parent}.{g}"]["scheme"] for g in group}) == 1
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    for n in names:
        expected = candidate_scheme(modules[n]["scheme"], ["Linear"], "test").weights
        got = reloaded.get_submodule(n).quantization_scheme.weights
        assert (got.num_bits, got.group_size, got.observer) == (expected.num_bits, expected.group_size, "minmax")
    ids = torch.tensor([data(1, 16, seed=9)[0]["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, quantized(ids).logits, atol=1e-4, rtol=1e-4)
    replay_recipe = out / RECIPE_FILENAME
    assert "AutoRoundModifier" in yaml.safe_load(replay_recipe.read_text())["DEFAULT_stage"]["DEFAULT_modifiers"]
    replay = tmp_path / "replay"
    oneshot(model=tiny_llama(), dataset=data(), recipe=str(replay_recipe), output_dir=str(replay), verify=False)
    first, second = checkpoint_tensors(out), checkpoint_tensors(replay)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_a_candidate_autoround_cannot_learn_is_refused_before_calibration() -> None:
    modifier = _recipe(candidates=["W3A16:g64", "FP8_BLOCK"])
    with pytest.raises(ValueError, match="candidate 'FP8_BLOCK': has block 8-bit float weights") as caught:
        modifier.validate(tiny_llama())
    assert "\n" not in str(caught.value)


def test_awq_refuses_a_per_tensor_candidate_its_duo_scaling_cannot_take() -> None:
    from seqcal.modifiers import AWQModifier

    per_tensor = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"}}
    modifier = AWQModifier(ignore=["lm_head"], mixed_precision={"average_bits": 6, "candidates": ["W4A16", per_tensor]})
    with pytest.raises(ValueError, match="mixed_precision candidate 'candidate_1' is per tensor") as caught:
        modifier.validate(tiny_llama())
    assert "\n" not in str(caught.value)
