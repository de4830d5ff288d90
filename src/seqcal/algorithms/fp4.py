"""Minifloat weights (fp4 e2m1, fp6 e2m3) and their scales, in the compressed-tensors convention (pure math).

Codes are stored one per byte (uint8) until they are packed: bit 3 (fp4) or bit 5 (fp6) is the sign, the
low bits index the magnitude in ``E2M1`` / ``E2M3``. Packing follows compressed-tensors 0.20 exactly:
two fp4 codes per byte, low nibble first (``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``); four fp6
codes in three little-endian bytes (``mxfp6-pack-quantized``).

Scales:
    NVFP4 (``tensor_group``): a float32 global scale ``448 * 6 / amax(W)`` per tensor (shared by the modules
    vLLM fuses) and fp8 e4m3 group scales ``fp8(global * amax_group / 6)``; a group's effective scale is
    ``scale / global``.
    MX (e8m0): each group's scale is a power of two, ``2 ** (floor(log2(round_pow2(amax_group))) - emax)``
    with ``emax = floor(log2(max of the element type))``, stored as the biased exponent (uint8, bias 127).

Example:
    >>> round_fp4(torch.tensor([0.2, 0.3, 2.6, 5.5, -7.0]))
    tensor([ 0.0000,  0.5000,  3.0000,  6.0000, -6.0000])
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from seqcal.algorithms.quant import round_float_grid_, round_fp8

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # fp4 magnitudes in code order
E2M3 = tuple(m / 8 for m in range(8)) + tuple((1 + m / 8) * 2**e for e in range(3) for m in range(8))
MINIFLOAT_MAX = {4: 6.0, 6: 7.5}
FP8_MAX = 448.0
# mantissa bits at which _round_pow2 rounds a group maximum up: e2m3's for fp6, e2m1's otherwise (fp8 too,
# as compressed-tensors 0.20 does)
_MANTISSA = {4: 1, 6: 3, 8: 1}
_FLOAT_LAYOUT = {torch.float32: (torch.int32, 23, 8), torch.bfloat16: (torch.int16, 7, 8), torch.float16: (torch.int16, 10, 5)}  # fmt: skip


def round_fp4(x: Tensor) -> Tensor:
    """Round to the nearest fp4 e2m1 value (ties as compressed-tensors: 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, ...).

    Args:
        x: values already divided by their scale, any float dtype.

    Returns:
        ``x`` on the e2m1 grid, saturated at +-6, same dtype.

    Example:
        >>> round_fp4(torch.tensor([0.75, 1.25, 3.5]))
        tensor([1., 1., 4.])
    """
    y = x.to(torch.float32, copy=True)
    return round_fp4_(y).to(x.dtype)


def round_fp4_(y: Tensor) -> Tensor:
    """:func:`round_fp4` in place on a float32 tensor the caller owns (returns ``y``).

    The e2m1 neighbours of ``|y|`` are 0.5 apart below 2, 1 up to 4 and 2 above (``round_float_grid_``);
    round-half-to-even on the codes takes compressed-tensors' ties (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    2.5 -> 2, 3.5 -> 4, 5 -> 4). A negative zero stays negative; it compares equal to zero.
    """
    return round_float_grid_(y, 1, 0, 2).clamp_(-MINIFLOAT_MAX[4], MINIFLOAT_MAX[4])


def round_fp6(x: Tensor) -> Tensor:
    """Round to the nearest fp6 e2m3 value, ties to even, saturating at +-7.5 (compressed-tensors' cast_to_fp6).

    Args:
        x: values already divided by their scale.

    Returns:
        ``x`` on the e2m3 grid, same dtype.

    Example:
        >>> round_fp6(torch.tensor([0.06, 2.1, 9.0]))
        tensor([0.0000, 2.0000, 7.5000])
    """
    y = x.to(torch.float32, copy=True)  # steps 0.125 below 2, 0.25 up to 4, 0.5 above
    return round_float_grid_(y, 3, 0, 2).clamp_(-MINIFLOAT_MAX[6], MINIFLOAT_MAX[6]).to(x.dtype)


def round_minifloat(x: Tensor, num_bits: int) -> Tensor:
    """Clamp to the element type's range and round: fp4 (4 bits), fp6 (6) or fp8 e4m3 (8); keeps x's dtype."""
    if num_bits == 8:
        return round_fp8(x.clamp(-FP8_MAX, FP8_MAX), out_of_place=False)  # the clamp made a new tensor
    if num_bits not in MINIFLOAT_MAX:
        raise ValueError(
            f"float weights must have 4, 6 or 8 bits (fp4 e2m1, fp6 e2m3, fp8 e4m3), got {num_bits}"
        )
    if num_bits == 4:
        return round_fp4(x)  # saturates itself
    return round_fp6(x.clamp(-MINIFLOAT_MAX[6], MINIFLOAT_MAX[6]))


def encode_minifloat(values: Tensor, num_bits: int) -> Tensor:
    """Grid values (from :func:`round_minifloat`) -> uint8 codes, sign in bit ``num_bits - 1`` (zeros positive).

    Example:
        >>> encode_minifloat(torch.tensor([0.5, -6.0]), 4)
        tensor([ 1, 15], dtype=torch.uint8)
    """
    # every grid value times 2 ** mantissa bits is an integer (0, 1, 2, 3, 4, 6, 8, 12 for fp4): one lookup
    # table from those integers to codes, cheaper than a search over the grid
    lut = _code_table(num_bits).to(values.device)
    index = values.abs().float().mul_(1 << _MANTISSA[num_bits]).to(torch.int64)  # abs() is a new tensor
    codes = lut[index]
    # a negative zero is stored as +0, as compressed-tensors stores a fake-quantized weight's zeros
    return codes.bitwise_or_((values < 0).to(torch.uint8).bitwise_left_shift_(num_bits - 1))


@functools.cache
def _code_table(num_bits: int) -> Tensor:
    """``lut[int(v * 2 ** mantissa)]`` = the code of grid magnitude ``v`` (uint8, CPU)."""
    grid = E2M1 if num_bits == 4 else E2M3
    lut = torch.zeros(int(grid[-1] * (1 << _MANTISSA[num_bits])) + 1, dtype=torch.uint8)
    for code, value in enumerate(grid):
        lut[int(value * (1 << _MANTISSA[num_bits]))] = code
    return lut


def decode_minifloat(codes: Tensor, num_bits: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """uint8 codes -> their values in ``dtype``.

    Example:
        >>> decode_minifloat(torch.tensor([1, 15], dtype=torch.uint8), 4)
        tensor([ 0.5000, -6.0000])
    """
    magnitudes = torch.tensor(E2M1 if num_bits == 4 else E2M3, dtype=torch.float32)
    table = torch.cat((magnitudes, -magnitudes)).to(device=codes.device, dtype=dtype)  # indexed by the code
    return table[codes.long()]


def pack_fp4(codes: Tensor) -> Tensor:
    """Two fp4 codes per byte, the even column in the low nibble: ``[out, in]`` -> ``[out, in // 2]`` uint8.

    Example:
        >>> pack_fp4(torch.tensor([[1, 15]], dtype=torch.uint8))
        tensor([[241]], dtype=torch.uint8)
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"fp4 packing needs an even number of columns, got {codes.shape[-1]}")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_fp4`."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def pack_fp6(codes: Tensor) -> Tensor:
    """Four fp6 codes in three little-endian bytes: ``[out, in]`` -> ``[out, 3 * in // 4]`` uint8.

    Example:
        >>> pack_fp6(torch.zeros(2, 8, dtype=torch.uint8)).shape
        torch.Size([2, 6])
    """
    if codes.shape[-1] % 4:
        raise ValueError(f"fp6 packing needs a multiple of 4 columns, got {codes.shape[-1]}")
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 4)
    word = c[..., 0] | c[..., 1] << 6 | c[..., 2] << 12 | c[..., 3] << 18
    packed = torch.stack((word, word >> 8, word >> 16), dim=-1) & 0xFF
    return packed.to(torch.uint8).flatten(-2)


def unpack_fp6(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_fp6`."""
    b = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, 3)
    word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16
    return torch.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1).flatten(-2).to(torch.uint8)


def nvfp4_global_scale(amax: Tensor) -> Tensor:
    """The NVFP4 global scale of a tensor whose largest magnitude is ``amax``: ``448 * 6 / amax`` (float32 [1]).

    Computed in ``amax``'s dtype and then cast, as compressed-tensors' ``generate_gparam`` does; an all-zero
    tensor gets 1 (no global scaling).

    Example:
        >>> nvfp4_global_scale(torch.tensor(2.0))
        tensor([1344.])
    """
    amax = torch.clamp(amax.abs(), min=torch.finfo(amax.dtype).tiny)
    scale = FP8_MAX * MINIFLOAT_MAX[4] / amax
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape(1)


def nvfp4_group_scales(amax: Tensor, global_scale: Tensor) -> Tensor:
    """fp8-representable group scales ``fp8(global * amax / 6)`` (zeros become 0.125), in float32.

    Args:
        amax: per-group largest magnitude ``[out, G]`` (W's dtype).
        global_scale: float32 ``[1]`` from :func:`nvfp4_global_scale` (shared by fused modules).

    Returns:
        ``[out, G]`` float32; the effective scale of a group is this divided by ``global_scale``.
    """
    scale = global_scale * (amax / (2 * MINIFLOAT_MAX[4] / 2))
    scale = round_fp8(scale.clamp(-FP8_MAX, FP8_MAX), out_of_place=False)  # float32, a new tensor
    return torch.where(scale == 0, torch.tensor(0.125, dtype=scale.dtype, device=scale.device), scale)


def nvfp4_fake_quantize_groups(x: Tensor, global_scale: Tensor, group_size: int = 16) -> Tensor:
    """Fake-quantize ``x [..., in]`` to NVFP4 as the runtime quantizes activations (compressed-tensors' dynamic
    ``local`` forward, vLLM's fp4 inputs): each group of ``group_size`` columns of each token gets the fp8 scale
    ``fp8(global * amax / 6)``, computed from the values themselves, with the calibrated ``global_scale``.

    Same order of rounding as compressed-tensors: the fp8 group scale is divided by the global scale in
    float32, ``x`` is divided by that, rounded to fp4 (saturating at +-6), multiplied back, and returned in
    x's dtype.

    Args:
        x: activations, last dimension a multiple of ``group_size``.
        global_scale: float32 ``[1]`` input global scale (:func:`nvfp4_global_scale` of the calibrated amax).
        group_size: columns per local scale (16 for NVFP4).

    Returns:
        ``x`` on the NVFP4 grid, same shape and dtype.

    Example:
        >>> nvfp4_fake_quantize_groups(torch.tensor([[0.1] * 15 + [6.0]]), nvfp4_global_scale(torch.tensor(6.0)))
        tensor([[0., 0., 0., 0., 0., 0., 0., 0., 0., 0., 0., 0., 0., 0., 0., 6.]])
    """
    grouped = x.unflatten(-1, (-1, group_size))
    global_scale = global_scale.to(device=x.device, dtype=torch.float32)
    scale = nvfp4_group_scales(group_absmax(grouped), global_scale)  # [..., G], fp8-valued float32
    effective = (scale / global_scale).unsqueeze(-1)
    codes = round_fp4_(grouped / effective)  # float32 (effective is), a new tensor rounded in place
    return codes.mul_(effective).flatten(-2).to(x.dtype)


def group_absmax(grouped: Tensor) -> Tensor:
    """``grouped.abs().amax(-1)`` of ``[..., G, group_size]`` by halving the groups with elementwise maxima: a
    reduction over an inner dimension of 16 runs about 1.7 times slower on the CPU. Exact (a maximum does not
    round)."""
    a = grouped.abs()
    while a.shape[-1] > 1 and a.shape[-1] % 2 == 0:
        half = a.shape[-1] // 2
        a = torch.maximum(a[..., :half], a[..., half:])
    return a.amax(dim=-1)


def _round_pow2(x: Tensor, elem_mantissa: int) -> Tensor:
    """The power of two nearest below ``x`` unless x's mantissa rounds up at ``elem_mantissa`` bits."""
    int_dtype, mantissa, exponent = _FLOAT_LAYOUT[x.dtype]
    bits = x.view(int_dtype).to(torch.int64) & ((1 << (mantissa + exponent + 1)) - 1)  # as unsigned
    add = 1 << (mantissa - elem_mantissa - 1)
    mask = ((1 << (exponent + 1)) - 1) << mantissa
    kept = (bits + add) & mask
    if int_dtype == torch.int16:
        kept = torch.where(kept >= 1 << 15, kept - (1 << 16), kept)
    return kept.to(int_dtype).view(x.dtype)


def mx_scales(amax: Tensor, num_bits: int) -> Tensor:
    """E8M0 group scales (powers of two) for MX formats, in ``amax``'s dtype (compressed-tensors' rule).

    Args:
        amax: per-group largest magnitude ``[out, G]``, float32 / bfloat16 / float16.
        num_bits: element bits: 4 (MXFP4), 6 (MXFP6) or 8 (MXFP8).

    Returns:
        ``2 ** e`` with ``e`` in ``[-127, 128]``; an all-zero group gets ``2 ** -127`` (1 if that underflows).

    Example:
        >>> mx_scales(torch.tensor([6.0, 1.0]), 4)
        tensor([1.0000, 0.2500])
    """
    top = {4: MINIFLOAT_MAX[4], 6: MINIFLOAT_MAX[6], 8: FP8_MAX}[num_bits]
    offset = int(math.floor(math.log2(top)))
    exp = 127 + torch.floor(torch.log2(_round_pow2(amax, _MANTISSA[num_bits]))) - offset
    exp = torch.round(exp.clamp(0, 255)).to(torch.uint8)  # the uint8 scale dtype's rounding
    scale = (2.0 ** (exp.to(torch.int32) - 127).to(torch.float)).to(amax.dtype)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def e8m0_encode(scale: Tensor) -> Tensor:
    """Power-of-two scales -> biased exponents (uint8), as compressed-tensors' ``compress_mx_scale``."""
    return (127 + torch.floor(torch.log2(scale)).to(torch.int32)).to(torch.uint8)


def e8m0_decode(exp: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Biased exponents (uint8) -> ``2 ** (exp - 127)`` in ``dtype``."""
    return (2.0 ** (exp.to(torch.int32) - 127).to(torch.float)).to(dtype)
