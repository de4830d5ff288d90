"""Tests for seqcal.checkpoint.writer: compressed-tensors checkpoints that transformers reloads to the same model.

Each scheme is quantized here with seqcal.algorithms (RTN or GPTQ), saved, and reloaded with
``AutoModelForCausalLM.from_pretrained``; the reloaded logits must equal the in-memory fake-quantized model's
(with dynamic per-token activation fake-quant for W8A8 / FP8_DYNAMIC), and the stored tensors must equal
what compressed-tensors' own compressors write for the same weights.

The checkpoint directory, sharding, tied weights, extras and the streaming writer are tested in
test_save_writer.py; shared models and checks are in save_helpers.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme
from transformers import CompressedTensorsConfig

from save_helpers import (
    IDS,
    SCHEMES,
    assert_logits_equal,
    checkpoint_tensors,
    gptq,
    local,
    quantize_case,
    reference_logits,
    reload,
    rtn,
    tiny_llama,
    weights,
)
from seqcal.checkpoint.writer import quantization_config, save_checkpoint
from seqcal.modifiers.base import RunState

FORMATS = {
    "w4a16_g16": "pack-quantized",
    "w4a16_asym": "pack-quantized",
    "w8a16_channel": "pack-quantized",
    "w3a16_asym_channel": "pack-quantized",
    "w8a8": "int-quantized",
    "fp8_dynamic": "float-quantized",
    "fp8_weight_only": "naive-quantized",
    "gptq_w4a16_g16": "pack-quantized",
}


@pytest.mark.parametrize("case", list(FORMATS))
def test_roundtrip_matches_fake_quantized_model(case: str, tmp_path: Path) -> None:
    model = tiny_llama()
    state = quantize_case(case, model)
    ref = reference_logits(model, state)
    save_checkpoint(model, state, tmp_path)
    block = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert block["format"] == FORMATS[case] and block["ignore"] == ["lm_head"]

    # the stored tensors are exactly what compressed-tensors' compressor writes for the same weights
    tensors = checkpoint_tensors(tmp_path)
    for name, qw in state.results.quantized.items():
        module = model.get_submodule(name)
        ours = local(tensors, name)
        sd = {"weight": module.weight.data, "weight_scale": qw.scale}
        sd["weight_zero_point"] = (
            qw.zero_point if qw.zero_point is not None else torch.zeros_like(qw.scale, dtype=qw.q.dtype)
        )
        compressor = BaseCompressor.get_value_from_registry(FORMATS[case])
        theirs = compressor.compress(sd, qw.scheme)
        assert sorted(ours) == sorted(theirs), name
        for key in ours:
            assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), (
                f"{name}.{key}"
            )
        decompressed = compressor.decompress(ours, qw.scheme)["weight"]
        assert torch.equal(decompressed.to(module.weight.dtype), module.weight.data), name

    loaded = reload(tmp_path)  # plain from_pretrained, asymmetric packed zero points included
    with torch.no_grad():
        got = loaded(IDS).logits
    assert_logits_equal(got, ref)
    for name in state.results.quantized:  # decompressed on the first forward
        assert torch.equal(loaded.get_submodule(name).weight, model.get_submodule(name).weight), name


@pytest.mark.parametrize("case", ["w4a16_asym", "w3a16_asym_channel", "w4a16_g16", "w8a8"])
def test_dequantize_load_hint_only_for_asymmetric_packed(case: str, tmp_path: Path) -> None:
    # Packed asymmetric zero points (int32 [ceil(out * b / 32), groups], compressed-tensors' layout) are
    # refused by transformers' compressed load path, which builds them unpacked: the config asks transformers
    # to dequantize on load instead. Other schemes keep the compressed path (W8A8 needs its activation quant).
    model = tiny_llama()
    state = quantize_case(case, model)
    save_checkpoint(model, state, tmp_path)
    block = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert block.get("dequantize", False) is case.endswith(("_asym", "_asym_channel"))
    zp = checkpoint_tensors(tmp_path).get("model.layers.0.mlp.down_proj.weight_zero_point")
    if "asym" in case:
        assert zp.dtype == torch.int32 and zp.shape[0] == -(-64 * int(case[1]) // 32)  # packed along dim 0
    with torch.no_grad():
        assert_logits_equal(reload(tmp_path)(IDS).logits, reference_logits(model, state))


def test_bf16_model_roundtrip_is_exact(tmp_path: Path) -> None:
    model = tiny_llama(dtype=torch.bfloat16)
    state = rtn(model, SCHEMES["w4a16_g16"])
    assert all(qw.scale.dtype == torch.bfloat16 for qw in state.results.quantized.values())
    ref = reference_logits(model, state)
    save_checkpoint(model, state, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = reload(tmp_path)
    assert loaded.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, ref)


def test_group_actorder_is_refused_with_fix(tmp_path: Path) -> None:
    model = tiny_llama()
    state = gptq(model, SCHEMES["w4a16_g16"], actorder="group")
    assert any(qw.g_idx is not None for qw in state.results.quantized.values())
    with pytest.raises(ValueError, match="actorder='weight'"):
        save_checkpoint(model, state, tmp_path)
    assert not (tmp_path / "config.json").exists()
    assert not list(tmp_path.glob("*.safetensors*"))  # partial shards removed


def test_identity_g_idx_is_dropped(tmp_path: Path) -> None:
    model = tiny_llama()
    state = rtn(model, SCHEMES["w4a16_g16"])
    for name, qw in state.results.quantized.items():
        qw.g_idx = (torch.arange(model.get_submodule(name).in_features) // 16).to(torch.int32)
    save_checkpoint(model, state, tmp_path)
    assert not any(k.endswith("g_idx") for k in checkpoint_tensors(tmp_path))


def test_static_activations_are_refused(tmp_path: Path) -> None:
    model = tiny_llama()
    state = rtn(model, preset_name_to_scheme("FP8", ["Linear"]))  # static per-tensor input scales
    with pytest.raises(ValueError, match="static"):
        save_checkpoint(model, state, tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_weight_changed_after_quantization_is_refused(tmp_path: Path) -> None:
    model = tiny_llama()
    state = rtn(model, SCHEMES["w4a16_g16"])
    model.model.layers[1].mlp.down_proj.weight.data[0, 0] += 1e-3
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj.*differs"):
        save_checkpoint(model, state, tmp_path, max_shard_size=4096)
    assert list(tmp_path.iterdir()) == []  # earlier shards were removed; nothing looks finished


def test_mixed_schemes_reload(tmp_path: Path) -> None:
    model = tiny_llama()
    attn = [n for n, _ in model.named_modules() if ".self_attn." in n]
    w8a8 = preset_name_to_scheme("W8A8", ["re:.*self_attn.*"])
    w4 = QuantizationScheme(targets=["re:.*mlp.*"], weights=weights())
    state = rtn(model, w8a8, attn)
    state.results.quantized.update(
        rtn(model, w4, [n for n, _ in model.named_modules() if ".mlp." in n]).results.quantized
    )
    ref = reference_logits(model, state)
    save_checkpoint(model, state, tmp_path)
    block = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert block["format"] == "mixed-precision"
    groups = block["config_groups"]
    assert [g["format"] for g in groups.values()] == ["int-quantized", "pack-quantized"]
    assert [g["targets"] for g in groups.values()] == [["re:.*self_attn.*"], ["re:.*mlp.*"]]
    with torch.no_grad():
        assert_logits_equal(reload(tmp_path)(IDS).logits, ref)


def test_overlapping_targets_fall_back_to_module_names(tmp_path: Path) -> None:
    model = tiny_llama()
    q_names = [n for n, _ in model.named_modules() if n.endswith("q_proj")]
    w8 = QuantizationScheme(targets=["Linear"], weights=weights(8, "channel"))
    state = rtn(
        model, w8, q_names
    )  # both groups target "Linear": compressed-tensors would give all one scheme
    rest = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in q_names]
    state.results.quantized.update(rtn(model, SCHEMES["w4a16_g16"], rest).results.quantized)
    ref = reference_logits(model, state)
    save_checkpoint(model, state, tmp_path)
    groups = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]
    assert groups["group_0"]["targets"] == sorted(q_names)
    loaded = reload(tmp_path)
    with torch.no_grad():
        assert_logits_equal(loaded(IDS).logits, ref)
    assert loaded.model.layers[0].self_attn.q_proj.quantization_scheme.weights.num_bits == 8


def test_quantization_config_parses_in_transformers() -> None:
    model = tiny_llama()
    block = quantization_config(rtn(model, SCHEMES["w4a16_g16"]), ["lm_head"])
    assert block["quant_method"] == "compressed-tensors" and block["quantization_status"] == "compressed"
    assert block["version"] and block["ignore"] == ["lm_head"]
    parsed = CompressedTensorsConfig.from_dict({"quantization_config": block}).quantization_config
    assert parsed.config_groups["group_0"].weights.group_size == 16
    with pytest.raises(ValueError, match="empty"):
        quantization_config(RunState(), [])
