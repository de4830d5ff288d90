"""SparseGPT: exact mask structures, error below magnitude pruning, GPTQ keeping the zeros, bad input refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from seqcal.algorithms import accumulate_hessian, gptq_quantize, relative_output_error
from seqcal.algorithms.sparsegpt import sparsegpt_prune
from seqcal.algorithms.sparsity import follows_structure, lowest_mask, nm_mask, parse_mask_structure
from seqcal.entrypoint import oneshot
from seqcal.modifiers import MODIFIERS, GPTQModifier, SparseGPTModifier
from seqcal.recipe.parse import parse_recipe
from test_oneshot import tiny_llama, token_data

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def correlated_hessian(n_in: int = 64, tokens: int = 4096, seed: int = 0) -> torch.Tensor:
    """A Hessian of correlated, unevenly scaled inputs (what real layer inputs look like), not the identity."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n_in, n_in, generator=g) * 0.3 + torch.eye(n_in)
    X = torch.randn(tokens, n_in, generator=g) @ mix * torch.rand(n_in, generator=g).mul(3).add(0.2)
    return accumulate_hessian(None, X, 0)[0]


def magnitude(W: torch.Tensor, n: int, m: int, sparsity: float) -> torch.Tensor:
    mask = nm_mask(W.abs(), n, m) if n else lowest_mask(W.abs(), int(W.numel() * sparsity))
    return W.masked_fill(mask, 0)


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4)])
def test_nm_masks_have_exactly_the_structure(n: int, m: int) -> None:
    W = torch.randn(24, 64)
    result = sparsegpt_prune(W, correlated_hessian(), n=n, m=m, block_size=16)
    groups = result.mask.reshape(24, -1, m)
    assert bool((groups.sum(-1) == n).all())  # exactly n pruned in every group of m columns of every row
    assert bool((result.W[result.mask] == 0).all()) and bool((result.W[~result.mask] != 0).all())
    assert follows_structure(result.W, n, m)


def test_unstructured_mask_prunes_exactly_the_fraction_of_each_block() -> None:
    W = torch.randn(16, 64)
    result = sparsegpt_prune(W, correlated_hessian(), sparsity=0.7, block_size=32)
    for b in range(2):  # int(32 * 16 * 0.7) = 358 of each block of 32 columns
        assert int(result.mask[:, 32 * b : 32 * (b + 1)].sum()) == 358
    assert bool((result.W[result.mask] == 0).all())


@pytest.mark.parametrize("n,m,sparsity", [(2, 4, 0.5), (0, 0, 0.5), (0, 0, 0.8)])
def test_sparsegpt_error_is_below_magnitude_pruning(n: int, m: int, sparsity: float) -> None:
    H = correlated_hessian()
    for seed in range(3):
        W = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed))
        ours = relative_output_error(W, sparsegpt_prune(W, H, sparsity=sparsity, n=n, m=m).W, H)
        assert ours < 0.9 * relative_output_error(W, magnitude(W, n, m, sparsity), H)


def test_bf16_weights_come_back_bf16_with_exact_zeros() -> None:
    W = torch.randn(8, 64).bfloat16()
    result = sparsegpt_prune(W, correlated_hessian(), n=2, m=4)
    assert result.W.dtype == torch.bfloat16 and follows_structure(result.W, 2, 4)


@pytest.mark.parametrize("symmetric,actorder", [(True, None), (False, "weight"), (True, "group")])
def test_gptq_with_a_mask_keeps_the_pruned_weights_exactly_zero(
    symmetric: bool, actorder: str | None
) -> None:
    H = correlated_hessian()
    W = torch.randn(32, 64)
    pruned = sparsegpt_prune(W, H, n=2, m=4)
    kw = dict(num_bits=4, symmetric=symmetric, group_size=16, actorder=actorder)
    masked = gptq_quantize(pruned.W, H, pruned=pruned.mask, **kw)
    assert bool((masked.Q[pruned.mask] == 0).all()) and follows_structure(masked.Q, 2, 4)
    unmasked = gptq_quantize(pruned.W, H, **kw)
    assert not follows_structure(unmasked.Q, 2, 4)  # without the mask GPTQ's updates fill the zeros in
    # the masked solve still compensates: below round-to-nearest of the pruned weight with the same grid
    rtn = gptq_quantize(pruned.W, torch.eye(64), pruned=pruned.mask, **{**kw, "actorder": None})
    assert relative_output_error(W, masked.Q, H) < relative_output_error(W, rtn.Q, H)


def test_oneshot_sparsegpt_then_gptq_keeps_2_4_everywhere() -> None:
    model = tiny_llama()
    recipe = [
        SparseGPTModifier(sparsity=0.5, mask_structure="2:4", ignore=["re:.*lm_head"]),
        GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
    ]
    oneshot(model=model, dataset=token_data(), recipe=recipe, max_seq_length=32)
    for layer in model.model.layers:
        for name in LINEARS:
            module = getattr(layer.self_attn if name[0] in "qkvo" else layer.mlp, name)
            assert follows_structure(module.weight, 2, 4), name
    assert (model.lm_head.weight == 0).float().mean() < 0.01  # ignored: dense


