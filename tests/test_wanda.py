"""Wanda: the |W| * ||X_j|| metric from the calibration inputs, exact mask structures, combined with GPTQ."""

from __future__ import annotations

import pytest
import torch

from seqcal.algorithms.sparsity import follows_structure
from seqcal.algorithms.wanda import accumulate_sq_norms, wanda_mask
from seqcal.entrypoint import oneshot
from seqcal.modifiers import GPTQModifier, WandaPruningModifier
from seqcal.recipe.parse import parse_recipe
from test_oneshot import tiny_llama, token_data


def test_sq_norms_accumulate_the_mean_over_tokens_batch_by_batch() -> None:
    X = torch.randn(5, 7, 12)
    S, n = None, 0
    for batch in X.split([2, 3]):
        S, n = accumulate_sq_norms(S, batch, n)
    torch.testing.assert_close(S, X.reshape(-1, 12).square().mean(0))
    assert n == 35


def test_mask_is_the_lowest_metric_per_row() -> None:
    W, X = torch.randn(6, 16), torch.randn(100, 16) * torch.linspace(0.1, 3, 16)
    S, _ = accumulate_sq_norms(None, X, 0)
    mask = wanda_mask(W, S, sparsity=0.25)
    metric = W.abs() * X.norm(dim=0)  # the paper's |W_ij| * ||X_j||_2
    for row in range(6):
        assert set(mask[row].nonzero().flatten().tolist()) == set(metric[row].argsort()[:4].tolist())


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8)])
def test_nm_mask_prunes_n_of_every_m(n: int, m: int) -> None:
    W, S = torch.randn(8, 32), torch.rand(32)
    mask = wanda_mask(W, S, n=n, m=m)
    assert bool((mask.reshape(8, -1, m).sum(-1) == n).all())


def test_input_norms_change_the_mask() -> None:
    W = torch.ones(1, 4)
    assert wanda_mask(W, torch.tensor([4.0, 0.0, 1.0, 9.0]), n=2, m=4).tolist() == [
        [False, True, True, False]
    ]


@pytest.mark.parametrize("structure", ["2:4", "0:0"])
def test_oneshot_wanda_prunes_every_target_module(structure: str) -> None:
    model = tiny_llama()
    oneshot(model=model, dataset=token_data(), recipe=WandaPruningModifier(sparsity=0.5, mask_structure=structure,
            ignore=["re:.*lm_head"]), max_seq_length=32)  # fmt: skip
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            zeros = (module.weight == 0).sum(dim=1)
            assert bool((zeros == module.weight.shape[1] // 2).all()), name  # exactly half of every row
            assert structure != "2:4" or follows_structure(module.weight, 2, 4)


def test_wanda_then_gptq_from_an_llm_compressor_recipe() -> None:
    recipe = parse_recipe(
        "sparsity_stage:\n  sparsity_modifiers:\n    WandaPruningModifier:\n      sparsity: 0.5\n"
        "      mask_structure: '2:4'\n      ignore: ['re:.*lm_head']\n"
        "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {scheme: W4A16, ignore: [lm_head]}\n"
    )
    assert [type(m) for m in recipe.modifiers] == [WandaPruningModifier, GPTQModifier]
    model = tiny_llama()
    oneshot(model=model, dataset=token_data(), recipe=recipe, max_seq_length=32)
    assert follows_structure(model.model.layers[1].mlp.down_proj.weight, 2, 4)
