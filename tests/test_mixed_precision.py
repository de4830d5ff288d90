"""Mixed precision: each module's scheme chosen in the pass under a budget (seqcal.modifiers.mixed_precision)."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from save_helpers import checkpoint_tensors
from seqcal.algorithms.allocation import OnlineAllocation, Unit
from seqcal.entrypoint import oneshot
from seqcal.execution.pipeline import PipelineArgs, run_pipeline
from seqcal.experts import linearize_experts
from seqcal.modifiers import MixedPrecisionModifier, QuantizationModifier
from seqcal.modifiers.importance import usable_importance
from seqcal.modifiers.mixed_allocator import RECIPE_FILENAME
from seqcal.modifiers.mixed_curves import curve_importance
from seqcal.modifiers.mixed_schemes import candidate_scheme, stored_bits
from zoo import ARCHS

CANDIDATES = ["W2A16:g64", "W3A16:g64", "W4A16:g64", "W8A16:channel"]


def tiny_llama() -> LlamaForCausalLM:
    """3 layers that matter unequally: layer 1 adds little to the residual stream (its weights scaled down), so
    the error of its modules weighs little in the model's output."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.model.layers[1].modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(0.05)
    return model


def uniform_bits(pattern: str = r"model\.") -> float:
    """Stored bits per weight of W3A16:g64 on the Linears of ``tiny_llama`` whose names ``pattern`` matches."""
    model = tiny_llama()
    weights = [
        m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and re.match(pattern, n)
    ]
    scheme = candidate_scheme("W3A16:g64", ["Linear"], "test")
    return sum(stored_bits(scheme, tuple(w.shape), 32) for w in weights) / sum(w.numel() for w in weights)


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """GPTQ with mixed precision at 3.8 stored bits per weight, saved."""
    out = tmp_path_factory.mktemp("mixed") / "out"
    recipe = MixedPrecisionModifier(average_bits=3.8, candidates=CANDIDATES, ignore=["lm_head"])
    return oneshot(model=tiny_llama(), dataset=data(), recipe=recipe, output_dir=str(out), verify=False), out


def data(n: int = 4, length: int = 32, seed: int = 3) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 256, (length,), generator=g).tolist()} for _ in range(n)]


def report(out: Path) -> dict:
    return json.loads((out / "quantization_report.json").read_text())["modules"]


def stored_module_bits(out: Path, names: list[str]) -> float:
    """Bits the checkpoint's files hold for the weights of ``names`` (codes, scales, zero points, shapes)."""
    tensors = checkpoint_tensors(out)
    keys = [k for k in tensors if any(k.startswith(f"{n}.weight") for n in names)]
    return sum(tensors[k].numel() * tensors[k].element_size() * 8 for k in keys)


def test_allocation_never_exceeds_its_budget_whatever_the_errors() -> None:
    """The guarantee: any error curves, in any order, even ones that make the predictions wrong."""
    rng = random.Random(0)
    for _ in range(12):
        units = [Unit(f"l{i}.m{j}", f"m{j}", p := rng.choice([64, 256, 1024]), [p * b for b in (2.5, 3.5, 4.5, 8.2)])
                 for i in range(6) for j in range(3)]  # fmt: skip
        floor = sum(u.bits[0] for u in units)
        budget = floor * rng.uniform(1.0, 2.5)
        allocation = OnlineAllocation(units, budget)
        spent = 0.0
        for unit in units:
            scale = 10 ** rng.uniform(-4, 4)  # later errors unlike earlier ones
            errors = sorted((scale * rng.random() for _ in range(4)), reverse=True)
            spent += unit.bits[allocation.choose(unit.key, errors)]
        assert spent <= budget * (1 + 1e-9)
    with pytest.raises(ValueError, match="below the cheapest"):
        OnlineAllocation(units, floor * 0.99)


