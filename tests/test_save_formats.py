"""Checkpoints in the formats vLLM serves beyond int / fp8 (FP8_BLOCK, NVFP4A16, MX): compressed-tensors' own
tensors, shared NVFP4 global scales, reload with transformers, and the refusals before calibration."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.quantization import preset_name_to_scheme
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from save_helpers import (
    assert_same_tensors,
    checkpoint_tensors,
    compressed_by_compressed_tensors,
    dynamic_activations,
    local,
)
from seqcal.algorithms import formats
from seqcal.checkpoint.writer import save_checkpoint
from seqcal.entrypoint import oneshot
from seqcal.modifiers.base import RunState
from seqcal.modifiers.formats import fused_groups, shared_global_scales
from seqcal.modifiers.round_to_nearest import rtn_quantize_module

PRESETS = [
    "FP8_BLOCK",
    "NVFP4A16",
    "MXFP4A16",
    "MXFP4",
    "MXFP4XFP8",
    "MXFP6A16",
    "MXFP6A8",
    "MXFP8A16",
    "MXFP8",
]
VOCAB = 96
IDS = torch.randint(4, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))


def tiny(
    dtype: torch.dtype = torch.bfloat16, hidden: int = 128, inter: int = 256, kv: int = 4
) -> LlamaForCausalLM:
    """Widths that fit every format (multiples of 128; k_proj's rows a multiple of FP8_BLOCK's block height)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)  # as from_pretrained builds it
    return model


def _rtn(model: torch.nn.Module, preset: str) -> RunState:
    scheme = preset_name_to_scheme(preset, ["Linear"])
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    scales: dict[str, torch.Tensor] = {}
    if preset == "NVFP4A16":
        shared_global_scales(model, names, fused_groups(model, names), scales)
    state = RunState()
    for name in names:
        state.results.quantized[name] = rtn_quantize_module(
            model.get_submodule(name), scheme, scales.get(name)
        )
    return state


def _ct_input(module: torch.nn.Module, qw) -> dict[str, torch.Tensor]:
    """The module's state as compressed-tensors holds it before compressing (scales in the weight's dtype)."""
    sd = {"weight": module.weight.data, "weight_scale": qw.scale}
    if qw.global_scale is not None:
        sd["weight_global_scale"] = qw.global_scale
    return sd


@pytest.mark.parametrize("preset", PRESETS)
def test_checkpoint_tensors_are_compressed_tensors_own(preset: str, tmp_path: Path) -> None:
    model = tiny()
    state = _rtn(model, preset)
    save_checkpoint(model, state, tmp_path)
    saved = checkpoint_tensors(tmp_path)
    block = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    scheme = next(iter(state.results.quantized.values())).scheme
    fmt = infer_module_format(torch.nn.Linear, scheme)
    assert block["format"] == fmt.value
    compressor = BaseCompressor.get_value_from_registry(fmt.value)
    for name, qw in state.results.quantized.items():
        expected = compressor.compress(_ct_input(model.get_submodule(name), qw), scheme)
        ours = local(saved, name)
        assert set(ours) == set(expected), (name, sorted(ours), sorted(expected))
        for key, tensor in expected.items():
            assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), (name, key)
        # and compressed-tensors' decompressor gives back the in-memory weight
        back = compressor.decompress(dict(ours), scheme)["weight"]
        torch.testing.assert_close(back.float(), model.get_submodule(name).weight.float(), rtol=2**-8, atol=0)


