"""Quantized checkpoints read as sources: each weight dequantized exactly as transformers' own load does it.

Each test writes a tiny model in a published layout (DeepSeek-V3's FP8 blocks with float32 or ue8m0 scales,
gpt-oss's MXFP4 experts, compressed-tensors W4A16 / W8A8 / FP8 written by seqcal itself) and compares every
quantized weight seqcal reads with the model transformers loads with ``dequantize=True``, bit for bit.
AutoAWQ and GPTQ (whose transformers loaders need kernel packages) are compared with the formula on integer
codes the test packs itself.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config, Mxfp4Config

from seqcal.entrypoint import oneshot
from seqcal.modifiers import QuantizationModifier
from seqcal.sources import QuantizedCheckpoint, dequantize_weight, detect_source, fp8_bits
from seqcal.sources import fp8 as fp8_source
from seqcal.sources.detect import SourceFormat
from seqcal.sources.int_packed import IntPackedFamily
from sources_helpers import (
    quantize_fp8_block,
    save_deepseek,
    save_gpt_oss,
    save_llama,
    token_data,
    write_fp8_block,
    write_fp8_per_tensor,
    write_mxfp4,
)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_deepseek(tmp_path_factory.mktemp("deepseek") / "bf16")


def transformers_weights(path: Path, config: object) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.bfloat16)
    return {n: p.detach() for n, p in model.named_parameters()}


def fused_experts(ckpt: QuantizedCheckpoint, prefix: str, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's per-expert weights as transformers fuses them: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    read = lambda e, n: ckpt.read(f"{prefix}.{e}.{n}.weight", torch.bfloat16)  # noqa: E731
    gate_up = torch.stack([torch.cat([read(e, "gate_proj"), read(e, "up_proj")]) for e in range(experts)])
    return gate_up, torch.stack([read(e, "down_proj") for e in range(experts)])


@pytest.mark.parametrize("ue8m0, scale_dtype, by_bits", [(False, torch.float32, True), (True, torch.float32, True),
                                                         (True, torch.float8_e8m0fnu, True),
                                                         (False, torch.float32, False)])  # fmt: skip
def test_fp8_blocks_equal_transformers_dequantized_load(
    tmp_path: Path, deepseek: Path, ue8m0: bool, scale_dtype: torch.dtype, by_bits: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """From the bits (fp8_bits) and through compressed-tensors' converter (the fallback), a row of blocks at a
    time: transformers' values bit for bit."""
    monkeypatch.setattr(fp8_source, "CHUNK_ELEMENTS", 1)
    if not by_bits:
        monkeypatch.setattr(fp8_source, "exact_by_bits", lambda w, s: False)
    fp8 = write_fp8_block(deepseek, tmp_path / "fp8", ue8m0=ue8m0, scale_dtype=scale_dtype)
    ckpt = QuantizedCheckpoint.open(fp8)
    assert ckpt.source.name == ("fp8-block-ue8m0" if ue8m0 else "fp8-block")
    reference = transformers_weights(fp8, FineGrainedFP8Config(dequantize=True))
    dense = [n for n in ckpt.parts if ".experts." not in n or "shared_experts" in n]
    assert len(dense) == 16  # five MLA projections per layer, the dense MLP (3), the shared expert (3)
    for name in dense:
        assert torch.equal(ckpt.read(name, torch.bfloat16), reference[name]), name
    gate_up, down = fused_experts(ckpt, "model.layers.1.mlp.experts", 4)
    assert torch.equal(gate_up, reference["model.layers.1.mlp.experts.gate_up_proj"])
    assert torch.equal(down, reference["model.layers.1.mlp.experts.down_proj"])
    for name in ckpt.plain:  # router, norms, embeddings: as stored
        if name in reference:
            assert torch.equal(ckpt.read(name, torch.bfloat16), reference[name]), name


