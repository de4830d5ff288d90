"""Block fp8, NVFP4 and MX weight formats (seqcal.algorithms.formats): bit-exact parity with compressed-tensors,
packing, padding, and GPTQ in every format."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.mxfp6.helpers import pack_fp6_to_uint8, unpack_fp6_from_uint8
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA, FP6_E2M3_DATA
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

from seqcal.algorithms import accumulate_hessian, formats, gptq_quantize, relative_output_error
from seqcal.algorithms.blocks import block_minmax
from seqcal.algorithms.fp4 import (
    encode_minifloat,
    pack_fp4,
    pack_fp6,
    round_fp4,
    round_fp6,
    unpack_fp4,
    unpack_fp6,
)
from seqcal.algorithms.quant import round_fp8
from seqcal.modifiers.formats import weight_format

PRESETS = ["FP8_BLOCK", "NVFP4A16", "MXFP4A16", "MXFP6A16", "MXFP8A16"]


def _fmt(preset: str) -> formats.WeightFormat:
    fmt = weight_format(preset_name_to_scheme(preset, ["Linear"]))
    assert fmt is not None
    return fmt


def _weight(dtype: torch.dtype, out: int = 200, inp: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    W = torch.randn(out, inp, generator=g) * torch.rand(out, 1, generator=g) * 3  # rows of different ranges
    W[0, :32] = 0  # an all-zero group / block part exercises the zero-scale path
    return W.to(dtype)


def _ct_minmax(W: torch.Tensor, fmt: formats.WeightFormat) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt.strategy == "block":
        return block_minmax(W, fmt.block)
    grouped = W.unflatten(-1, (-1, fmt.group_size))
    return grouped.amin(-1), grouped.amax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("preset", PRESETS)
def test_qparams_and_fake_quantize_match_compressed_tensors(preset: str, dtype: torch.dtype) -> None:
    fmt, args = _fmt(preset), preset_name_to_scheme(preset, ["Linear"]).weights
    W = _weight(
        dtype
    )  # 200 rows: FP8_BLOCK's last row of blocks is partial (padded as compressed-tensors does)
    g = None
    if fmt.needs_global_scale:
        g = generate_gparam(W.min(), W.max())
        assert torch.equal(formats.global_scale_of(W), g)
    scale, zero_point = formats.qparams(W, fmt, g)
    ct_scale, ct_zero = calculate_qparams(*_ct_minmax(W, fmt), args, global_scale=g)
    assert zero_point is None
    assert torch.equal(scale, ct_scale.to(dtype)), (scale.float() - ct_scale.float()).abs().max()
    ours = formats.fake_quantize(W, scale, None, fmt, g)
    theirs = ct_fake_quantize(W, ct_scale.to(dtype), ct_zero if fmt.strategy == "block" else None, args, g)
    assert ours.dtype == W.dtype and torch.equal(ours, theirs.to(dtype))
    q = formats.quantize(W, scale, None, fmt, g)
    assert q.dtype == fmt.code_dtype and torch.equal(
        formats.dequantize(q, scale, None, fmt, g, dtype=dtype), ours
    )


def test_block_scales_cover_partial_blocks() -> None:
    fmt = _fmt("FP8_BLOCK")
    W = _weight(torch.float32, out=130, inp=200)  # neither side a multiple of 128
    scale, _ = formats.qparams(W, fmt)
    assert scale.shape == (2, 2)
    torch.testing.assert_close(
        scale[1, 1], W[128:, 128:].abs().max() / 448
    )  # the last block: real elements only
    assert (formats.fake_quantize(W, scale, None, fmt) - W).abs().max() < W.abs().max() / 16


def test_fp8_rounding_equals_the_cast() -> None:
    sweep = torch.cat([torch.linspace(-448, 448, 400_001), torch.linspace(-0.05, 0.05, 400_001),
                       torch.tensor([0.0, -0.0, 1e-40, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 448.0, -448.0])])  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = sweep.to(dtype)
        assert torch.equal(round_fp8(x), x.to(torch.float8_e4m3fn).to(dtype)), dtype
    owned = sweep.clone()
    assert round_fp8(owned, out_of_place=False) is owned  # rounded in place
    assert torch.equal(owned, sweep.to(torch.float8_e4m3fn).float())


def test_minifloat_rounding_and_packing_match_compressed_tensors() -> None:
    x = torch.cat([torch.arange(-8, 8, 0.0625), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0])])
    assert torch.equal(round_fp4(x), FP4_E2M1_DATA.cast_to_fp4(x.clamp(-6, 6)))  # ties included
    for dtype in (torch.bfloat16, torch.float16):  # rounded in float32, returned in the input's dtype
        assert torch.equal(round_fp4(x.to(dtype)), FP4_E2M1_DATA.cast_to_fp4(x.clamp(-6, 6)).to(dtype))
    edges = torch.tensor([float("inf"), -float("inf"), 1e30, 6.5, 1e-40, 0.2500001, 0.2499999])
    assert torch.equal(round_fp4(edges), torch.tensor([6.0, -6.0, 6.0, 6.0, 0.0, 0.5, 0.0]))
    assert torch.equal(round_fp6(x.clamp(-7.5, 7.5)), FP6_E2M3_DATA.cast_to_fp6(x.clamp(-7.5, 7.5)))
    v4 = round_fp4(torch.randn(6, 32) * 3)
    v6 = round_fp6((torch.randn(6, 32) * 3).clamp(-7.5, 7.5))
    packed4 = pack_fp4(encode_minifloat(v4, 4))
    assert (
        torch.signbit(v4) & (v4 == 0)
    ).any()  # negative zeros are stored as +0 (as in a fake-quantized weight)
    assert torch.equal(packed4, pack_fp4_to_uint8(v4 + 0.0))
    assert torch.equal(unpack_fp4_from_uint8(packed4, 6, 32, torch.float32), v4)
    assert torch.equal(unpack_fp4(packed4), encode_minifloat(v4, 4))
    packed6 = pack_fp6(encode_minifloat(v6, 6))
    assert torch.equal(packed6, pack_fp6_to_uint8(v6 + 0.0))
    assert torch.equal(unpack_fp6_from_uint8(packed6, 6, 32, torch.float32), v6)
    assert torch.equal(unpack_fp6(packed6), encode_minifloat(v6, 6))


@pytest.mark.parametrize("preset", PRESETS)
def test_gptq_in_every_format_beats_round_to_nearest(preset: str) -> None:
    fmt = _fmt(preset)
    g = torch.Generator().manual_seed(1)
    W = torch.randn(256, 256, generator=g)
    X = torch.randn(2048, 256, generator=g) @ (torch.eye(256) + 0.3 * torch.randn(256, 256, generator=g))
    H, _ = accumulate_hessian(None, X, 0)
    gs = formats.global_scale_of(W) if fmt.needs_global_scale else None
    result = gptq_quantize(W, H, fmt=fmt, global_scale=gs, actorder="weight", block_size=64)
    assert result.q.dtype == fmt.code_dtype
    # the solved weight is exactly what its codes and scales dequantize to
    assert torch.equal(formats.dequantize(result.q, result.scale, None, fmt, gs, dtype=W.dtype), result.Q)
    rtn_scale, _ = formats.qparams(W, fmt, gs)
    assert torch.equal(
        result.scale, rtn_scale
    )  # qparams fixed before the solve, from the weight (no dead inputs)
    rtn = formats.fake_quantize(W, rtn_scale, None, fmt, gs)
    assert relative_output_error(W, result.Q, H) < 0.9 * relative_output_error(W, rtn, H)


def test_gptq_nvfp4_keeps_each_stacked_modules_global_scale() -> None:
    fmt = _fmt("NVFP4A16")
    g = torch.Generator().manual_seed(2)
    W1, W2 = torch.randn(32, 64, generator=g), 5 * torch.randn(32, 64, generator=g)
    H, _ = accumulate_hessian(None, torch.randn(512, 64, generator=g), 0)
    g1, g2 = formats.global_scale_of(W1), formats.global_scale_of(W2)
    rows = torch.cat([g1.expand(32), g2.expand(32)]).reshape(-1, 1)
    stacked = gptq_quantize(torch.cat([W1, W2]), H, fmt=fmt, global_scale=rows)
    alone = gptq_quantize(W2, H, fmt=fmt, global_scale=g2)
    assert torch.equal(stacked.Q[32:], alone.Q) and torch.equal(stacked.scale[32:], alone.scale)
