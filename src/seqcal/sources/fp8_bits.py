"""FP8 (e4m3fn) weights times their block scales, from the bits: the values of ``fp8.to(float32) * scale``.

Why by hand: torch converts float8 to float32 one element at a time (about 6 ns per weight on one core), which
made the conversion most of a model-free run's time on an FP8 checkpoint; compressed-tensors' converter
(``FP8BlockDequantizer``) and transformers' dequantization both go through that cast. The bits of an e4m3fn value
``s eeee mmm``, moved into a float32's sign and its exponent and mantissa's top bits (``int8 << 20``, masked), are
the float32 ``2^-120`` times the fp8 value, exactly, for every finite code (the subnormal codes become float32
subnormals, also exact). Multiplying by ``2^120 * scale`` (exact: a power of two) then rounds once to the same
float32 as ``value * scale``. About seven times faster than the cast on one core, with the same bits
(``tests/test_sources.py`` checks every code, partial blocks and transformers' own dequantization).

The NaN codes (``0x7F``, ``0xFF``) would read as 480: a chunk of rows holding one sets them to NaN. The trick is
not taken where it would not be exact: a scale of ``2^7`` or more (``2^120`` times it could overflow) or not finite,
or a process that flushes subnormals to zero (``torch.set_flush_denormal(True)``); :func:`exact_by_bits` says so
and the caller casts as before.

Example:
    >>> w = torch.randn(256, 256).to(torch.float8_e4m3fn); s = torch.rand(2, 2)
    >>> bool(exact_by_bits(w, s))
    True
    >>> torch.equal(blocks_times_scales(w, s, (128, 128), torch.float32),
    ...             w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1))
    True
"""

from __future__ import annotations

import torch
from torch import Tensor

# sign bit, the 4 exponent and 3 mantissa bits of an e4m3fn code after ``int8 -> int32 << 20`` (as int32)
_MASK = 0x87F00000 - (1 << 32)
_SHIFT = 20
_UNBIAS = 2.0**120  # float32 exponent bias 127 less e4m3's 7
_NAN_BITS = 0x7F  # e4m3fn's only non-finite codes: 0x7F and 0xFF
_LARGEST_SCALE = 2.0**7  # below this, 2^120 * scale is a finite float32
_ROWS = 128  # rows converted at once: each pass's int32 scratch stays small (128 x 7168: 3.7 MB)


def exact_by_bits(weight: Tensor, scale: Tensor) -> bool:
    """Whether :func:`blocks_times_scales` gives the cast's exact values for ``weight`` (float8_e4m3fn, on the
    CPU) and its float32 ``scale``: scales finite and below ``2^7``, subnormals kept by this process."""
    if weight.dtype != torch.float8_e4m3fn or weight.device.type != "cpu":
        return False
    if not bool((scale.abs() < _LARGEST_SCALE).all()):  # False for NaN too
        return False
    probe = torch.tensor([1 << _SHIFT], dtype=torch.int32).view(torch.float32) * _UNBIAS  # code 0x01: 2^-9
    return bool(probe[0] == 2.0**-9)


def blocks_times_scales(
    weight: Tensor, scale: Tensor, block: tuple[int, int], dtype: torch.dtype, out: Tensor | None = None
) -> Tensor:
    """``weight [rows, cols]`` (e4m3fn) times its block's float32 scale (``scale [ceil(rows / b0), ceil(cols /
    b1)]``; partial blocks at the edges have their own), cast to ``dtype`` (into ``out`` when given); only where
    :func:`exact_by_bits`."""
    rows, cols = weight.shape
    out = torch.empty(rows, cols, dtype=dtype) if out is None else out
    factors = scale.to(torch.float32) * _UNBIAS
    codes = weight.view(torch.int8)
    for r0 in range(0, rows, _ROWS):
        r1 = min(rows, r0 + _ROWS)
        chunk = codes[r0:r1]
        bits = chunk.to(torch.int32).bitwise_left_shift_(_SHIFT).bitwise_and_(_MASK)
        first, last = r0 // block[0], (r1 - 1) // block[0]
        if first == last:  # one block row: its scales, each repeated over its block's columns
            factor = factors[first].repeat_interleave(block[1])[:cols][None, :]
        else:
            factor = factors[torch.arange(r0, r1) // block[0]].repeat_interleave(block[1], dim=1)[:, :cols]
        values = bits.view(torch.float32).mul_(factor)
        nan = chunk.view(torch.uint8).bitwise_and(_NAN_BITS) == _NAN_BITS
        if bool(nan.any()):
            values[nan] = torch.nan
        out[r0:r1] = values
    return out