def test_gptq_mixed_meets_budget_reloads_at_each_width_and_replays(mixed_run: tuple, tmp_path: Path) -> None:
    """GPTQ's allocation: within average_bits as stored in the files, several widths, q/k/v and gate/up at
    one width; transformers reloads every module at its width with the same outputs; the replay recipe
    gives the same tensors."""
    quantized, out = mixed_run
    modules = report(out)
    names = [n for n in modules if modules[n].get("scheme")]
    params = sum(quantized.get_submodule(n).weight.numel() for n in names)
    assert len(names) == 21 and stored_module_bits(out, names) / params <= 3.8
    assert len({modules[n]["scheme"] for n in names}) >= 2  # the budget is spent where it helps
    for layer in range(3):
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            parent = "self_attn" if "q_proj" in group else "mlp"
            assert len({modules[f"model.layers.{layer}.{parent}.{g}"]["scheme"] for g in group}) == 1
    for n in names:
        assert modules[n]["predicted_rel_error"] > 0 and modules[n]["rel_error"] > 0
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    for n in names:
        expected = candidate_scheme(modules[n]["scheme"], ["Linear"], "test").weights
        got = reloaded.get_submodule(n).quantization_scheme.weights
        assert (got.num_bits, got.group_size, got.strategy) == (
            expected.num_bits,
            expected.group_size,
            expected.strategy,
        )
    ids = torch.tensor([data(1, 16, seed=9)[0]["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, quantized(ids).logits, atol=1e-4, rtol=1e-4)
    replay = tmp_path / "replay"
    oneshot(
        model=tiny_llama(),
        dataset=data(),
        recipe=str(out / RECIPE_FILENAME),
        output_dir=str(replay),
        verify=False,
    )
    first, second = checkpoint_tensors(out), checkpoint_tensors(replay)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_absolute_error_moves_bits_off_the_layer_that_matters_little() -> None:
    """The modules that add to the residual stream (o_proj, down_proj), at the bits uniform W3A16:g64 stores:
    ``error: absolute`` (their output errors) gives layer 1, whose output is scaled down, the cheapest candidate
    and spends what it saves on the other layers, within the budget. (Whether that lowers the model's error is a
    question for a real model: benchmarks/RESULTS.md has SmolLM2 beside uniform GPTQ.)"""
    targets, bits = ["re:.*o_proj$", "re:.*down_proj$"], uniform_bits(r".*(o_proj|down_proj)$")
    recipe = MixedPrecisionModifier(
        targets=targets, average_bits=bits, candidates=CANDIDATES, error="absolute"
    )
    model = oneshot(model=tiny_llama(), dataset=data(), verify=False, one_pass=False, recipe=recipe)
    chosen = {n: recipe.modules[n] for n in recipe.modules}
    scheme = {n: s.weights.num_bits for n, s in chosen.items()}
    assert all(b == 2 for n, b in scheme.items() if ".layers.1." in n)
    weights = {n: model.get_submodule(n).weight for n in chosen}
    spent = {n: stored_bits(chosen[n], tuple(w.shape), 32) for n, w in weights.items()}
    params = sum(w.numel() for w in weights.values())
    others = [n for n in chosen if ".layers.1." not in n]
    uniform = candidate_scheme("W3A16:g64", ["Linear"], "test")
    assert sum(spent[n] for n in others) > sum(stored_bits(uniform, tuple(weights[n].shape), 32) for n in others)
    assert sum(spent.values()) <= bits * params * (1 + 1e-9)


def test_candidates_search_their_ranges_unless_told_otherwise() -> None:
    """Preset candidates and pins take the imatrix_mse range search; a dict candidate keeps its observer; the modifier's
    weight_observer reaches every candidate and pin, not only the group that first resolves the modules."""
    explicit = {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                            "group_size": 64, "observer": "minmax"}}  # fmt: skip
    default = MixedPrecisionModifier(average_bits=3.0, candidates=[*CANDIDATES, explicit], pin={"re:.*o_proj": "W8A16"})
    assert [s.weights.observer for s in default.mixed.schemes] == ["imatrix_mse"] * 4 + ["minmax"]
    assert [s.weights.observer for s in default.mixed.pinned.values()] == ["imatrix_mse"]
    told = MixedPrecisionModifier(average_bits=3.0, candidates=CANDIDATES, pin={"re:.*o_proj": "W8A16"},
                                  weight_observer="memoryless_minmax")  # fmt: skip
    assert {s.weights.observer for s in told.mixed.every_scheme().values()} == {"memoryless_minmax"}
    # the fp4 and MX formats take min-max ranges only: their presets keep them
    assert candidate_scheme("NVFP4A16", ["Linear"], "test").weights.observer in (None, "minmax")
    assert candidate_scheme("MXFP4A16", ["Linear"], "test").weights.observer in (None, "minmax")


def test_predicted_error_is_the_error_of_the_rounding_the_solver_does(tmp_path: Path) -> None:
    """Round to nearest: each module's predicted error (its curve, rounded with the candidate's range search)
    equals the error measured after quantizing it with the chosen scheme."""
    out = tmp_path / "rtn"
    recipe = QuantizationModifier(mixed_precision={"average_bits": 3.5, "candidates": CANDIDATES}, ignore=["lm_head"])
    oneshot(model=tiny_llama(), dataset=data(), recipe=recipe, output_dir=str(out), verify=False)
    modules = {n: e for n, e in report(out).items() if "bits" in e}
    assert modules and all(e["predicted_rel_error"] == pytest.approx(e["rel_error"], rel=1e-4) for e in modules.values())


def test_round_to_nearest_meets_a_checkpoint_size(tmp_path: Path) -> None:
    """max_size bounds the whole checkpoint's tensors; round to nearest measures errors with E[x^2]."""
    out = tmp_path / "rtn"
    size = 450_000
    recipe = QuantizationModifier(
        mixed_precision={"max_size": size, "candidates": CANDIDATES}, ignore=["lm_head"]
    )
    oneshot(model=tiny_llama(), dataset=data(), recipe=recipe, output_dir=str(out), verify=False)
    tensors = checkpoint_tensors(out)
    assert sum(t.numel() * t.element_size() for t in tensors.values()) <= size
    modules = report(out)
    assert all(
        modules[n]["rel_error"] > 0 and "predicted_rel_error" in modules[n]
        for n in modules
        if "bits" in modules[n]
    )


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_moe_experts_and_fused_projections_share_one_scheme(arch: str) -> None:
    """Every expert of an MoE layer (one tensor in the engine) and q/k/v take one scheme; the budget holds."""
    model = ARCHS[arch].build()
    linearize_experts(model)
    modifier = QuantizationModifier(mixed_precision={"average_bits": 5.0, "candidates": ["W2A16:g16", "W4A16:g16",
                                                      "W8A16:channel"]}, ignore=["lm_head", "re:.*router", "re:.*gate$"])  # fmt: skip
    modifier.validate(model)
    batches = [{"input_ids": torch.tensor([row["input_ids"]])} for row in data(4, 16)]
    state = run_pipeline(model, None, [modifier], None, PipelineArgs(verify=False), batches=batches)
    schemes = {n: e["scheme"] for n, e in state.results.module_errors.items() if "scheme" in e}
    assert set(schemes) == set(modifier.modules)
    layers: dict[str, set[str]] = {}
    for name, scheme in schemes.items():
        prefix = name.split(".experts.")[0] if ".experts." in name else name.rsplit(".", 1)[0]
        kind = "experts" if ".experts." in name else name.rsplit(".", 1)[-1][0] in "qkv" and "qkv"
        layers.setdefault(f"{prefix}/{kind}", set()).add(scheme)
    assert any("experts" in k for k in layers) and all(len(v) == 1 for k, v in layers.items() if k.endswith(
        ("experts", "qkv")))  # fmt: skip
    weights = {n: model.get_submodule(n).weight for n in schemes}
    spent = sum(
        stored_bits(candidate_scheme(schemes[n], ["Linear"], "t"), tuple(w.shape), 32)
        for n, w in weights.items()
    )
    assert spent / sum(w.numel() for w in weights.values()) <= 5.0


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"average_bits": 1.5}, "below the smallest allocation"),
        ({"average_bits": 4, "candidates": ["W4A17"]}, "candidate 'W4A17' is not a scheme"),
        ({"average_bits": 4, "candidates": ["W4A16:g"]}, "not 'g<N>' or 'channel'"),
        ({"average_bits": 4, "pin": {"re:.*qq_proj": "W8A16"}}, "pin 're:.*qq_proj' matches no Linear"),
        ({"average_bits": 4, "pin": {"re:.*q_proj": "W8A16"}}, "pin all of them to one scheme"),
        ({"average_bits": 4, "max_size": "1MB"}, "exactly one budget"),
    ],
)
def test_bad_input_is_one_sentence_before_calibration(arguments: dict, message: str) -> None:
    """Each refused when the recipe is read or the model checked, before any weight is calibrated."""
    with pytest.raises(ValueError, match=message) as caught:
        MixedPrecisionModifier(**{"candidates": CANDIDATES, **arguments}, ignore=["lm_head"]).validate(
            tiny_llama()
        )
    assert "\n" not in str(caught.value)


