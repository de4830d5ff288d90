"""Quantization primitives in the compressed-tensors convention (pure tensor functions).

Notation: ``W`` is a weight ``[out, in]``; ``q`` its integer (or fp8) codes. Scale and zero-point
shapes follow compressed-tensors per strategy:

    tensor  -> [1]
    channel -> [out, 1]
    group   -> [out, in // group_size]

Integer codes are signed, ``[-2^(b-1), 2^(b-1) - 1]`` (int4: ``[-8, 7]``), stored as int8; zero points
are int8 codes in the same range (all zeros when symmetric). ``quantize`` computes
``clamp(round_half_even(W / scale + zero_point))`` in W's dtype, and ``dequantize`` computes
``(q - zero_point) * scale`` in the scale's dtype, exactly as compressed-tensors 0.20 does, so the
results match it bit for bit. FP8 (``type="float"``, ``num_bits=8``) rounds by casting to
``torch.float8_e4m3fn`` after clamping to +-448. Packing codes into int32 words lives in
``seqcal.algorithms.packing`` (``pack_int32`` and ``unpack_int32`` are re-exported here).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from seqcal.algorithms.packing import pack_int32 as pack_int32
from seqcal.algorithms.packing import unpack_int32 as unpack_int32

QuantType = Literal["int", "float"]
Strategy = Literal["tensor", "channel", "group"]
STRATEGIES: tuple[str, ...] = ("tensor", "channel", "group")
FP8_DTYPE = torch.float8_e4m3fn


def quant_range(num_bits: int, type: QuantType = "int") -> tuple[float, float]:
    """Return the representable code range ``(qmin, qmax)``.

    Args:
        num_bits: bits per code; 1..8 for ``"int"``, 8 for ``"float"`` (fp8 e4m3).
        type: ``"int"`` (signed integer codes) or ``"float"`` (fp8 e4m3fn).

    Returns:
        ``(qmin, qmax)`` as Python floats.

    Example:
        >>> quant_range(4)
        (-8.0, 7.0)
    """
    if type == "int":
        if not 1 <= num_bits <= 8:
            raise ValueError(f"quant_range: int num_bits must be in 1..8, got {num_bits}; use 4 or 8")
        return float(-(2 ** (num_bits - 1))), float(2 ** (num_bits - 1) - 1)
    if type == "float":
        if num_bits != 8:
            raise ValueError(
                f"quant_range: float quantization supports num_bits=8 (fp8 e4m3), got {num_bits}"
            )
        info = torch.finfo(FP8_DTYPE)
        return float(info.min), float(info.max)
    raise ValueError(f"quant_range: type must be 'int' or 'float', got {type!r}")


def code_dtype(type: QuantType) -> torch.dtype:
    """Storage dtype of codes and zero points: int8 for ``"int"``, float8_e4m3fn for ``"float"``."""
    return FP8_DTYPE if type == "float" else torch.int8


def compute_qparams(
    w_min: Tensor,
    w_max: Tensor,
    *,
    num_bits: int,
    symmetric: bool,
    type: QuantType = "int",
    eps: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Scale and zero point from observed ranges (compressed-tensors ``calculate_qparams``).

    The range is first widened to include 0 so that 0 is exactly representable. Symmetric:
    ``scale = max(|min|, |max|) / ((qmax - qmin) / 2)``, zero point 0. Asymmetric:
    ``scale = (max - min) / (qmax - qmin)``, ``zero_point = round(clamp(qmin - min / scale))``.
    A zero scale (all-zero group) becomes ``eps``; its zero point is 0.

    Args:
        w_min: minima, any shape (the qparams shape); its dtype is the compute dtype.
        w_max: maxima, same shape as ``w_min``.
        num_bits: code width.
        symmetric: zero point fixed at 0 when True.
        type: ``"int"`` or ``"float"`` (fp8; symmetric only).
        eps: replacement for zero scales; default ``torch.finfo(scale.dtype).eps`` like compressed-tensors.

    Returns:
        ``(scale, zero_point)``: scale in ``w_min``'s dtype, zero point in ``code_dtype(type)``;
        0-dim inputs give shape ``[1]``.

    Example:
        >>> s, z = compute_qparams(torch.tensor([-1.0]), torch.tensor([3.0]), num_bits=4, symmetric=True)
        >>> s
        tensor([0.4000])
    """
    qmin, qmax = quant_range(num_bits, type)
    zeros = torch.zeros_like(w_min)
    w_min = torch.minimum(w_min, zeros)  # 0 must be representable: padding and ReLU outputs are exact
    w_max = torch.maximum(w_max, zeros)
    # same operand order and dtype as compressed-tensors, so the roundings are identical
    bit_range = torch.tensor(qmax - qmin, dtype=w_max.dtype, device=w_max.device)
    if symmetric:
        scale = torch.maximum(w_min.abs(), w_max.abs()) / (bit_range / 2)
        zero = torch.zeros_like(scale)
    else:
        if type == "float":
            raise ValueError("compute_qparams: fp8 quantization must be symmetric; set symmetric=True")
        scale = (w_max - w_min) / bit_range
        zero = torch.clamp(qmin - w_min / scale, qmin, qmax)
        # all-zero group: 0 / 0 is NaN; compressed-tensors' NaN -> int8 cast gives 0 on x86, we make it explicit
        zero = torch.where(scale == 0, zeros, zero)
    eps = torch.finfo(scale.dtype).eps if eps is None else eps
    scale = torch.where(scale == 0, torch.tensor(eps, dtype=scale.dtype, device=scale.device), scale)
    zero_point = zero.to(FP8_DTYPE) if type == "float" else torch.round(zero).to(torch.int8)
    if scale.ndim == 0:
        scale, zero_point = scale.reshape(1), zero_point.reshape(1)
    return scale, zero_point


