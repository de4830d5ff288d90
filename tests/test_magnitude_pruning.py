"""llm-compressor's MagnitudePruningModifier, ConstantPruningModifier and LogarithmicEqualizationModifier, one-shot:
the masks, the schedule's end point, the checkpoint's sparsity record, zeros kept by a later GPTQ, the log
equalization scales and a fold that leaves the float model unchanged; one-pass and layer cut alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from seqcal.entrypoint import oneshot
from seqcal.modifiers import (
    ConstantPruningModifier,
    GPTQModifier,
    LogarithmicEqualizationModifier,
    MagnitudePruningModifier,
    QuantizationModifier,
)
from seqcal.modifiers.smoothquant import log_equalization_scales
from seqcal.recipe.parse import parse_recipe
from test_oneshot import tiny_llama, token_data

MLP = ["re:.*mlp.(gate|up|down)_proj"]


def _mlp_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: m.weight.detach().clone()
        for n, m in model.named_modules()
        if ".mlp." in n and hasattr(m, "weight")
    }


@pytest.mark.parametrize("one_pass", [True, False])
def test_magnitude_prunes_the_smallest_weights_to_the_final_sparsity(one_pass: bool, tmp_path: Path) -> None:
    model = tiny_llama()
    before, attention = _mlp_weights(model), model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    recipe = MagnitudePruningModifier(targets=MLP, init_sparsity=0.05, final_sparsity=0.6, start=0, end=10)
    oneshot(
        model=model,
        dataset=token_data(2, 8),
        recipe=recipe,
        one_pass=one_pass,
        output_dir=str(tmp_path / "o"),
    )
    for name, W in before.items():
        pruned = model.get_submodule(name).weight == 0
        assert int(pruned.sum()) == int(0.6 * W.numel()), name  # per tensor, as llm-compressor's unstructured
        kept, dropped = W.abs()[~pruned], W.abs()[pruned]
        assert kept.min() >= dropped.max() and torch.equal(
            model.get_submodule(name).weight[~pruned], W[~pruned]
        )
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, attention)
    sparsity = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"][
        "sparsity_config"
    ]
    assert sorted(sparsity["targets"]) == sorted(before) and sparsity["sparsity_structure"] == "unstructured"


def test_magnitude_blocks_and_schedules() -> None:
    W = torch.randn(8, 16)
    mask = MagnitudePruningModifier(targets="Linear", init_sparsity=0.0, final_sparsity=0.5,
                                    mask_structure="block_2,4")._mask(W, 0.5)  # fmt: skip
    blocks = mask.reshape(4, 2, 4, 4).permute(0, 2, 1, 3).reshape(16, 8)  # one row per 2x4 block
    assert bool((blocks.all(1) | ~blocks.any(1)).all()) and int(blocks.all(1).sum()) == 8
    sums = W.abs().reshape(4, 2, 4, 4).sum((1, 3)).flatten()
    assert sums[blocks.all(1)].max() <= sums[~blocks.all(1)].min()
    steps = MagnitudePruningModifier(targets="Linear", init_sparsity=0.1, final_sparsity=0.9,
                                     update_scheduler="multi_step", scheduler_args={"steps": [[5, 0.7], [2, 0.3]]})  # fmt: skip
    assert steps._sparsity() == 0.7  # the last step, not final_sparsity
    assert (
        MagnitudePruningModifier(targets="Linear", init_sparsity=0.1, final_sparsity=0.4)._sparsity() == 0.4
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"update_scheduler": "calc(init_sparsity * 2)"},
            "update_scheduler .* \\(seqcal never evaluates",
        ),
        ({"apply_globally": True}, "apply_globally .* is not implemented"),
        ({"mask_structure": "channel"}, "mask_structure 'channel' is not supported for Linear weights"),
        ({"final_sparsity": 1.0}, "final_sparsity is required, a number in \\[0, 1\\)"),
        ({"targets": None}, "targets is required"),
    ],
)
def test_magnitude_arguments_seqcal_cannot_honour_are_refused(args: dict, message: str) -> None:
    full = {"targets": "Linear", "init_sparsity": 0.1, "final_sparsity": 0.5, **args}
    with pytest.raises(ValueError, match=f"MagnitudePruningModifier: {message}"):
        MagnitudePruningModifier(**full)


def test_constant_pruning_keeps_the_zeros_through_gptq(tmp_path: Path) -> None:
    """A model pruned before: ConstantPruning makes its zeros the sparsity mask GPTQ solves with."""
    runs = {}
    for constant in (True, False):
        model = tiny_llama()
        down = model.model.layers[1].mlp.down_proj.weight
        with torch.no_grad():
            down[down.abs() < down.abs().median()] = 0
        zeros = down == 0
        recipe = [ConstantPruningModifier(targets=["re:.*down_proj"])] if constant else []
        recipe.append(GPTQModifier(scheme="W8A8", targets=["re:.*layers.1.mlp.down_proj"]))
        out = tmp_path / str(constant)
        oneshot(model=model, dataset=token_data(2, 16), recipe=recipe, output_dir=str(out))
        runs[constant] = (model.model.layers[1].mlp.down_proj.weight == 0)[zeros].float().mean().item()
        config = json.loads((out / "config.json").read_text())["quantization_config"]
        assert bool(config["sparsity_config"]) is constant
    assert runs[True] == 1.0 and runs[False] < 1.0  # GPTQ alone moves some zeros (its error feedback)


def test_pruning_recipe_as_llmc_writes_it() -> None:
    recipe = parse_recipe(
        "pruning_stage:\n  pruning_modifiers:\n    MagnitudePruningModifier:\n      targets: ['re:.*mlp.*']\n"
        "      init_sparsity: 0.05\n      final_sparsity: 0.5\n      start: 0\n      end: 5\n      update: 1\n"
        "      leave_enabled: false\n    ConstantPruningModifier: {targets: ['re:.*self_attn.*'], start: 0}\n"
    )
    magnitude, constant = recipe.modifiers
    assert (magnitude.final_sparsity, magnitude.start, constant.targets) == (0.5, 0, ["re:.*self_attn.*"])


def test_log_equalization_scales_are_llmcs() -> None:
    lo, hi = torch.tensor([-3.0, 0.0, -0.5]), torch.tensor([1.0, 0.0, 0.5])
    r = hi - lo
    want = (r / torch.log2(2 + r)).clamp_min(1e-5)
    assert torch.equal(log_equalization_scales((lo, hi)), want) and want[1] == 1e-5


@pytest.mark.parametrize("one_pass", [True, False])
def test_log_equalization_folds_before_the_quantizer(one_pass: bool) -> None:
    """The norms are divided by the log scales of their group's float inputs; with RTN W8A8 after it."""
    model = tiny_llama()
    norm = model.model.layers[0].input_layernorm
    seen = []
    handle = norm.register_forward_hook(lambda mod, args, out: seen.append(out.reshape(-1, out.shape[-1])))
    with torch.no_grad():
        for row in token_data(2, 16):
            model(input_ids=torch.tensor([row["input_ids"]]))
    handle.remove()
    X = torch.cat(seen)
    want = norm.weight.detach() / log_equalization_scales((X.amin(0), X.amax(0)))
    recipe = [LogarithmicEqualizationModifier(), QuantizationModifier(scheme="W8A8", ignore=["lm_head"])]
    oneshot(model=model, dataset=token_data(2, 16), recipe=recipe, one_pass=one_pass)
    assert torch.allclose(norm.weight, want, rtol=1e-5)