def test_modifier_prunes_the_targets_layers_and_reports(tmp_path: Path) -> None:
    model = tiny_llama()
    modifier = SparseGPTModifier(sparsity=0.5, mask_structure="0:0", targets=["re:model.layers.0$"])
    oneshot(
        model=model, dataset=token_data(), recipe=modifier, max_seq_length=32, output_dir=str(tmp_path / "o")
    )
    zeros = lambda w: (w == 0).float().mean().item()  # noqa: E731
    assert abs(zeros(model.model.layers[0].mlp.down_proj.weight) - 0.5) < 0.01
    assert zeros(model.model.layers[1].mlp.down_proj.weight) == 0  # layer 1 is not a target
    report = json.loads((tmp_path / "o" / "quantization_report.json").read_text())
    errors = report["modules"]["model.layers.0.mlp.down_proj"]
    assert 0 < errors["rel_error"] < 1 and errors["tokens"] == 16 * 32
    config = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"][
        "sparsity_config"
    ]
    assert config["sparsity_structure"] == "unstructured" and len(config["targets"]) == 7


def test_recipe_names_and_arguments_are_llm_compressors() -> None:
    assert {"SparseGPTModifier", "WandaPruningModifier"} <= set(MODIFIERS)
    recipe = parse_recipe(
        "sparsity_stage:\n  run_type: oneshot\n  sparsity_modifiers:\n    SparseGPTModifier:\n      sparsity: 0.5\n"
        "      mask_structure: '2:4'\n      block_size: 64\n      dampening_frac: 0.001\n      sequential_update: true\n"
        "      offload_hessians: true\n      targets: [Linear]\n      ignore: ['re:.*lm_head']\n"
    )
    (modifier,) = recipe.modifiers
    assert isinstance(modifier, SparseGPTModifier) and modifier.block_size == 64
    assert parse_recipe(recipe.to_yaml()).modifiers[0] == modifier


@pytest.mark.parametrize(
    "args,match",
    [
        ({"sparsity": 0.0}, r"sparsity must be a number in \(0, 1\)"),
        ({"sparsity": 1.0}, r"sparsity must be a number in \(0, 1\)"),
        ({"sparsity": "half"}, r"sparsity must be a number in \(0, 1\)"),
        ({"sparsity": None}, r"sparsity must be a number in \(0, 1\)"),  # unstructured needs it
        ({"sparsity": 0.5, "mask_structure": "2-4"}, r"mask_structure='2-4' is not valid; give 'N:M'"),
        ({"sparsity": 0.5, "mask_structure": "4:2"}, r"mask_structure='4:2' is not valid"),
        ({"sparsity": 0.5, "sparsity_profile": "owl", "owl_m": 5, "owl_lmbda": 0.08}, "OWL .* not supported"),
        ({"sparsity": 0.5, "preserve_sparsity_mask": True}, "preserve_sparsity_mask is not supported"),
    ],
)
def test_bad_arguments_are_one_sentence(args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SparseGPTModifier(**args)


def test_2_4_on_a_width_not_divisible_by_4_is_refused_before_calibrating() -> None:
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=130, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config)
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.down_proj has 130 inputs; add .* to ignore"
    ):
        oneshot(
            model=model,
            dataset=token_data(4, 8),
            recipe=SparseGPTModifier(sparsity=0.5, mask_structure="2:4"),
        )
    assert not calls


def test_a_tied_lm_head_is_refused() -> None:
    model = tiny_llama()
    model.lm_head.weight = model.model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"lm_head\.weight is tied to model\.embed_tokens\.weight"):
        SparseGPTModifier(sparsity=0.5).validate(model)


def test_parse_mask_structure() -> None:
    assert parse_mask_structure("2:4") == (2, 4) and parse_mask_structure("0:0") == (0, 0)
    with pytest.raises(ValueError):
        parse_mask_structure("0:4")


@pytest.fixture(scope="module")
def odd_width_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer Llama whose down_proj reads 130 features, with the default model's tokenizer."""
    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=130, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    path = tmp_path_factory.mktemp("odd")
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


@pytest.mark.parametrize(
    "args,fragments",
    [
        ("sparsity: 0.5, mask_structure: '2:4'", ["model.layers.0.mlp.down_proj has 130 inputs", "ignore"]),
        ("sparsity: 1.5", ["recipe.yaml:2", "sparsity must be a number in (0, 1)"]),
        ("sparsity: 0.5, mask_structure: 'half'", ["mask_structure='half' is not valid", "'2:4'"]),
    ],
)
def test_cli_refuses_bad_sparsity_input_in_one_line(
    odd_width_dir: Path, tmp_path: Path, args: str, fragments
) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("SparseGPTModifier:\n  " + args.replace(", ", "\n  ") + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "seqcal.cli", "oneshot", "--model", str(odd_width_dir), "--recipe", str(recipe),
         "--output-dir", str(tmp_path / "out"), "--num-calibration-samples", "2", "--max-seq-length", "16"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("seqcal: error:")]
    for fragment in fragments:
        assert fragment in line, (fragment, line)