def _grouped(W: Tensor, group_size: int | None) -> Tensor:
    """View ``W [..., in]`` as ``[..., in // group_size, group_size]``."""
    if group_size is None or group_size <= 0:
        raise ValueError(f"group strategy needs group_size > 0, got {group_size}")
    if W.shape[-1] % group_size != 0:
        raise ValueError(
            f"in_features {W.shape[-1]} is not divisible by group_size {group_size}; "
            "choose a divisor of in_features or ignore this module"
        )
    return W.unflatten(-1, (W.shape[-1] // group_size, group_size))


def _as_rows(W: Tensor, strategy: Strategy, group_size: int | None) -> Tensor:
    """Rows that share one qparam: tensor -> [1, numel], channel -> [out, in], group -> [out * G, gs]."""
    if strategy == "tensor":
        return W.reshape(1, -1)
    if strategy == "channel":
        return W.reshape(-1, W.shape[-1])
    if strategy == "group":
        return _grouped(W, group_size).reshape(-1, group_size)
    raise ValueError(f"unknown strategy {strategy!r}; valid: {STRATEGIES}")


def _qparams_shape(W: Tensor, strategy: Strategy, group_size: int | None) -> tuple[int, ...]:
    if strategy == "tensor":
        return ()
    if strategy == "channel":
        return (*W.shape[:-1], 1)
    return (*W.shape[:-1], W.shape[-1] // group_size)


def _broadcastable(
    W: Tensor, p: Tensor, group_size: int | None, g_idx: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Return ``(W', p')`` that broadcast elementwise: ``W'`` is ``W`` or its grouped view."""
    if g_idx is not None:
        if g_idx.shape != (W.shape[-1],):
            raise ValueError(
                f"g_idx must have shape [{W.shape[-1]}] (one group per column), got {tuple(g_idx.shape)}"
            )
        return W, p[..., g_idx.long()]  # [out, in]: each column takes its group's qparam
    if group_size is not None:
        return _grouped(W, group_size), p.unsqueeze(-1)  # [out, G, gs] with [out, G, 1]
    if p.numel() > 1 and p.shape[-1] != 1:
        raise ValueError(
            f"qparams of shape {tuple(p.shape)} are per group; pass group_size (or g_idx) to apply them"
        )
    return W, p


def round_float_grid_(y: Tensor, mantissa_bits: int, min_exponent: int, max_exponent: int) -> Tensor:
    """Round a float32 ``y`` in place to a minifloat grid, ties to even, without saturating (returns ``y``).

    The grid's values at ``|y|`` are ``step = 2 ** (clamp(floor(log2 |y|), min_exponent, max_exponent) -
    mantissa_bits)`` apart (below ``2 ** min_exponent``: the subnormal step). The power of two comes from
    ``y``'s exponent bits, and dividing by a power of two and multiplying back are exact, so ``round(y / step)
    * step`` is the nearest grid value, the cast's tie included. A negative zero stays negative.

    Why not a cast or comparisons: on the CPU the round trip through float8 takes twice as long as these
    in-place passes, and a chain of ``torch.where`` over fp4's boundaries seven times as long; activations
    pay it on every Linear input of every batch, GPTQ on every column.

    Args:
        y: float32, owned by the caller.
        mantissa_bits, min_exponent, max_exponent: the grid (e4m3: 3, -6, 8; e2m1: 1, 0, 2; e2m3: 3, 0, 2).
    """
    power = (y.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2 ** floor(log2 |y|), 0 for 0
    step = power.clamp_(2.0**min_exponent, 2.0**max_exponent).mul_(2.0**-mantissa_bits)
    return y.div_(step).round_().mul_(step)


def round_fp8(x: Tensor, *, out_of_place: bool = True) -> Tensor:
    """Round to the nearest fp8 e4m3 value, ties to even: ``x.to(float8_e4m3fn).to(x.dtype)``, bit for bit
    (:func:`round_float_grid_`, twice as fast on the CPU).

    ``x`` must already lie within +-448 (the callers clamp to the code range first): a larger value would
    round past the largest fp8 value instead of saturating.

    Args:
        x: any float dtype.
        out_of_place: False to round a float32 ``x`` the caller owns in place (other dtypes are copied).

    Returns:
        ``x`` on the fp8 grid, in x's dtype.

    Example:
        >>> round_fp8(torch.tensor([0.3, 17.0, -447.0])).tolist()
        [0.3125, 16.0, -448.0]
    """
    y = x if (x.dtype == torch.float32 and not out_of_place) else x.to(torch.float32, copy=True)
    round_float_grid_(y, 3, -6, 8)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _round_codes_(x: Tensor, num_bits: int, type: QuantType) -> Tensor:
    """Clamp ``x`` (the caller's own temporary) to the code range and round it (half to even, or to fp8), in
    place: no temporary of the weight's size per step."""
    qmin, qmax = quant_range(num_bits, type)
    x.clamp_(qmin, qmax)
    return round_fp8(x, out_of_place=False) if type == "float" else x.round_()


def quantize(
    W: Tensor,
    scale: Tensor,
    zero_point: Tensor | None = None,
    *,
    num_bits: int,
    type: QuantType = "int",
    group_size: int | None = None,
    g_idx: Tensor | None = None,
) -> Tensor:
    """Quantize ``W`` to codes: ``clamp(round(W / scale + zero_point))``, computed in W's dtype.

    Args:
        W: weight ``[out, in]`` (or activations ``[..., in]`` with broadcastable qparams).
        scale: ``[1]``, ``[out, 1]`` or ``[out, G]``.
        zero_point: same shape as ``scale``; None means symmetric (0).
        num_bits, type: the code format.
        group_size: set for group qparams ``[out, G]`` with contiguous groups.
        g_idx: ``[in]`` group of each column (activation-ordered groups); overrides ``group_size``.

    Returns:
        Codes shaped like ``W``: int8 for ``"int"``, float8_e4m3fn for ``"float"``.

    Example:
        >>> W = torch.randn(4, 64); s, z = compute_qparams(W.amin(1, True), W.amax(1, True), num_bits=4, symmetric=True)
        >>> quantize(W, s, z, num_bits=4).dtype
        torch.int8
    """
    Wb, s = _broadcastable(W, scale, group_size, g_idx)
    x = Wb / s  # a new tensor, then rounded in place
    if zero_point is not None:
        x += _broadcastable(W, zero_point, group_size, g_idx)[1].to(W.dtype)
    return _round_codes_(x, num_bits, type).to(code_dtype(type)).reshape(W.shape)


def dequantize(
    q: Tensor,
    scale: Tensor,
    zero_point: Tensor | None = None,
    *,
    group_size: int | None = None,
    g_idx: Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Dequantize codes: ``(q - zero_point) * scale``, computed in the scale's dtype.

    Args:
        q: codes ``[out, in]`` (int8 or fp8).
        scale, zero_point, group_size, g_idx: as in :func:`quantize`.
        dtype: output dtype; default the scale's dtype.

    Returns:
        Float tensor shaped like ``q``.

    Example:
        >>> dequantize(torch.tensor([[3, -8]], dtype=torch.int8), torch.tensor([[0.5]]))
        tensor([[ 1.5000, -4.0000]])
    """
    qb, s = _broadcastable(q, scale, group_size, g_idx)
    x = qb.to(scale.dtype)
    if zero_point is not None:
        x = x - _broadcastable(q, zero_point, group_size, g_idx)[1].to(scale.dtype)
    return (x * s).reshape(q.shape).to(dtype or scale.dtype)


def fake_quantize(
    W: Tensor,
    scale: Tensor,
    zero_point: Tensor | None = None,
    *,
    num_bits: int,
    type: QuantType = "int",
    group_size: int | None = None,
    g_idx: Tensor | None = None,
) -> Tensor:
    """Quantize then dequantize (``dequantize(quantize(W))``), returned in W's dtype.

    Args:
        W, scale, zero_point, num_bits, type, group_size, g_idx: as in :func:`quantize`.

    Returns:
        ``W`` rounded to the quantization grid, same shape and dtype.

    Example:
        >>> W = torch.tensor([[0.1, -0.52, 1.0]])  # scale 1 / 7.5; 1.0 -> code 7.5 is clamped to 7
        >>> s, z = compute_qparams(W.amin(1, True), W.amax(1, True), num_bits=4, symmetric=True)
        >>> fake_quantize(W, s, z, num_bits=4)
        tensor([[ 0.1333, -0.5333,  0.9333]])
    """
    q = quantize(W, scale, zero_point, num_bits=num_bits, type=type, group_size=group_size, g_idx=g_idx)
    # codes are exact in any float dtype, so this equals compressed-tensors' fused version bit for bit
    return dequantize(q, scale, zero_point, group_size=group_size, g_idx=g_idx, dtype=W.dtype)


def fake_quantize_per_token(
    x: Tensor, *, num_bits: int = 8, symmetric: bool = True, type: QuantType = "int"
) -> Tensor:
    """Dynamic per-token activation fake-quant (W8A8 inputs): one scale per row of ``x [..., hidden]``.

    Matches compressed-tensors' dynamic ``strategy="token"`` for 3-D ``[batch, seq, hidden]``
    inputs; 2-D ``[tokens, hidden]`` inputs are also per token here (compressed-tensors falls back to
    one scale per tensor for 2-D inputs).

    Args:
        x: activations ``[..., hidden]``.
        num_bits, symmetric, type: the format (int8 symmetric or fp8 in practice).

    Returns:
        Fake-quantized activations, same shape and dtype as ``x``.

    Example:
        >>> y = fake_quantize_per_token(torch.randn(2, 5, 16))
    """
    x_min = x.amin(dim=-1, keepdim=True)  # [..., 1]
    x_max = x.amax(dim=-1, keepdim=True)
    scale, zero = compute_qparams(x_min, x_max, num_bits=num_bits, symmetric=symmetric, type=type)
    return fake_quantize(x, scale, zero, num_bits=num_bits, type=type)
