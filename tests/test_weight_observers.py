"""Weight observers mse and imatrix_mse (llm-compressor's names and settings) for RTN and GPTQ."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from save_helpers import reload, tiny_llama
from seqcal.algorithms import (
    accumulate_hessian,
    compute_qparams,
    fake_quantize,
    gptq_quantize,
    importance_from_hessian,
    observe_imatrix_mse,
    observe_minmax,
    observe_mse,
    weight_qparams,
)
from seqcal.algorithms.range_search import shrink_search
from seqcal.execution.pipeline import PipelineArgs, run_pipeline
from seqcal.modifiers import GPTQModifier, QuantizationModifier
from test_cli import SMALL, assert_user_error, seqcal, tiny_dir  # noqa: F401 (tiny_dir is a fixture)

GS = 16


def outlier_weight(out: int = 24, n_in: int = 64, seed: int = 0) -> torch.Tensor:
    """Gaussian weights with a few large outliers: where clipping the range pays."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, n_in, generator=g)
    idx = torch.randint(0, W.numel(), (W.numel() // 50,), generator=g)
    W.view(-1)[idx] *= 6
    return W


def importance(n_in: int = 64, seed: int = 1) -> torch.Tensor:
    """Strongly uneven E[x^2] per column (log-normal), as real activations have."""
    return torch.randn(n_in, generator=torch.Generator().manual_seed(seed)).mul(1.5).exp()


def qerr(W, lo, hi, fmt: dict, a: torch.Tensor | None = None, norm: float = 2.0) -> float:
    """sum a_j |Q(w) - w| ** norm with the qparams of the range (lo, hi)."""
    s, z = compute_qparams(lo, hi, num_bits=fmt["num_bits"], symmetric=fmt["symmetric"], type=fmt["type"])
    gs = fmt["group_size"] if fmt["strategy"] == "group" else None
    e = (fake_quantize(W, s, z, num_bits=fmt["num_bits"], type=fmt["type"], group_size=gs) - W).abs() ** norm
    return float((e if a is None else e * a).sum())


FORMATS = {
    "int4_group_sym": dict(num_bits=4, symmetric=True, strategy="group", group_size=GS, type="int"),
    "int4_group_asym": dict(num_bits=4, symmetric=False, strategy="group", group_size=GS, type="int"),
    "int4_channel_sym": dict(num_bits=4, symmetric=True, strategy="channel", group_size=None, type="int"),
    "int8_channel_asym": dict(num_bits=8, symmetric=False, strategy="channel", group_size=None, type="int"),
    "fp8_channel": dict(num_bits=8, symmetric=True, strategy="channel", group_size=None, type="float"),
    "int4_tensor": dict(num_bits=4, symmetric=True, strategy="tensor", group_size=None, type="int"),
}


@pytest.mark.parametrize("name", FORMATS)
def test_mse_range_errs_less_than_minmax(name: str) -> None:
    fmt, W = FORMATS[name], outlier_weight()
    lo0, hi0 = observe_minmax(W, strategy=fmt["strategy"], group_size=fmt["group_size"])
    lo, hi = observe_mse(W, **fmt)
    # the searched objective (norm 2.4) can only go down: p = 1 (min-max) is the first candidate
    assert qerr(W, lo, hi, fmt, norm=2.4) <= qerr(W, lo0, hi0, fmt, norm=2.4)
    assert (hi <= hi0).all() and (hi >= 0.8 * hi0 - 1e-6).all()
    if (
        fmt["type"] == "int" and fmt["num_bits"] == 4
    ):  # clipping outliers pays at 4 bits, also in squared error
        assert qerr(W, lo, hi, fmt) < 0.97 * qerr(W, lo0, hi0, fmt)


@pytest.mark.parametrize("name", ["int4_group_sym", "int4_group_asym", "int4_channel_sym"])
def test_imatrix_mse_errs_less_than_mse_where_the_inputs_are_large(name: str) -> None:
    fmt, W, a = FORMATS[name], outlier_weight(), importance()
    # same candidates and norm, no early stop: imatrix's candidates include mse's, so its weighted error is <=
    same = dict(maxshrink=0.2, grid=100, norm=2.4, patience=0)
    lo_m, hi_m = observe_mse(W, **fmt)
    lo_i, hi_i = observe_imatrix_mse(W, **fmt, **same, importance=a)
    assert qerr(W, lo_i, hi_i, fmt, a, norm=2.4) <= qerr(W, lo_m, hi_m, fmt, a, norm=2.4)
    # llm-compressor's defaults (grid 20 down to p = 0.05, norm 3): lower importance-weighted squared error
    lo_d, hi_d = observe_imatrix_mse(W, **fmt, importance=a)
    assert qerr(W, lo_d, hi_d, fmt, a) < qerr(W, lo_m, hi_m, fmt, a)
    # and the importance matters: the uniform search picks other ranges
    lo_u, hi_u = observe_imatrix_mse(W, **fmt)
    assert not torch.equal(hi_u, hi_d)


def brute_force(
    W: torch.Tensor, shrinks: list[float], patience: int | None, norm: float, a: torch.Tensor | None
):
    """The search written out row by row in float64 Python scalars (int4 symmetric, per channel)."""
    rows, R = W.double().tolist(), W.shape[0]
    weights = [1.0] * W.shape[1] if a is None else (a.double() / a.double().mean()).tolist()
    best = [math.inf] * R
    best_p = [1.0] * R
    stale = 0
    for p in shrinks:
        improved = False
        for r, row in enumerate(rows):
            scale = max(abs(min(min(row), 0.0)), max(max(row), 0.0)) * p / 7.5
            err = 0.0
            for w, aj in zip(row, weights):
                q = max(-8.0, min(7.0, round(w / scale)))  # Python rounds half to even, as torch.round
                err += aj * abs(q * scale - w) ** norm
            if err < best[r]:
                best[r], best_p[r], improved = err, p, True
        stale = 0 if improved else stale + 1
        if patience is not None and stale >= patience:
            break
    return torch.tensor(best_p, dtype=torch.float64)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("patience", [None, 2])
def test_search_equals_a_brute_force_reference(weighted: bool, patience: int | None) -> None:
    W = outlier_weight(out=5, n_in=12, seed=3).double()
    a = importance(12, seed=4).double() if weighted else None
    shrinks = [1 - i / 20 for i in range(12)]
    lo, hi = shrink_search(W, strategy="channel", num_bits=4, symmetric=True, shrinks=shrinks,
                           patience=patience, norm=3.0, importance=a)  # fmt: skip
    absmax = W.abs().amax(dim=1)
    p = hi.reshape(-1).abs().maximum(lo.reshape(-1).abs()) / absmax
    torch.testing.assert_close(p, brute_force(W, shrinks, patience, 3.0, a).double(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("fmt", ["int4_group_sym", "int4_group_asym", "int4_channel_sym", "int8_channel_asym",
                                 "int4_tensor"])  # fmt: skip
@pytest.mark.parametrize("weighted", [False, True])
def test_the_in_place_search_equals_fake_quantize_bit_for_bit(
    fmt: str, weighted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float32 int search runs in a reused buffer, chunk by chunk; each candidate's errors, and so the
    chosen ranges, are those of ``fake_quantize`` exactly (chunks of 40 values: a ragged last chunk)."""
    import seqcal.algorithms.range_search as range_search

    f = FORMATS[fmt]
    gs = f["group_size"] if f["strategy"] == "group" else None
    W = outlier_weight(out=24, n_in=64, seed=5)
    a = importance(64, seed=6) if weighted and f["strategy"] != "tensor" else None
    shrinks = [1 - i / 20 for i in range(20)]
    kw = dict(
        strategy=f["strategy"], num_bits=f["num_bits"], symmetric=f["symmetric"], group_size=gs, type="int"
    )
    monkeypatch.setattr(range_search, "_CHUNK_VALUES", 40)
    lo, hi = shrink_search(W, **kw, shrinks=shrinks, patience=None, norm=3.0, importance=a)

    # the reference: every candidate through fake_quantize, whole-weight temporaries
    rows = range_search._as_rows(W, f["strategy"], gs)
    weights = None if a is None else range_search._row_weights(a, W, f["strategy"], gs)
    best_err = torch.full((rows.shape[0],), math.inf)
    best_lo, best_hi = rows.amin(-1).clone(), rows.amax(-1).clone()
    for p in shrinks:
        s, z = compute_qparams(p * rows.amin(-1), p * rows.amax(-1), num_bits=f["num_bits"],
                               symmetric=f["symmetric"])  # fmt: skip
        e = (
            fake_quantize(rows, s.reshape(-1, 1), z.reshape(-1, 1), num_bits=f["num_bits"]) - rows
        ).abs() ** 3.0
        err = (e if weights is None else e * weights).sum(-1)
        better = err < best_err
        best_err[better], best_lo[better], best_hi[better] = err[better], (p * rows.amin(-1))[better], (
            p * rows.amax(-1))[better]  # fmt: skip
    assert torch.equal(lo.reshape(-1), best_lo) and torch.equal(hi.reshape(-1), best_hi)


def test_imatrix_search_steps_follow_llm_compressor() -> None:
    # maxshrink 0.95, grid 20: p = 1, 0.95, ..., 0.05 (20 candidates, the last included); patience 0: all tried.
    W = torch.tensor([[1.0] + [0.01] * 15])  # the best range is the smallest: only the outlier is clipped...
    lo, hi = observe_imatrix_mse(
        W,
        strategy="channel",
        num_bits=4,
        symmetric=True,
        patience=0,
        importance=torch.tensor([0.0] + [1.0] * 15),
    )  # ...when it does not count
    assert math.isclose(hi.item(), 0.05, rel_tol=1e-6)
    lo, hi = observe_mse(W, strategy="channel", num_bits=4, symmetric=True)  # down to p = 0.81 at most
    assert hi.item() >= 0.81 - 1e-6


def test_gptq_uses_the_hessian_diagonal_as_importance() -> None:
    g = torch.Generator().manual_seed(7)
    X = torch.randn(512, 64, generator=g) * importance().sqrt()
    H, _ = accumulate_hessian(None, X, 0)
    torch.testing.assert_close(importance_from_hessian(H), X.pow(2).mean(0))
    W = outlier_weight()
    fmt = dict(num_bits=4, symmetric=True, strategy="group", group_size=GS)
    a = importance_from_hessian(H)
    got = gptq_quantize(W, H, **fmt, observer="imatrix_mse", importance=a, actorder="weight")
    want = weight_qparams(W, **fmt, observer="imatrix_mse", importance=a)[0]
    torch.testing.assert_close(got.scale, want, rtol=0, atol=0)  # observed once, before the column loop
    plain = gptq_quantize(W, H, **fmt, observer="mse", actorder="weight")
    assert not torch.equal(got.scale, plain.scale)


# --- modifiers ----------------------------------------------------------------------------------------------


def padded_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(4):
        ids = torch.randint(4, 120, (2, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[1, : 3 + i] = 0  # left padding on the second row
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def groups(observer: str, **kw) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GS}
    return {"group_0": {"targets": ["Linear"], "weights": {**weights, "observer": observer, **kw}}}


def first_q_proj_importance(model: torch.nn.Module, batches: list[dict]) -> torch.Tensor:
    """E[x^2] of layer 0's q_proj inputs over the real tokens, measured directly on the unquantized model."""
    seen = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        for b in batches:
            model(**b)
    hook.remove()
    X = torch.cat([x[b["attention_mask"].bool()] for x, b in zip(seen, batches)])
    return X.pow(2).mean(0)


def run(modifier, batches):
    model = tiny_llama()
    W = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    a = first_q_proj_importance(tiny_llama(), batches)
    modifier.validate(model)
    state = run_pipeline(model, None, [modifier], None, PipelineArgs(), batches=batches)
    return model, state, W, a


def test_rtn_imatrix_needs_calibration_and_weights_by_the_real_tokens_inputs() -> None:
    assert not getattr(QuantizationModifier(config_groups=groups("mse")), "needs_calibration", False)
    modifier = QuantizationModifier(config_groups=groups("imatrix_mse"), ignore=["lm_head"])
    assert modifier.needs_calibration
    model, state, W, a = run(modifier, padded_batches())
    got = state.results.quantized["model.layers.0.self_attn.q_proj"].scale
    fmt = dict(num_bits=4, symmetric=True, strategy="group", group_size=GS)
    torch.testing.assert_close(got, weight_qparams(W, **fmt, observer="imatrix_mse", importance=a)[0])
    assert not torch.equal(got, weight_qparams(W, **fmt, observer="imatrix_mse")[0])  # the importance counts
    assert not [line for line in state.results.log if "imatrix_mse" in line]


def test_gptq_imatrix_takes_the_importance_from_the_hessian() -> None:
    modifier = GPTQModifier(config_groups=groups("imatrix_mse"), ignore=["lm_head"], actorder=None)
    model, state, W, a = run(modifier, padded_batches())
    got = state.results.quantized["model.layers.0.self_attn.q_proj"].scale
    fmt = dict(num_bits=4, symmetric=True, strategy="group", group_size=GS)
    torch.testing.assert_close(got, weight_qparams(W, **fmt, observer="imatrix_mse", importance=a)[0])
    assert not [line for line in state.results.log if "imatrix_mse" in line]


def test_modifier_level_weight_observer_overrides_the_scheme() -> None:
    m = GPTQModifier(scheme="W4A16", weight_observer="imatrix_mse")
    assert all(g.weights.observer == "imatrix_mse" for g in m.groups.values())
    m = QuantizationModifier(scheme="W4A16", observer={"weights": "mse"})
    assert all(g.weights.observer == "mse" for g in m.groups.values()) and not m.needs_calibration
    with pytest.raises(ValueError, match="either weight_observer"):
        QuantizationModifier(scheme="W4A16", weight_observer="mse", observer={"weights": "mse"})
    with pytest.raises(ValueError, match="valid weight observers: minmax, static_minmax"):
        QuantizationModifier(scheme="W4A16", weight_observer="percentile")


def test_imatrix_without_inputs_falls_back_to_uniform_or_fails_when_strict() -> None:
    from seqcal.modifiers.base import RunState
    from seqcal.modifiers.importance import usable_importance

    scheme = QuantizationModifier(config_groups=groups("imatrix_mse")).groups["group_0"]
    state = RunState()
    assert usable_importance("fc", scheme, torch.zeros(64), 64, state) is None
    assert "all importances are zero" in state.results.log[-1]
    strict = QuantizationModifier(config_groups=groups("imatrix_mse", observer_kwargs={"strict": True}))
    with pytest.raises(ValueError, match="strict"):
        usable_importance("fc", strict.groups["group_0"], None, 64, state)


RECIPE = """
quant_stage:
  quant_modifiers:
    {modifier}:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32, {observer}}}
"""


@pytest.mark.parametrize("modifier", ["GPTQModifier", "QuantizationModifier"])
def test_an_imatrix_recipe_runs_end_to_end_and_reloads(modifier: str, tiny_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(modifier=modifier, observer="observer: imatrix_mse"))
    out = tmp_path / "out"
    result = seqcal(
        "oneshot", "--model", str(tiny_dir), "--recipe", str(recipe), "--output-dir", str(out), *SMALL
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["observer"] == "imatrix_mse"
    model = reload(out)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7, 8]])).logits).all()


def test_an_unknown_weight_observer_is_refused_before_calibration(tiny_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(modifier="GPTQModifier", observer="observer: imatrix"))
    result = seqcal("oneshot", "--model", str(tiny_dir), "--recipe", str(recipe), "--output-dir",
                    str(tmp_path / "out"), *SMALL)  # fmt: skip
    assert_user_error(
        result, "GPTQModifier group 'group_0'", "weights observer 'imatrix' does not exist",
        "valid weight observers: minmax, static_minmax, memoryless_minmax, mse, memoryless_mse, imatrix_mse",
    )  # fmt: skip
    assert "cutting" not in result.stderr and not (tmp_path / "out").exists()


def test_imatrix_statistics_are_declared_beside_a_subclass_s_own() -> None:
    """Round to nearest declares imatrix_mse's sums (the framework gathers them); a subclass keeps its own
    declared statistics beside them, and GPTQ, which reads E[x^2] off its Hessian, declares none."""
    from dataclasses import dataclass
    from typing import ClassVar

    from seqcal.modifiers import Gather, GPTQModifier, QuantizationModifier
    from seqcal.modifiers.importance import IMPORTANCE_GATHERS

    @dataclass
    class _Counts(QuantizationModifier):
        gathers: ClassVar[tuple[Gather, ...]] = (Gather("tokens", lambda x: x.new_tensor([len(x)])),)

    assert QuantizationModifier(scheme="W4A16", weight_observer="imatrix_mse").gathers == IMPORTANCE_GATHERS
    assert QuantizationModifier(scheme="W4A16").gathers == ()
    mine = _Counts(scheme="W4A16", weight_observer="imatrix_mse").gathers
    assert [g.name for g in mine] == ["tokens", "imatrix_sq", "imatrix_tokens"]
    assert GPTQModifier(scheme="W4A16", weight_observer="imatrix_mse").gathers == ()