def test_nvfp4_global_scales_are_shared_by_the_modules_vllm_fuses(tmp_path: Path) -> None:
    model = tiny(torch.float32)
    original = {
        n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    oneshot(model=model, dataset=[{"input_ids": IDS[0].tolist()}], recipe="QuantizationModifier:\n  scheme: "
            "NVFP4A16\n  ignore: [lm_head]", output_dir=str(tmp_path), num_calibration_samples=1)  # fmt: skip
    saved = checkpoint_tensors(tmp_path)
    layer = "model.layers.1"

    def gs(leaf: str) -> torch.Tensor:
        return saved[f"{layer}.{leaf}.weight_global_scale"]

    qkv = [f"self_attn.{p}_proj" for p in "qkv"]
    expected = min(formats.global_scale_of(original[f"{layer}.{leaf}"]) for leaf in qkv)
    assert all(torch.equal(gs(leaf), expected) for leaf in qkv)
    assert torch.equal(gs("mlp.gate_proj"), gs("mlp.up_proj"))
    assert torch.equal(gs("mlp.down_proj"), formats.global_scale_of(original[f"{layer}.mlp.down_proj"]))
    assert not torch.equal(gs("mlp.gate_proj"), gs("mlp.down_proj"))  # not one scale for everything


def test_experts_share_gate_and_up_global_scales_per_expert(tmp_path: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from seqcal.experts import linearize_experts

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    model = Qwen3MoeForCausalLM(config).eval()
    handle = linearize_experts(model)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    groups = fused_groups(model, names)
    handle.restore()
    experts = [g for g in groups if ".experts." in g[0]]
    assert len(experts) == 4
    assert experts[0] == ("model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.0.up_proj")
    attention = tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    assert attention in groups
    data = [{"input_ids": row.tolist()} for row in torch.randint(4, VOCAB, (4, 24))]
    recipe = "GPTQModifier:\n  scheme: NVFP4A16\n  ignore: [lm_head, 're:.*mlp.gate$']"
    oneshot(model=model, dataset=data, recipe=recipe, output_dir=str(tmp_path), num_calibration_samples=4,
            max_seq_length=24)  # fmt: skip
    saved = checkpoint_tensors(tmp_path)
    scales = [
        saved[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight_global_scale"]
        for e in range(4)
        for p in ("gate", "up")
    ]
    assert all(torch.equal(scales[2 * e], scales[2 * e + 1]) for e in range(4))  # gate = up, per expert
    assert len({s.item() for s in scales}) == 4  # and one scale per expert, not one for all


@pytest.mark.parametrize("algo", ["QuantizationModifier", "GPTQModifier"])
@pytest.mark.parametrize("preset", PRESETS)
def test_checkpoint_reloads_as_the_calibrated_model(preset: str, algo: str, tmp_path: Path) -> None:
    data = [{"input_ids": row.tolist()} for row in torch.randint(4, VOCAB, (4, 24))]
    recipe = f"{algo}:\n  scheme: {preset}\n  ignore: [lm_head]"
    model = oneshot(
        model=tiny(), dataset=data, recipe=recipe, output_dir=str(tmp_path), num_calibration_samples=4
    )
    state = RunState()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            from seqcal.modifiers.base import QuantizedWeight

            scheme = preset_name_to_scheme(preset, ["Linear"])
            state.results.quantized[name] = QuantizedWeight(
                torch.empty(0), torch.empty(0), None, None, scheme
            )
    with torch.no_grad(), dynamic_activations(model, state):
        ref = model(IDS).logits
    # compressed-tensors 0.20 runs these formats' compressed modules in bfloat16 only (it decompresses to bf16)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        got = loaded(IDS).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


# ---------------------------------------------------------------- refused before calibration

WIDE = {"hidden": 128, "inter": 120}  # down_proj: 120 inputs, not a multiple of 16 / 32
CASES = {  # name -> (model widths, recipe scheme, fragments of the one-sentence error)
    "fp4 width": (WIDE, "NVFP4A16", ["weight group_size 16 does not divide the inputs of 2 module(s)",
                                     "model.layers.0.mlp.down_proj (120 inputs)", "add them to ignore"]),
    "mx group": (WIDE, "MXFP4A16", ["weight group_size 32 does not divide", "mlp.down_proj (120 inputs)"]),
    "activation group": ({"hidden": 192, "inter": 256}, "FP8_BLOCK",
                         ["activation group_size 128 does not divide the inputs", "self_attn.q_proj (192 inputs)"]),
    "block fit": ({"kv": 2}, "FP8_BLOCK",
                  ["block [128, 128] does not fit model.layers.0.self_attn.k_proj, whose 64 output rows",
                   "vLLM merges it with q_proj, v_proj", "add them to ignore"]),
    "nvfp4 w4a4 width": (WIDE, "NVFP4", ["weight group_size 16 does not divide the inputs of 2 module(s)",
                                         "model.layers.0.mlp.down_proj (120 inputs)", "add them to ignore"]),
}  # fmt: skip


def _recipe(scheme: str) -> str:
    return f"QuantizationModifier:\n  scheme: {scheme}\n  ignore: [lm_head]\n"


@pytest.mark.parametrize("case", list(CASES))
def test_bad_widths_are_refused_by_oneshot_before_calibrating(case: str, tmp_path: Path) -> None:
    widths, scheme, fragments = CASES[case]
    data = [{"input_ids": [5, 6, 7]}]
    with pytest.raises(ValueError) as err:
        oneshot(model=tiny(torch.float32, **widths), dataset=data, recipe=_recipe(scheme),
                output_dir=str(tmp_path / "out"), num_calibration_samples=1)  # fmt: skip
    message = str(err.value)
    assert all(f in message for f in fragments), message
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def model_dirs(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The models of CASES saved with the default model's tokenizer, for the command line."""
    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    dirs = {}
    for case, (widths, _, _) in CASES.items():
        kw = {"hidden": 128, "inter": 256, "kv": 4, **widths}
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=vocab, hidden_size=kw["hidden"], intermediate_size=kw["inter"],
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kw["kv"],
                             max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip
        path = tmp_path_factory.mktemp("formats")
        LlamaForCausalLM(config).eval().save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(smollm2_dir / name, path / name)
        dirs[case] = path
    return dirs


@pytest.mark.parametrize("case", list(CASES))
def test_bad_widths_are_one_sentence_on_the_command_line(case: str, model_dirs, tmp_path: Path) -> None:
    _, scheme, fragments = CASES[case]
    recipe, text = tmp_path / "recipe.yaml", tmp_path / "data.txt"
    recipe.write_text(_recipe(scheme))
    text.write_text("one two three four five six seven eight nine ten\n" * 20)
    cmd = [sys.executable, "-m", "seqcal.cli", "oneshot", "--model", str(model_dirs[case]), "--dataset", str(text),
           "--recipe", str(recipe), "--output-dir", str(tmp_path / "out"), "--num-calibration-samples", "2",
           "--max-seq-length", "16"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "calibrating" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("seqcal: error:")]
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), result.stderr[-2000:]


INT_DYNAMIC = ["INT8", "W2A4", "W2A8", "W3A4", "W3A8", "W4A4", "W4A8", "W4AFP8", "W5A8", "W6A8", "W7A8"]


@pytest.mark.parametrize("preset", INT_DYNAMIC)
def test_int_weight_presets_with_dynamic_activations_reload_exactly(preset: str, tmp_path: Path) -> None:
    from seqcal.modifiers.base import QuantizedWeight

    data = [{"input_ids": row.tolist()} for row in torch.randint(4, VOCAB, (4, 24))]
    recipe = f"GPTQModifier:\n  scheme: {preset}\n  ignore: [lm_head]"
    model = oneshot(model=tiny(torch.float32), dataset=data, recipe=recipe, output_dir=str(tmp_path),
                    num_calibration_samples=4)  # fmt: skip
    scheme = preset_name_to_scheme(preset, ["Linear"])
    state = RunState()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            state.results.quantized[name] = QuantizedWeight(
                torch.empty(0), torch.empty(0), None, None, scheme
            )
    with torch.no_grad(), dynamic_activations(model, state):
        ref = model(IDS).logits
    assert (
        json.loads((tmp_path / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"
    )
    # the stored tensors are what compressed-tensors' compressor writes for the same fake-quantized module
    saved = checkpoint_tensors(tmp_path)
    for name in state.results.quantized:
        ours = local(saved, name)
        theirs = compressed_by_compressed_tensors(
            model.get_submodule(name), scheme, {"weight_scale": ours["weight_scale"]}
        )
        assert_same_tensors(ours, theirs, name)
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path).eval()(IDS).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