def test_a_pinned_module_keeps_its_scheme_and_counts() -> None:
    model = tiny_llama()
    modifier = MixedPrecisionModifier(average_bits=4.0, candidates=CANDIDATES, pin={"re:.*down_proj": "W8A16"},
                                      ignore=["lm_head"])  # fmt: skip
    modifier.validate(model)
    pinned = [n for n, s in modifier.modules.items() if n.endswith("down_proj")]
    assert pinned and all(modifier.modules[n].weights.num_bits == 8 for n in pinned)
    assert not any(n.endswith("down_proj") for n in modifier.mixed.units)
    assert math.isclose(
        modifier.mixed.params, sum(model.get_submodule(n).weight.numel() for n in modifier.modules)
    )


@pytest.mark.parametrize("strategy", ["group", "tensor"])
@pytest.mark.parametrize("diag", ["usable", "zeros", "nan", "short"])
def test_curves_weigh_the_search_exactly_where_the_solve_does(strategy: str, diag: str) -> None:
    """The importance a candidate's curve rounds with is the one the solve will use (``usable_importance``): none
    for the tensor strategy or for statistics it cannot use (all zero, not finite, the wrong length), where the
    solve searches uniformly."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": strategy, "observer": "imatrix_mse"}  # fmt: skip
    scheme = candidate_scheme({"weights": {**weights, "group_size": 32 if strategy == "group" else None}},
                              ["Linear"], "test")  # fmt: skip
    values = {"usable": torch.rand(64) + 0.1, "zeros": torch.zeros(64), "nan": torch.full((64,), math.nan),
              "short": torch.rand(32)}[diag]  # fmt: skip
    state = SimpleNamespace(results=SimpleNamespace(log=[]))
    expected = usable_importance("m", scheme, values, 64, state)  # type: ignore[arg-type]
    got = curve_importance(scheme, None, values, 64)
    assert (got is None) == (expected is None) and (got is None or torch.equal(got, expected))
    assert (got is not None) == (strategy == "group" and diag == "usable")


@pytest.mark.parametrize(("bits", "two_bit"), [(3.3, False), (3.0, True)])
def test_default_candidates_take_two_bits_only_where_the_budget_needs_them(bits: float, two_bit: bool) -> None:
    """The default set: 3 and 4 bits in groups of 128 and 64, 8 bits; 2 bits when nothing else fits (W3A16:g128
    stores 3.25 bits per fp32 weight, so 3.3 fits without them, 3.0 does not). Named by the user, 2 bits are
    always among the choices."""
    model = tiny_llama()
    modifier = MixedPrecisionModifier(average_bits=bits, ignore=["lm_head"])
    modifier.validate(model)
    mixed = modifier.mixed
    two = mixed.labels.index("W2A16:g64")
    assert mixed.labels[:5] == ["W3A16:g128", "W3A16:g64", "W4A16:g128", "W4A16:g64", "W8A16"]
    assert all(math.isfinite(u.bits[two]) == two_bit for u in mixed.allocation.units.values())
    oneshot(model=model, dataset=data(), recipe=modifier, verify=False)
    widths = {scheme.weights.num_bits for scheme in modifier.modules.values()}
    assert (2 in widths) == two_bit  # 3.0 is below every unit at 3.25 bits: some must take 2
    named = MixedPrecisionModifier(average_bits=3.3, candidates=CANDIDATES, ignore=["lm_head"])
    named.validate(tiny_llama())
    assert all(math.isfinite(u.bits[0]) for u in named.mixed.allocation.units.values())
