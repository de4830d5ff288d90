"""Static input activations (W8A8 static, FP8): observers, runtime fake-quant, checkpoint and round trip.

The observers follow llm-compressor's names and semantics; qparams and fake-quant are checked against
compressed-tensors' own functions; the checkpoint against compressed-tensors' compressor applied to the same
fake-quantized module; the reloaded model against seqcal's fake-quantized model, for RTN and GPTQ.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import compress_module
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle import forward_quantize, initialize_module_for_quantization
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.utils import get_direct_state_dict

from save_helpers import checkpoint_tensors, local, reload, tiny_llama
from seqcal.checkpoint.writer import save_checkpoint
from seqcal.execution.pipeline import PipelineArgs, run_pipeline
from seqcal.modifiers import GPTQModifier, QuantizationModifier, QuantizedWeight, RunState, activations
from seqcal.modifiers.activations import quantized_inputs
from seqcal.modifiers.fake_inputs import dynamic_fake_quantize, input_fake_quantize
from seqcal.modifiers.observers import OBSERVERS, make_observer
from seqcal.recipe.parse import parse_recipe

RECIPES = Path(__file__).parent.parent / "recipes"


def int8(symmetric: bool = True, **kw) -> QuantizationArgs:
    return QuantizationArgs(num_bits=8, type="int", symmetric=symmetric, strategy="tensor", **kw)


def static_w8a8(symmetric: bool = True, weights: str = "channel") -> dict:
    return {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": weights},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": symmetric, "strategy": "tensor"},
        }
    }


def batches(n: int = 6, length: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = (torch.randint(-3, 4, (1, length), generator=g).cumsum(-1) % 120 + 4).long()
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return out


IDS = torch.randint(4, 128, (2, 11), generator=torch.Generator().manual_seed(1))


def calibrate(modifier, **pipe) -> tuple[torch.nn.Module, RunState]:
    model = tiny_llama()
    modifier.validate(model)
    return model, run_pipeline(model, None, [modifier], None, PipelineArgs(**pipe), batches=batches())


def seqcal_logits(model: torch.nn.Module, state: RunState, modifier) -> torch.Tensor:
    with torch.no_grad(), quantized_inputs(model, state, modifier.modules):
        return model(IDS).logits


# --- observers ---------------------------------------------------------------------------------------------


def test_observers_follow_llm_compressor_semantics() -> None:
    xs = [torch.randn(7, 16) * s for s in (1.0, 3.0, 0.5)]
    lo = [x.amin() for x in xs]
    hi = [x.amax() for x in xs]
    ranges = {}
    for name in ("minmax", "static_minmax", "memoryless_minmax"):
        obs = make_observer(int8(symmetric=False, observer=name))
        for x in xs:
            obs.update(x)
        ranges[name] = obs.range
    ema_lo, ema_hi = lo[0], hi[0]
    for a, b in zip(lo[1:], hi[1:]):  # averaging_constant 0.01: past * 0.99 + now * 0.01
        ema_lo, ema_hi = ema_lo * 0.99 + a * 0.01, ema_hi * 0.99 + b * 0.01
    torch.testing.assert_close(ranges["minmax"], (ema_lo.reshape(1), ema_hi.reshape(1)))
    torch.testing.assert_close(ranges["static_minmax"], (min(lo).reshape(1), max(hi).reshape(1)))
    torch.testing.assert_close(ranges["memoryless_minmax"], (lo[-1].reshape(1), hi[-1].reshape(1)))
    # the constant is an observer_kwargs, as in llm-compressor
    obs = make_observer(int8(observer="minmax", observer_kwargs={"averaging_constant": 1.0}))
    for x in xs:
        obs.update(x)
    torch.testing.assert_close(obs.range[1], hi[-1].reshape(1))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("kind", ["int", "float"])
def test_observer_qparams_equal_compressed_tensors(symmetric: bool, kind: str) -> None:
    if kind == "float" and not symmetric:
        return  # fp8 activations are symmetric only (refused in test_bad_activation_settings_are_refused)
    args = QuantizationArgs(
        num_bits=8, type=kind, symmetric=symmetric, strategy="tensor", observer="static_minmax"
    )
    obs = make_observer(args)
    x = torch.randn(9, 32) * 2 + 0.3
    obs.update(x)
    scale, zero = obs.qparams()
    ct_scale, ct_zero = calculate_qparams(x.amin().reshape(1), x.amax().reshape(1), args)
    assert torch.equal(scale, ct_scale)
    if not symmetric:
        assert torch.equal(zero, ct_zero.round().to(torch.int8))


def test_mse_observer_shrinks_the_range_and_lowers_the_error() -> None:
    x = torch.randn(64, 32)
    x[0, 0] = 8.0  # one outlier: min-max wastes the 4-bit grid on it
    int4 = lambda name: QuantizationArgs(num_bits=4, strategy="tensor", observer=name)  # noqa: E731
    mm, mse = make_observer(int4("memoryless_minmax")), make_observer(int4("memoryless_mse"))
    mm.update(x)
    mse.update(x)
    assert mse.range[1] < mm.range[1]

    def error(obs) -> float:
        s, _ = obs.qparams()
        q = torch.clamp(torch.round(x / s), -8, 7) * s
        return (q - x).abs().pow(2.4).sum().item()

    assert error(mse) < error(mm)


def test_group_observer_has_one_range_per_group() -> None:
    args = QuantizationArgs(num_bits=8, strategy="group", group_size=8, observer="static_minmax")
    obs = make_observer(args)
    x = torch.randn(5, 32)
    obs.update(x)
    assert obs.range[0].shape == (4,)
    torch.testing.assert_close(obs.range[1], x.reshape(5, 4, 8).amax(dim=(0, 2)))


# --- fake-quant as the runtime ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        QuantizationArgs(num_bits=8, strategy="token", dynamic=True),
        QuantizationArgs(num_bits=8, strategy="token", dynamic=True, type="float"),
        QuantizationArgs(num_bits=8, strategy="tensor", dynamic=True, symmetric=False),
        QuantizationArgs(num_bits=8, strategy="group", group_size=8, dynamic=True),
    ],
    ids=["int_token", "fp8_token", "int_tensor_asym", "int_group"],
)
def test_dynamic_fake_quant_equals_compressed_tensors(args: QuantizationArgs) -> None:
    x = torch.randn(2, 5, 32) * 3
    module = torch.nn.Linear(32, 4)
    initialize_module_for_quantization(module, QuantizationScheme(targets=["Linear"], input_activations=args))
    assert torch.equal(dynamic_fake_quantize(x, args), forward_quantize(module, x, "input", args))


@pytest.mark.parametrize("symmetric", [True, False])
def test_static_fake_quant_equals_compressed_tensors(symmetric: bool) -> None:
    args = int8(symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=int8(), input_activations=args)
    obs = make_observer(args)
    obs.update(torch.randn(20, 32) * 2 + 0.5)
    scale, zero = obs.qparams()
    module = torch.nn.Linear(32, 4)
    initialize_module_for_quantization(module, scheme)
    module.input_scale.data.copy_(scale)
    module.input_zero_point.data.copy_(zero if not symmetric else torch.zeros_like(zero))
    qw = QuantizedWeight(torch.empty(0), torch.empty(0), None, None, scheme, input_scale=scale,
                         input_zero_point=None if symmetric else zero)  # fmt: skip
    x = torch.randn(2, 5, 32) * 3  # values beyond the calibrated range are clamped
    assert torch.equal(input_fake_quantize(x, qw), forward_quantize(module, x, "input", args))


def test_modules_reading_one_tensor_quantize_it_once_unless_their_scales_differ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Fork(torch.nn.Module):  # three Linears read one tensor, as q/k/v do
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(32, 4) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.a(x), self.b(x), self.c(x)], dim=-1)

    args = int8(True)
    scheme = QuantizationScheme(targets=["Linear"], weights=int8(), input_activations=args)
    scales = {"a": torch.tensor([0.05]), "b": torch.tensor([0.05]), "c": torch.tensor([0.09])}  # c differs
    state = RunState()
    state.results.quantized = {n: QuantizedWeight(torch.empty(0), torch.empty(0), None, None, scheme, input_scale=s)
                       for n, s in scales.items()}  # fmt: skip
    model, x = Fork(), torch.randn(2, 5, 32) * 3
    calls: list[int] = []
    real = activations.input_fake_quantize
    monkeypatch.setattr(activations, "input_fake_quantize", lambda t, qw: calls.append(1) or real(t, qw))
    with torch.no_grad(), quantized_inputs(model, state, dict.fromkeys(scales, scheme)):
        got = model(x)
    assert len(calls) == 2  # a and b share one, c has its own scale
    want = torch.cat([getattr(model, n)(real(x, state.results.quantized[n])) for n in "abc"], dim=-1)
    assert torch.equal(got, want)


# --- checkpoint and round trip ------------------------------------------------------------------------------

CASES = {
    "rtn_fp8": lambda: QuantizationModifier(scheme="FP8", ignore=["lm_head"]),
    "rtn_w8a8_static": lambda: QuantizationModifier(config_groups=static_w8a8(), ignore=["lm_head"]),
    "gptq_w8a8_static": lambda: GPTQModifier(config_groups=static_w8a8(), ignore=["lm_head"]),
    "gptq_w8a8_static_asym": lambda: GPTQModifier(config_groups=static_w8a8(False), ignore=["lm_head"]),
    "gptq_fp8": lambda: GPTQModifier(scheme="FP8", ignore=["lm_head"]),
}


def _compressed_by_compressed_tensors(
    module: torch.nn.Module, qw: QuantizedWeight
) -> dict[str, torch.Tensor]:
    """compressed-tensors' lifecycle on a copy of the fake-quantized module: initialize its qparams, set them
    to seqcal's, compress with the compressor of its format."""
    module = copy.deepcopy(module)
    initialize_module_for_quantization(module, qw.scheme.model_copy(deep=True))
    module.weight_scale.data.copy_(qw.scale)
    module.input_scale.data.copy_(qw.input_scale)
    if qw.input_zero_point is not None:
        module.input_zero_point.data.copy_(qw.input_zero_point)
    compress_module(module)
    return {k: v for k, v in get_direct_state_dict(module).items() if v is not None}  # Linear's bias=None


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_equals_compressed_tensors_and_reloads_to_the_same_model(
    case: str, tmp_path: Path
) -> None:
    modifier = CASES[case]()
    model, state = calibrate(modifier)
    assert all(qw.input_scale is not None for qw in state.results.quantized.values())
    want = seqcal_logits(model, state, modifier)
    save_checkpoint(model, state, tmp_path)
    block = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    fmt = "float-quantized" if "fp8" in case else "int-quantized"
    assert (
        block["format"] == fmt and block["config_groups"]["group_0"]["input_activations"]["dynamic"] is False
    )
    tensors = checkpoint_tensors(tmp_path)
    for name, qw in state.results.quantized.items():
        ours = local(tensors, name)
        theirs = _compressed_by_compressed_tensors(model.get_submodule(name), qw)
        assert sorted(ours) == sorted(theirs), name
        for key in ours:
            assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), (
                f"{name}.{key}"
            )
        assert ("input_zero_point" in ours) is case.endswith("asym")
    loaded = reload(tmp_path)
    with torch.no_grad():
        got = loaded(IDS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # the static scales matter: without them the model is another one
    with torch.no_grad():
        assert (model(IDS).logits - want).abs().max() > 1e-4


@pytest.mark.parametrize("one_pass", [True, False])
def test_downstream_modules_calibrate_on_quantized_upstream(one_pass: bool) -> None:
    # The input scale of the last layer's q_proj is what its observer gives on the inputs of a model whose
    # layer 0 is fully quantized, weights and activations (static per-tensor fp8, static_minmax).
    modifier = CASES["rtn_fp8"]()
    model, state = calibrate(modifier, one_pass=one_pass)
    name = "model.layers.1.self_attn.q_proj"
    seen = []
    hook = model.get_submodule(name).register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad(), quantized_inputs(model, state, modifier.modules):
            for batch in batches():
                model(**batch)
    finally:
        hook.remove()
    obs = make_observer(modifier.modules[name].input_activations)
    for x in seen:
        obs.update(x.reshape(-1, x.shape[-1]))
    torch.testing.assert_close(state.results.quantized[name].input_scale, obs.qparams()[0], rtol=1e-6, atol=0)


def test_unobserved_padding_is_left_out() -> None:
    modifier = QuantizationModifier(config_groups=static_w8a8(False), ignore=["lm_head"])
    model = tiny_llama()
    modifier.validate(model)
    data = batches(2)
    padded = [{"input_ids": torch.cat([torch.full((1, 4), 1), b["input_ids"]], 1),
               "attention_mask": torch.cat([torch.zeros(1, 4, dtype=torch.long), b["attention_mask"]], 1)}
              for b in data]  # fmt: skip
    plain = run_pipeline(model, None, [modifier], None, PipelineArgs(), batches=data)
    modifier2 = QuantizationModifier(config_groups=static_w8a8(False), ignore=["lm_head"])
    model2 = tiny_llama()
    modifier2.validate(model2)
    with_pad = run_pipeline(model2, None, [modifier2], None, PipelineArgs(), batches=padded)
    name = "model.layers.0.self_attn.q_proj"  # before any attention: padding cannot change real tokens
    assert torch.equal(
        plain.results.quantized[name].input_scale, with_pad.results.quantized[name].input_scale
    )


# --- recipes ------------------------------------------------------------------------------------------------

STATIC_RECIPES = ["rtn_fp8_static.yaml", "gptq_w8a8_static.yaml", "rtn_w8a8_static_tensor.yaml",
                  "gptq_w8a8_static_asym.yaml"]  # fmt: skip


@pytest.mark.parametrize("recipe", STATIC_RECIPES)
def test_shipped_static_recipes_run_and_reload(recipe: str, tmp_path: Path) -> None:
    parsed = parse_recipe(str(RECIPES / recipe))
    model = tiny_llama()
    parsed.validate(model)
    state = run_pipeline(model, None, parsed.modifiers, None, PipelineArgs(), batches=batches())
    modules = {n: s for m in parsed.modifiers for n, s in m.modules.items()}
    assert set(state.results.quantized) == set(modules) and all(
        q.input_scale is not None for q in state.results.quantized.values()
    )
    with torch.no_grad(), quantized_inputs(model, state, modules):
        want = model(IDS).logits
    save_checkpoint(model, state, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reload(tmp_path)(IDS).logits, want, rtol=0, atol=1e-6)


# llm-compressor's own recipe files (Apache-2.0, vllm-project/llm-compressor) that seqcal refused before it
# calibrated static activations; they now parse and run unchanged.
LLMC_STATIC = {
    "TinyLlama-1.1B-Chat-v1.0-fp8/recipe.yaml (saved by llm-compressor)": """
DEFAULT_stage:
  DEFAULT_modifiers:
    QuantizationModifier:
      ignore: [lm_head]
      targets: Linear
      scheme: FP8
""",
    "tests/llmcompressor/transformers/compression/recipes/new_quant_full.yaml": """
test_stage:
    quant_modifiers:
        GPTQModifier:
            block_size: 128
            ignore: ["lm_head", "model.layers.0.mlp.down_proj"]
            config_groups:
                group_0:
                    weights:
                        num_bits: 8
                        type: "int"
                        symmetric: false
                        strategy: "channel"
                    input_activations:
                        num_bits: 8
                        type: "int"
                        symmetric: false
                        strategy: "tensor"
                    output_activations: null
                    targets: ["Linear"]""",
}


@pytest.mark.parametrize("name", list(LLMC_STATIC))
def test_llm_compressor_static_recipes_run_unchanged(name: str, tmp_path: Path) -> None:
    parsed = parse_recipe(LLMC_STATIC[name])
    model = tiny_llama()
    parsed.validate(model)
    state = run_pipeline(model, None, parsed.modifiers, None, PipelineArgs(), batches=batches())
    assert state.results.quantized and all(
        q.input_scale is not None for q in state.results.quantized.values()
    )
    assert "model.layers.0.mlp.down_proj" not in state.results.quantized or "DEFAULT" in LLMC_STATIC[name]
    modules = {n: sc for m in parsed.modifiers for n, sc in m.modules.items()}
    with torch.no_grad(), quantized_inputs(model, state, modules):
        want = model(IDS).logits
    save_checkpoint(model, state, tmp_path)
    with torch.no_grad():  # asymmetric channel weights are int-quantized (8 bits): no packed zero points
        torch.testing.assert_close(reload(tmp_path)(IDS).logits, want, rtol=0, atol=1e-6)


# --- refused before calibrating -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "acts, match",
    [
        ({"observer": "maxmin"}, "observer 'maxmin' does not exist; valid observers: minmax, static_minmax"),
        ({"strategy": "channel"}, "channel strategy is not supported for activation"),  # compressed-tensors'
        ({"strategy": "token"}, "static token quantization, please use `dynamic=True`"),
        ({"strategy": "block", "block_structure": [8, 8]}, "block strategy is not supported for activation"),
        (
            {"strategy": "tensor_group", "group_size": 16, "num_bits": 4, "type": "float"},
            "cannot use strategy 'tensor_group'",
        ),
        ({"type": "float", "symmetric": False}, "fp8 input activations must be symmetric"),
    ],
)
def test_bad_activation_settings_are_refused(acts: dict, match: str) -> None:
    groups = static_w8a8()
    groups["group_0"]["input_activations"].update(acts)
    with pytest.raises(ValueError, match=match):
        GPTQModifier(config_groups=groups, ignore=["lm_head"])


