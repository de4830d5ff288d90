"""Sparse checkpoints: sparsity_config, bit-exact bitmask formats, and sparse + quantized reload equality."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from save_helpers import checkpoint_tensors
from seqcal.algorithms.sparsity import follows_structure, nm_mask
from seqcal.checkpoint.sparse import bitmask_compress, read_sparse_weight, write_sparse_format
from seqcal.entrypoint import oneshot
from seqcal.modifiers import GPTQModifier, QuantizationModifier, SparseGPTModifier
from test_oneshot import probe, runtime_activations, tiny_llama, token_data

PRUNE_24 = SparseGPTModifier(sparsity=0.5, mask_structure="2:4", ignore=["re:.*lm_head"])


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bit-level comparisons (-0.0 and NaN payloads included)."""
    return t.contiguous().view(torch.uint8)


def sparse_24(dtype: torch.dtype) -> torch.Tensor:
    W = torch.randn(16, 64)
    W = W.masked_fill(nm_mask(W.abs(), 2, 4), 0)
    W[0, 0:4] = 0  # a group with more zeros than the structure asks for
    W[1, 0:4] = torch.tensor(
        [0.7, -0.0, 0.0, 0.0]
    )  # a -0.0 (a kept weight rounded to zero) survives bit for bit
    if dtype == torch.int8:
        return (W * 40).round().clamp(-128, 127).to(torch.int8)
    return W.to(dtype)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8]
)
@pytest.mark.parametrize("fmt", ["sparse-24-bitmask", "sparse-bitmask"])
def test_bitmask_formats_round_trip_bit_for_bit(dtype: torch.dtype, fmt: str) -> None:
    W = sparse_24(dtype)
    tensors = bitmask_compress(W, fmt)
    assert tensors["bitmask"].dtype == torch.uint8 and list(tensors["bitmask"].shape) == [16, 8]
    if fmt == "sparse-24-bitmask":
        assert list(tensors["compressed"].shape) == [16, 32] and list(tensors["shape"].shape) == [2, 1]
    else:
        assert tensors["compressed"].dim() == 1 and tensors["row_offsets"].shape == (16,)
    assert tensors["compressed"].dtype == dtype
    back = read_sparse_weight(tensors)
    assert back.dtype == dtype and torch.equal(bits(back), bits(W))


def test_sparse_24_refuses_a_weight_that_is_not_2_4() -> None:
    with pytest.raises(ValueError, match="not 2:4 sparse"):
        bitmask_compress(torch.ones(2, 8), "sparse-24-bitmask")


def reference(model: torch.nn.Module, out: Path) -> torch.Tensor:
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    with torch.no_grad(), runtime_activations(model, out, block):
        return model(**probe()).logits


@pytest.mark.parametrize(
    "quantizer",
    [
        None,
        GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
        QuantizationModifier(scheme="FP8_DYNAMIC", ignore=["lm_head"]),
    ],
    ids=["sparse-only", "gptq-w4a16", "fp8-dynamic"],
)
def test_sparse_checkpoint_reloads_as_the_model_in_memory(quantizer, tmp_path: Path) -> None:
    model, out = tiny_llama(), tmp_path / "ckpt"
    recipe = [PRUNE_24] if quantizer is None else [PRUNE_24, quantizer]
    oneshot(model=model, dataset=token_data(), recipe=recipe, max_seq_length=32, output_dir=str(out))
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    sparsity = config["sparsity_config"]
    assert sparsity["format"] == "dense" and sparsity["sparsity_structure"] == "2:4"
    assert len(sparsity["targets"]) == 14 and "lm_head" not in sparsity["targets"]
    linear = sum(model.get_submodule(t).weight.numel() for t in sparsity["targets"])
    total = sum(p.numel() for p in model.parameters())
    assert sparsity["global_sparsity"] == pytest.approx(0.5 * linear / total, rel=1e-6)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        got = loaded(**probe()).logits  # compressed-tensors decompresses the weights on the first forward
    for name in sparsity["targets"]:
        assert follows_structure(loaded.get_submodule(name).weight, 2, 4), name
    torch.testing.assert_close(got, reference(model, out), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quantizer", [None, QuantizationModifier(scheme="FP8_DYNAMIC", ignore=["lm_head"])])
def test_sparse_24_bitmask_checkpoint_holds_exactly_the_dense_tensors(quantizer, tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    recipe = [PRUNE_24] if quantizer is None else [PRUNE_24, quantizer]
    oneshot(model=tiny_llama(), dataset=token_data(), recipe=recipe, max_seq_length=32, output_dir=str(out))
    dense = checkpoint_tensors(out)
    assert write_sparse_format(out) == "sparse-24-bitmask"
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["sparsity_config"]["format"] == "sparse-24-bitmask"
    stored = checkpoint_tensors(out)
    targets = config["sparsity_config"]["targets"]
    for name in targets:
        assert f"{name}.weight" not in stored
        tensors = {k: stored[f"{name}.{k}"] for k in ("compressed", "bitmask", "shape")}
        assert torch.equal(bits(read_sparse_weight(tensors)), bits(dense[f"{name}.weight"])), name
    untouched = {k for k in dense if k.rpartition(".")[0] not in targets or not k.endswith(".weight")}
    assert all(torch.equal(bits(stored[k]), bits(dense[k])) for k in untouched)


def test_unstructured_checkpoint_becomes_sparse_bitmask(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    modifier = SparseGPTModifier(sparsity=0.6, ignore=["re:.*lm_head"])
    oneshot(model=tiny_llama(), dataset=token_data(), recipe=modifier, max_seq_length=32, output_dir=str(out))
    dense = checkpoint_tensors(out)
    assert write_sparse_format(out) == "sparse-bitmask"
    stored = checkpoint_tensors(out)
    name = "model.layers.1.mlp.up_proj"
    tensors = {k: stored[f"{name}.{k}"] for k in ("compressed", "bitmask", "shape", "row_offsets")}
    assert torch.equal(bits(read_sparse_weight(tensors)), bits(dense[f"{name}.weight"]))


def test_packed_int4_weights_are_refused_for_bitmask_formats(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    recipe = [PRUNE_24, GPTQModifier(scheme="W4A16", ignore=["lm_head"])]
    oneshot(model=tiny_llama(), dataset=token_data(), recipe=recipe, max_seq_length=32, output_dir=str(out))
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="pack-quantized int4 keeps its zero codes packed"):
        write_sparse_format(out)
    assert (out / "model.safetensors").read_bytes() == before  # refused before anything was rewritten
