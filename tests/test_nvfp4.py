"""NVFP4 (W4A4): fp4 weights and fp4 input activations with a calibrated input global scale.

The activations' fake-quant is checked against compressed-tensors' own dynamic ``local`` forward; the input
global scale against llm-compressor's rule (``generate_gparam`` of the observed absolute maximum, one value
for the modules vLLM fuses) on inputs computed with every upstream module quantized; the checkpoint against
compressed-tensors' compressor run on the same fake-quantized module; the reloaded model (transformers with
compressed-tensors, which runs fp4 activations on CPU in bfloat16) against seqcal's fake-quantized model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle import forward_quantize, initialize_module_for_quantization
from compressed_tensors.quantization.utils import generate_gparam
from transformers import AutoModelForCausalLM

from save_helpers import assert_same_tensors, checkpoint_tensors, compressed_by_compressed_tensors, local
from seqcal.checkpoint.writer import save_checkpoint
from seqcal.execution.pipeline import PipelineArgs, run_pipeline
from seqcal.modifiers import GPTQModifier, QuantizationModifier, QuantizedWeight, RunState
from seqcal.modifiers.activations import input_fake_quantize, quantized_inputs
from seqcal.modifiers.state import Batch
from test_save_formats import IDS, VOCAB, tiny

SCHEME = preset_name_to_scheme("NVFP4", ["Linear"])
ACTS = SCHEME.input_activations
MODIFIERS = {
    "rtn": lambda: QuantizationModifier(scheme="NVFP4", ignore=["lm_head"]),
    "gptq": lambda: GPTQModifier(scheme="NVFP4", ignore=["lm_head"]),
}


def batches(n: int = 4, length: int = 24) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(4, VOCAB, (n, length), generator=torch.Generator().manual_seed(2))
    return [{"input_ids": row[None], "attention_mask": torch.ones_like(row[None])} for row in ids]


def calibrate(modifier, dtype: torch.dtype = torch.bfloat16, **pipe) -> tuple[torch.nn.Module, RunState]:
    model = tiny(dtype)
    modifier.validate(model)
    return model, run_pipeline(model, None, [modifier], None, PipelineArgs(**pipe), batches=batches())


def _ct_module(x_features: int, global_scale: torch.Tensor) -> torch.nn.Linear:
    module = torch.nn.Linear(x_features, 8)
    initialize_module_for_quantization(module, QuantizationScheme(targets=["Linear"], input_activations=ACTS))
    module.input_global_scale.data.copy_(global_scale)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp4_activation_fake_quant_equals_compressed_tensors(dtype: torch.dtype) -> None:
    x = (torch.randn(2, 7, 64) * torch.logspace(-2, 1, 64)).to(dtype)
    x[0, 0, :16] = 0  # an all-zero group: compressed-tensors' smallest fp8 scale, not a division by zero
    for amax in (x.abs().amax(), x.abs().amax() / 4):  # calibrated range, and inputs beyond it (saturated)
        global_scale = generate_gparam(-amax.reshape(1), amax.reshape(1))
        qw = QuantizedWeight(
            torch.empty(0), torch.empty(0), None, None, SCHEME, input_global_scale=global_scale
        )
        ours = input_fake_quantize(x, qw)
        theirs = forward_quantize(_ct_module(64, global_scale), x, "input", ACTS)
        assert ours.dtype == theirs.dtype == dtype and torch.equal(ours, theirs)
        assert not torch.equal(ours, x)


def test_input_global_scale_is_the_fused_observed_amax_on_quantized_upstream_inputs() -> None:
    modifier = MODIFIERS["rtn"]()
    model, state = calibrate(modifier)
    layer = "model.layers.1"
    qkv = [f"{layer}.self_attn.{p}_proj" for p in "qkv"]
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [
        model.get_submodule(n).register_forward_pre_hook(
            lambda m, args, n=n: seen.setdefault(n, []).append(args[0].detach())
        )
        for n in [*qkv, f"{layer}.mlp.gate_proj", f"{layer}.mlp.down_proj"]
    ]
    try:
        # the inputs layer 1 saw during calibration: layer 0 quantized, fp4 activations included
        with torch.no_grad(), quantized_inputs(model, state, modifier.modules):
            for batch in batches():
                model(**batch)
        with torch.no_grad():
            for batch in batches():
                model(**batch)  # the same weights, full-precision activations
    finally:
        for hook in hooks:
            hook.remove()

    def gparam(xs: list[torch.Tensor]) -> torch.Tensor:
        amax = torch.stack([x.abs().amax() for x in xs]).amax()
        return generate_gparam(-amax.reshape(1), amax.reshape(1))

    n = len(batches())
    for name in [qkv[0], f"{layer}.mlp.gate_proj", f"{layer}.mlp.down_proj"]:
        got = state.results.quantized[name].input_global_scale
        assert got.dtype == torch.float32 and torch.equal(got, gparam(seen[name][:n])), name
        assert not torch.equal(got, gparam(seen[name][n:])), name  # upstream activations were quantized
    assert all(torch.equal(state.results.quantized[n].input_global_scale, state.results.quantized[qkv[0]].input_global_scale)
               for n in qkv)  # fmt: skip
    up = state.results.quantized[f"{layer}.mlp.up_proj"].input_global_scale
    assert torch.equal(up, state.results.quantized[f"{layer}.mlp.gate_proj"].input_global_scale)


def test_fused_modules_share_the_largest_input_range() -> None:
    # q/k/v read one tensor, so their observers agree; the shared scale must hold even when they do not
    from seqcal.modifiers.activations import InputCalibration

    model = tiny()
    attn = "model.layers.0.self_attn"
    names = [f"{attn}.{p}_proj" for p in "qkv"]
    calib = InputCalibration(dict.fromkeys(names, SCHEME))
    state = RunState()
    for i, name in enumerate(names):
        calib.observe([name], torch.randn(5, 128) * (i + 1), state, Batch())
        state.results.quantized[name] = QuantizedWeight(torch.empty(0), torch.empty(0), None, None, SCHEME)
    amax = calib.observers[names[2]].range[1].max().clone()
    amax = torch.maximum(amax, -calib.observers[names[2]].range[0].min())
    calib.finish(names, model, state)
    for name in names:
        assert torch.equal(
            state.results.quantized[name].input_global_scale, generate_gparam(-amax[None], amax[None])
        )


@pytest.mark.parametrize("algo", list(MODIFIERS))
def test_checkpoint_equals_compressed_tensors_and_reloads_to_the_same_model(
    algo: str, tmp_path: Path
) -> None:
    modifier = MODIFIERS[algo]()
    model, state = calibrate(modifier)
    with torch.no_grad(), quantized_inputs(model, state, modifier.modules):
        want = model(IDS).logits
    save_checkpoint(model, state, tmp_path)
    block = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    group = block["config_groups"]["group_0"]
    assert block["format"] == "nvfp4-pack-quantized" and "dequantize" not in block
    assert group["input_activations"] == json.loads(ACTS.model_dump_json()) | {"observer": "static_minmax"}
    tensors = checkpoint_tensors(tmp_path)
    for name, qw in state.results.quantized.items():
        qparams = {"weight_scale": qw.scale, "weight_global_scale": qw.global_scale,
                   "input_global_scale": qw.input_global_scale}  # fmt: skip
        theirs = compressed_by_compressed_tensors(model.get_submodule(name), qw.scheme, qparams)
        assert sorted(theirs) == [
            "input_global_scale",
            "weight_global_scale",
            "weight_packed",
            "weight_scale",
        ]
        assert_same_tensors(local(tensors, name), theirs, name)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        got = loaded(IDS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():  # the fp4 activations matter: without them the model is another one
        assert not torch.equal(model(IDS).logits, want)


def test_nvfp4_modifiers_need_calibration_data() -> None:
    assert QuantizationModifier(scheme="NVFP4").needs_calibration
    assert not QuantizationModifier(scheme="NVFP4A16").needs_calibration


@pytest.mark.parametrize(
    "acts, match",
    [
        ({"num_bits": 8}, "dynamic 'local' are NVFP4's .* got float 8-bit"),
        ({"group_size": 32}, "group_size 32; use the NVFP4 preset"),
        ({"observer": "mse"}, "observer 'mse' is not supported for them, use static_minmax"),
        ({"observer": "maxmin"}, "observer 'maxmin' does not exist; valid observers: minmax, static_minmax"),
    ],
)
def test_bad_fp4_activation_settings_are_refused(acts: dict, match: str) -> None:
    groups = {"group_0": {"targets": ["Linear"], "weights": SCHEME.weights.model_dump(),
                          "input_activations": ACTS.model_dump() | acts}}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        QuantizationModifier(config_groups=groups, ignore=["lm_head"])