@pytest.mark.parametrize("chunk, by_bits", [(1, False), (fp8_source.CHUNK_ELEMENTS, False), (0, True)])
def test_fp8_partial_blocks_take_their_own_scale(
    tmp_path: Path, chunk: int, by_bits: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kv_a_proj_with_mqa of 192 rows (DeepSeek-V3's is 576): the last row block is partial, and its rows take
    the scale of block 1, not a grid divided evenly over the rows (the converter whole, or a row of blocks at a
    time, and from the bits)."""
    monkeypatch.setattr(fp8_source, "CHUNK_ELEMENTS", chunk or fp8_source.CHUNK_ELEMENTS)
    if not by_bits:
        monkeypatch.setattr(fp8_source, "exact_by_bits", lambda w, s: False)
    src = save_deepseek(tmp_path / "bf16", rope=64)
    fp8 = write_fp8_block(src, tmp_path / "fp8", shards=1)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    stored = load_file(str(fp8 / "model.safetensors"))
    w, scale = stored[name], stored[name.replace(".weight", ".weight_scale_inv")]
    assert list(w.shape) == [192, 256] and list(scale.shape) == [2, 2]
    expected = w.float() * scale.repeat_interleave(128, 0)[:192].repeat_interleave(128, 1)
    assert torch.equal(dequantize_weight(fp8, name, torch.float32), expected)
    error = (expected - load_file(str(src / "model.safetensors"))[name].float()).norm() / expected.norm()
    assert error < 0.05  # the FP8 rounding only


def test_mxfp4_experts_equal_transformers_dequantized_load(tmp_path: Path) -> None:
    mx = write_mxfp4(save_gpt_oss(tmp_path / "bf16"), tmp_path / "mx")
    ckpt = QuantizedCheckpoint.open(mx)
    reference = transformers_weights(mx, Mxfp4Config(dequantize=True))
    assert sorted(ckpt.parts) == sorted(n for n in reference if n.endswith(("gate_up_proj", "down_proj")))
    for name in ckpt.parts:
        assert torch.equal(ckpt.read(name, torch.bfloat16), reference[name]), name
        assert torch.equal(ckpt.experts(name, torch.bfloat16)[3], reference[name][3])  # one expert read alone
    for name in ckpt.plain:
        assert torch.equal(ckpt.read(name, torch.bfloat16), reference[name]), name


@pytest.mark.parametrize("scheme, name", [("W4A16", "int4-pack-quantized"), ("W8A8", "int8-int-quantized"),
                                          ("FP8_DYNAMIC", "fp8-float-quantized"), ("NVFP4", "nvfp4")])  # fmt: skip
def test_compressed_tensors_equal_their_decompression(tmp_path: Path, scheme: str, name: str) -> None:
    out = tmp_path / scheme
    data = {"pipeline": "datafree"} if scheme != "NVFP4" else {"dataset": token_data(2, 16)}  # input scales
    oneshot(model=str(save_llama(tmp_path / "bf16")), output_dir=str(out), max_seq_length=16,
            recipe=QuantizationModifier(scheme=scheme, targets=["Linear"], ignore=["lm_head"]), **data)  # fmt: skip
    ckpt = QuantizedCheckpoint.open(out)
    assert ckpt.source.name == name and len(ckpt.parts) == 14
    reference = transformers_weights(out, CompressedTensorsConfig(dequantize=True))
    for weight in ckpt.names():
        if weight in reference:
            assert torch.equal(ckpt.read(weight, torch.bfloat16), reference[weight]), weight


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values packed low bits first in int32 words along ``dim`` (the tests' own packing)."""
    per = 32 // bits
    moved = values.movedim(dim, -1).to(torch.int64)
    words = moved.reshape(*moved.shape[:-1], -1, per)
    packed = sum(words[..., i] << (bits * i) for i in range(per))
    return packed.to(torch.int64).where(packed < 2**31, packed - 2**32).to(torch.int32).movedim(-1, dim)


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_int4_is_codes_minus_zero_times_scale(tmp_path: Path, checkpoint_format: str) -> None:
    g = torch.Generator().manual_seed(0)
    inputs, outputs, group = 64, 32, 16
    q = torch.randint(0, 16, (inputs, outputs), generator=g)
    zeros = torch.randint(1, 15, (inputs // group, outputs), generator=g)
    scales = torch.rand(inputs // group, outputs, generator=g).half() / 10
    g_idx = torch.randperm(inputs, generator=g) % (inputs // group)  # desc_act: groups in any order
    stored_zeros = zeros - 1 if checkpoint_format == "gptq" else zeros
    tensors = {"m.qweight": pack_int32(q, 4, 0), "m.qzeros": pack_int32(stored_zeros, 4, 1), "m.scales": scales,
               "m.g_idx": g_idx.to(torch.int32)}  # fmt: skip
    source = SourceFormat("gptq", "gptq-int4", 4, "int", {"bits": 4, "group_size": group,
                                                          "checkpoint_format": checkpoint_format})  # fmt: skip
    family = IntPackedFamily(source)
    infos = {k: ("", tuple(t.shape)) for k, t in tensors.items()}
    assert list(family.parts(infos)) == ["m.weight"]
    expected = ((q - zeros[g_idx]).half() * scales[g_idx]).T
    assert torch.equal(family.dequantize("m.weight", tensors, torch.float16), expected)


def test_awq_int4_reads_as_compressed_tensors_converts_it(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    inputs, outputs, group = 64, 32, 16
    q = torch.randint(0, 16, (inputs, outputs), generator=g)
    zeros = torch.randint(0, 16, (inputs // group, outputs), generator=g)
    scales = torch.rand(inputs // group, outputs, generator=g).half() / 10
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's nibble order within a word
    interleave = lambda t: t.reshape(t.shape[0], -1, 8)[..., order].reshape(t.shape)  # noqa: E731
    tensors = {"m.qweight": pack_int32(interleave(q), 4, 1), "m.qzeros": pack_int32(interleave(zeros), 4, 1),
               "m.scales": scales}  # fmt: skip
    source = detect_source({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                            "version": "gemm"})  # fmt: skip
    family = IntPackedFamily(source)
    assert list(family.parts({k: ("", tuple(t.shape)) for k, t in tensors.items()})) == ["m.weight"]
    expected = ((q - zeros.repeat_interleave(group, 0)).half() * scales.repeat_interleave(group, 0)).T
    assert torch.equal(family.dequantize("m.weight", tensors, torch.float16), expected)


def test_an_fp8_weight_read_alone(tmp_path: Path, deepseek: Path) -> None:
    """The public one-weight read: only that weight's tensors, the value transformers gives."""
    fp8 = write_fp8_block(deepseek, tmp_path / "fp8")
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    w, scale = quantize_fp8_block(load_file(str(deepseek / "model.safetensors"))[name], (128, 128), False)
    expected = (w.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.bfloat16)
    assert torch.equal(dequantize_weight(fp8, name), expected)
    norm = "model.layers.1.input_layernorm.weight"
    assert dequantize_weight(fp8, norm, torch.float32).dtype == torch.float32  # stored bf16, cast


def test_fp8_per_tensor_equals_transformers_dequantized_load(tmp_path: Path) -> None:
    fp8 = write_fp8_per_tensor(save_llama(tmp_path / "bf16"), tmp_path / "fp8")
    ckpt = QuantizedCheckpoint.open(fp8)
    assert ckpt.source.name == "fp8-tensor" and len(ckpt.parts) == 14
    reference = transformers_weights(fp8, FineGrainedFP8Config(dequantize=True))
    for name in ckpt.parts:
        assert torch.equal(ckpt.read(name, torch.bfloat16), reference[name]), name


def test_fp8_from_the_bits_is_the_cast_for_every_code() -> None:
    """Every e4m3fn code (subnormals, zeros of both signs) times scales of every size, partial blocks at both edges:
    the float8 cast's product bit for bit; scales of 2^7 or more and a process that flushes subnormals
    are left to the cast; the NaN codes read as NaN."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[~codes.float().isnan()]
    g = torch.Generator().manual_seed(0)
    weight = finite[torch.randint(len(finite), (300, 200), generator=g)]
    weight[:2, :127], weight[140:142, 73:200] = finite[:127], finite[127:]  # every finite code, in two blocks
    scale = torch.rand(3, 2, generator=g) * 10.0 ** torch.randint(-12, 2, (3, 2), generator=g).float()
    scale[0, 0] = 2.0**-140  # a subnormal scale
    assert fp8_bits.exact_by_bits(weight, scale)
    expected = weight.float() * scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    for dtype in (torch.float32, torch.bfloat16):
        got = fp8_bits.blocks_times_scales(weight, scale, (128, 128), dtype)
        assert torch.equal(got.view(torch.int8), expected.to(dtype).view(torch.int8)), dtype
    nan = weight.clone()
    nan[5, 5], nan[299, 199] = codes[0x7F], codes[0xFF]
    got = fp8_bits.blocks_times_scales(nan, scale, (128, 128), torch.float32)
    cast = nan.float() * scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert torch.equal(got.isnan(), cast.isnan()) and int(got.isnan().sum()) == 2
    assert torch.equal(got.nan_to_num(), cast.nan_to_num())
    assert not fp8_bits.exact_by_bits(weight, scale * 2.0**30)
    try:
        if torch.set_flush_denormal(True):  # the CPU can flush: the subnormal codes would read as 0
            assert not fp8_bits.exact_by_bits(weight, scale)
    finally:
        torch.set_flush_denormal(False)