def test_output_activations_are_refused() -> None:
    groups = static_w8a8()
    groups["group_0"]["output_activations"] = {"num_bits": 8, "strategy": "tensor"}
    with pytest.raises(ValueError, match="output_activations are not supported"):
        QuantizationModifier(config_groups=groups)


def test_activation_group_that_does_not_divide_the_inputs_is_refused() -> None:
    groups = static_w8a8()
    groups["group_0"]["input_activations"].update(strategy="group", group_size=48)
    modifier = QuantizationModifier(config_groups=groups, ignore=["lm_head"])
    with pytest.raises(ValueError, match="group_size 48 does not divide the inputs of .* module"):
        modifier.validate(tiny_llama())


def test_every_observer_name_is_valid_in_a_recipe() -> None:
    for name in OBSERVERS:
        groups = static_w8a8()
        groups["group_0"]["input_activations"]["observer"] = name
        model, state = calibrate(QuantizationModifier(config_groups=groups, ignore=["lm_head"]))
        assert all(
            q.input_scale is not None and q.input_scale.item() > 0 for q in state.results.quantized.values()
        )


def test_fp8_preset_is_supported() -> None:
    scheme = preset_name_to_scheme("FP8", ["Linear"])
    assert scheme.input_activations.dynamic is False
    assert QuantizationModifier(scheme="FP8").needs_calibration
    assert not QuantizationModifier(scheme="FP8_DYNAMIC").needs_calibration


# --- resume -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme, scales", [("FP8", "input_scale"), ("NVFP4", "input_global_scale")])
def test_an_interrupted_static_run_resumes_to_the_same_checkpoint(
    scheme: str, scales: str, tmp_path: Path, monkeypatch
) -> None:
    # Replayed subgraphs must fake-quantize their inputs with the saved input scales (NVFP4: global scales),
    # or every scale after them would be calibrated on other inputs than in the uninterrupted run.
    import seqcal.checkpoint.streaming as streaming
    from seqcal.entrypoint import oneshot

    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    data = [{"input_ids": b["input_ids"][0].tolist()} for b in batches()]
    run = dict(
        dataset=data,
        recipe=f"QuantizationModifier: {{scheme: {scheme}, ignore: [lm_head]}}",
        max_seq_length=16,
    )
    monkeypatch.setattr(streaming, "CHECKPOINT_BYTES", 1)  # record progress after every subgraph
    done = streaming.StreamingCheckpoint.done

    def stop_midway(self, sg) -> None:
        done(self, sg)
        if sg.index == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(streaming.StreamingCheckpoint, "done", stop_midway)
    with pytest.raises(KeyboardInterrupt):
        oneshot(model=str(model_dir), output_dir=str(tmp_path / "killed"), **run)
    monkeypatch.setattr(streaming.StreamingCheckpoint, "done", done)
    oneshot(model=str(model_dir), output_dir=str(tmp_path / "killed"), resume=True, **run)
    oneshot(model=str(model_dir), output_dir=str(tmp_path / "clean"), **run)
    a, b = checkpoint_tensors(tmp_path / "killed"), checkpoint_tensors(tmp_path / "clean")
    assert a.keys() == b.keys() and any(k.endswith(scales) for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_datafree_pipeline_refuses_static_activations_naming_the_modifier() -> None:
    from seqcal.entrypoint import oneshot

    with pytest.raises(ValueError, match=r"need calibration data \(QuantizationModifier: .*static input"):
        oneshot(
            model=tiny_llama(),
            recipe=QuantizationModifier(scheme="FP8", ignore=["lm_head"]),
            pipeline="datafree",
        )
