"""Weight formats beyond per-tensor/channel/group int and fp8: block fp8, NVFP4, MX (pure tensor functions).

A :class:`WeightFormat` says how codes and scales look; :func:`qparams`, :func:`quantize`, :func:`dequantize`
and :func:`fake_quantize` work for every format, computing in the dtypes compressed-tensors 0.20 uses so
that the results match it bit for bit:

    strategy      scale                                  used by
    block         one per [bh, bw] tile, W's dtype        FP8_BLOCK (128 x 128)
    tensor_group  fp8 per group of 16 / a float32 global  NVFP4A16 (effective scale = scale / global)
    group, e8m0   a power of two per group of 32          MXFP4A16, MXFP4, MXFP6*, MXFP8*

Codes are int8 (int), float8_e4m3fn (fp8) or uint8 minifloat codes (fp4 / fp6, see ``seqcal.algorithms.fp4``).
Everything else (tensor / channel / group with plain scales) is ``seqcal.algorithms.quant``'s.

Example:
    >>> fmt = WeightFormat(num_bits=4, type="float", strategy="tensor_group", group_size=16, scale="fp8")
    >>> W = torch.randn(8, 32); g = nvfp4_global_scale(W.abs().amax())
    >>> scale, zp = qparams(W, fmt, global_scale=g)
    >>> fake_quantize(W, scale, zp, fmt, global_scale=g).shape
    torch.Size([8, 32])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqcal.algorithms.blocks import block_minmax, expand_block_rows, expand_blocks
from seqcal.algorithms.fp4 import (
    FP8_MAX,
    MINIFLOAT_MAX,
    decode_minifloat,
    encode_minifloat,
    group_absmax,
    mx_scales,
    nvfp4_global_scale,
    nvfp4_group_scales,
    round_fp4_,
    round_minifloat,
)
from seqcal.algorithms.quant import compute_qparams, quant_range, round_fp8

# gguf: a GGUF type's own scales; its format (seqcal.gguf.grids.GGUFFormat) brings the functions for them
SCALES = ("float", "fp8", "e8m0", "gguf")


@dataclass(frozen=True)
class WeightFormat:
    """How one weight is quantized.

    Attributes:
        num_bits: code width (int: 1..8; float: 4 = fp4 e2m1, 6 = fp6 e2m3, 8 = fp8 e4m3).
        type: ``"int"`` or ``"float"``.
        strategy: ``"tensor"``, ``"channel"``, ``"group"``, ``"block"`` or ``"tensor_group"``.
        symmetric: zero point fixed at 0 (float formats are always symmetric).
        group_size: columns per group (group / tensor_group).
        block: ``(rows, columns)`` of a block (block).
        scale: ``"float"`` (scale in W's dtype), ``"fp8"`` (NVFP4: fp8 values under a global scale) or
            ``"e8m0"`` (MX: powers of two).
    """

    num_bits: int
    type: str = "int"
    strategy: str = "group"
    symmetric: bool = True
    group_size: int | None = None
    block: tuple[int, int] | None = None
    scale: str = "float"

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise ValueError(f"WeightFormat: scale must be one of {SCALES}, got {self.scale!r}")
        if self.type == "float" and self.num_bits not in (4, 6, 8):
            raise ValueError(f"WeightFormat: float weights have 4, 6 or 8 bits, got {self.num_bits}")
        if self.type == "float" and not self.symmetric:
            raise ValueError("WeightFormat: float weights must be symmetric; set symmetric: true")
        if self.strategy in ("group", "tensor_group") and not (self.group_size and self.group_size > 0):
            raise ValueError(f"WeightFormat: strategy {self.strategy!r} needs a group_size > 0")
        if self.strategy == "block" and (self.block is None or len(self.block) != 2 or min(self.block) < 1):
            raise ValueError(f"WeightFormat: block strategy needs a block (rows, columns), got {self.block}")
        if (self.strategy == "tensor_group") != (self.scale == "fp8"):
            raise ValueError("WeightFormat: fp8 scales under a global scale go with strategy 'tensor_group'")

    @property
    def grid(self) -> str:
        """The rounding grid: ``"int"``, ``"fp8"``, ``"fp6"`` or ``"fp4"``."""
        return "int" if self.type == "int" else f"fp{self.num_bits}"

    @property
    def code_dtype(self) -> torch.dtype:
        """Storage dtype of unpacked codes."""
        return {"int": torch.int8, "fp8": torch.float8_e4m3fn}.get(self.grid, torch.uint8)

    @property
    def needs_global_scale(self) -> bool:
        return self.strategy == "tensor_group"


def grid_range(fmt: WeightFormat) -> tuple[float, float]:
    """``(qmin, qmax)`` of the format's codes."""
    if fmt.scale == "gguf":
        return float(fmt.gtype.qmin), float(fmt.gtype.qmax)  # type: ignore[attr-defined]: a GGUFFormat
    if fmt.grid in ("fp4", "fp6"):
        return -MINIFLOAT_MAX[fmt.num_bits], MINIFLOAT_MAX[fmt.num_bits]
    return quant_range(fmt.num_bits, fmt.type)  # type: ignore[arg-type]


def round_grid(x: Tensor, grid: str) -> Tensor:
    """Round values already clamped to the code range onto ``grid`` (``WeightFormat.grid``), keeping x's dtype."""
    if grid == "int":
        return torch.round(x)
    return round_minifloat(x, int(grid[2:]))


def round_grid_(x: Tensor, grid: str) -> Tensor:
    """:func:`round_grid` in place on a float32 ``x`` already clamped to the code range (returns ``x``).

    GPTQ's column loop rounds one column at a time, thousands per module: in place, the minifloat grids skip
    the copy in and the cast and copy back that each cost a dispatch per column.
    """
    if grid == "int":
        return x.round_()
    if grid == "fp4":
        return round_fp4_(x)
    if grid == "fp8":
        return round_fp8(x, out_of_place=False)
    return x.copy_(round_grid(x, grid))


def to_codes(values: Tensor, grid: str) -> Tensor:
    """Grid values -> stored codes (int8, float8_e4m3fn or uint8 minifloat codes)."""
    if grid == "int":
        return values.to(torch.int8)
    if grid == "fp8":
        return values.to(torch.float8_e4m3fn)
    return encode_minifloat(values, int(grid[2:]))


def code_values(q: Tensor, fmt: WeightFormat, dtype: torch.dtype) -> Tensor:
    """Stored codes -> their values in ``dtype``."""
    if fmt.grid in ("fp4", "fp6"):
        return decode_minifloat(q, fmt.num_bits, dtype)
    return q.to(dtype)


def _grouped_amax(W: Tensor, group_size: int) -> Tensor:
    if W.shape[-1] % group_size:
        raise ValueError(
            f"in_features {W.shape[-1]} is not divisible by group_size {group_size}; "
            "choose a divisor of in_features or ignore this module"
        )
    return group_absmax(W.unflatten(-1, (-1, group_size)))  # [out, G]


def global_scale_of(W: Tensor) -> Tensor:
    """NVFP4 global scale of one weight (float32 [1]); fused modules take the minimum over their members."""
    return nvfp4_global_scale(W.abs().amax())


def qparams(
    W: Tensor, fmt: WeightFormat, global_scale: Tensor | None = None, importance: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Min-max qparams of ``W [out, in]`` in ``fmt``, in W's dtype (compressed-tensors' ``calculate_qparams``).

    Args:
        W: the weight.
        fmt: its format.
        global_scale: float32 ``[1]`` for ``tensor_group`` (from :func:`global_scale_of`, or shared).
        importance: the inputs' E[x^2] per column: GGUF types choose their scales with it as llama.cpp does with
            an importance matrix (``seqcal.gguf.grids.qparams``); the other formats are min-max and ignore it.

    Returns:
        ``(scale, zero_point)``: scale ``[RB, CB]`` (block), ``[out, G]`` (group / tensor_group),
        ``[out, 1]`` / ``[1]`` (channel / tensor); zero point None when symmetric.

    Example:
        >>> s, z = qparams(torch.randn(4, 64), WeightFormat(8, "float", "group", group_size=32, scale="e8m0"))
        >>> s.shape, z
        (torch.Size([4, 2]), None)
    """
    if fmt.scale == "gguf":
        return fmt.grid_qparams(W, importance)  # type: ignore[attr-defined]: a seqcal.gguf.grids.GGUFFormat
    if fmt.strategy == "tensor_group":
        if global_scale is None:
            raise ValueError("qparams: tensor_group (NVFP4) needs the global scale; see global_scale_of")
        return amax_scale(_grouped_amax(W, fmt.group_size), fmt, global_scale), None
    if fmt.scale == "e8m0":
        return amax_scale(_grouped_amax(W, fmt.group_size), fmt), None
    if fmt.strategy == "block":
        lo, hi = block_minmax(W, fmt.block)
    elif fmt.strategy == "group":
        lo, hi = W.unflatten(-1, (-1, fmt.group_size)).aminmax(dim=-1)
    elif fmt.strategy == "channel":
        lo, hi = W.amin(dim=-1, keepdim=True), W.amax(dim=-1, keepdim=True)
    else:
        lo, hi = W.amin(), W.amax()
    if fmt.grid in ("fp4", "fp6"):
        amax = torch.maximum(lo.abs(), hi.abs())
        return amax_scale(amax, fmt).reshape(amax.shape or (1,)), None
    scale, zero = compute_qparams(lo, hi, num_bits=fmt.num_bits, symmetric=fmt.symmetric, type=fmt.type)  # type: ignore[arg-type]
    return scale, None if fmt.symmetric else zero


def amax_scale(amax: Tensor, fmt: WeightFormat, global_scale: Tensor | None = None) -> Tensor:
    """The scale a float format stores for groups whose largest magnitude is ``amax`` (in amax's dtype), as
    :func:`qparams` computes it: NVFP4's fp8 group scale under ``global_scale``, MX's power of two, a minifloat
    grid's ``amax / max`` (a zero scale becomes eps), fp8's ``amax / 448``.

    AutoRound's float formats (``seqcal.algorithms.autoround_formats``) compute the scale of shrunk maxima with it.

    Example:
        >>> amax_scale(torch.tensor([6.0, 0.0]), WeightFormat(4, "float", "group", group_size=32)).tolist()
        [1.0, 1.1920928955078125e-07]
    """
    if fmt.needs_global_scale:
        return nvfp4_group_scales(amax, global_scale).to(amax.dtype)
    if fmt.scale == "e8m0":
        return mx_scales(amax, fmt.num_bits)
    if fmt.grid in ("fp4", "fp6"):  # plain float scales for a minifloat grid: amax / max of the type
        scale = amax / MINIFLOAT_MAX[fmt.num_bits]
        return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    return compute_qparams(-amax, amax, num_bits=fmt.num_bits, symmetric=True, type=fmt.type)[0]  # type: ignore[arg-type]


def element_scale(
    scale: Tensor, fmt: WeightFormat, shape: tuple[int, ...] | torch.Size, global_scale: Tensor | None = None
) -> Tensor:
    """The scale of every element of a ``shape`` weight (``[out, in]``, or broadcastable for tensor/channel)."""
    if fmt.needs_global_scale:
        scale = (
            scale.to(torch.float32) / global_scale
        )  # the effective scale, float32 as in compressed-tensors
    if fmt.strategy == "block":
        return expand_blocks(scale, shape, fmt.block)
    if fmt.strategy in ("group", "tensor_group"):
        return scale.repeat_interleave(fmt.group_size, dim=-1)
    return scale


def column_qparams(
    scale: Tensor,
    zero_point: Tensor | None,
    fmt: WeightFormat,
    shape: tuple[int, int],
    global_scale: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Qparams as GPTQ's column loop reads them: ``(scale [out or 1, G], zero [same], col_group [in])``, float32.

    Column ``j`` of the weight uses ``scale[:, col_group[j]]`` (effective scales: NVFP4's divided by its global
    scale, blocks repeated over their rows).
    """
    if fmt.scale == "gguf":
        return fmt.grid_columns(scale, zero_point, shape)  # type: ignore[attr-defined]
    out, n_in = shape
    s = scale.to(torch.float32)
    if fmt.needs_global_scale:
        s = s / global_scale
    cols = torch.arange(n_in, device=scale.device)
    if fmt.strategy == "block":
        s, col_group = expand_block_rows(s, out, fmt.block[0]), cols // fmt.block[1]
    elif fmt.strategy in ("group", "tensor_group"):
        col_group = cols // fmt.group_size
    else:
        s, col_group = s.reshape(-1, 1), torch.zeros_like(cols)
    z = torch.zeros_like(s) if zero_point is None else zero_point.float().reshape(s.shape)
    if fmt.strategy == "block" and zero_point is not None:
        z = expand_block_rows(zero_point.float(), out, fmt.block[0])
    return s, z, col_group


def quantize(
    W: Tensor, scale: Tensor, zero_point: Tensor | None, fmt: WeightFormat, global_scale: Tensor | None = None
) -> Tensor:
    """Codes of ``W``: ``round(clamp(W / scale + zero_point))`` on the format's grid.

    Returns:
        ``[out, in]`` in ``fmt.code_dtype``.
    """
    if fmt.scale == "gguf":
        return fmt.grid_quantize(W, scale, zero_point)  # type: ignore[attr-defined]
    s = element_scale(scale, fmt, W.shape, global_scale)
    x = W / s
    if zero_point is not None:
        z = zero_point if fmt.strategy != "block" else expand_blocks(zero_point, W.shape, fmt.block)
        x = x + (z.repeat_interleave(fmt.group_size, dim=-1) if fmt.strategy == "group" else z).to(x.dtype)
    qmin, qmax = grid_range(fmt)
    return to_codes(round_grid(torch.clamp(x, qmin, qmax), fmt.grid), fmt.grid)


def dequantize(
    q: Tensor,
    scale: Tensor,
    zero_point: Tensor | None,
    fmt: WeightFormat,
    global_scale: Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """``(codes - zero_point) * scale`` in the (effective) scale's dtype, cast to ``dtype`` (default: scale's)."""
    if fmt.scale == "gguf":  # s * c + b in float32, as llama.cpp computes it
        return fmt.grid_dequantize(q, scale, zero_point, dtype)  # type: ignore[attr-defined]
    s = element_scale(scale, fmt, q.shape, global_scale)
    x = code_values(q, fmt, s.dtype)
    if zero_point is not None:
        z = zero_point if fmt.strategy != "block" else expand_blocks(zero_point, q.shape, fmt.block)
        x = x - (z.repeat_interleave(fmt.group_size, dim=-1) if fmt.strategy == "group" else z).to(s.dtype)
    return (x * s).to(dtype or scale.dtype)


def fake_quantize(
    W: Tensor, scale: Tensor, zero_point: Tensor | None, fmt: WeightFormat, global_scale: Tensor | None = None
) -> Tensor:
    """``dequantize(quantize(W))`` in W's dtype (codes are exact in any float dtype)."""
    q = quantize(W, scale, zero_point, fmt, global_scale)
    return dequantize(q, scale, zero_point, fmt, global_scale, dtype=W.dtype)


__all__ = [
    "FP8_MAX",
    "SCALES",
    "WeightFormat",
    "amax_scale",
    "code_values",
    "column_qparams",
    "dequantize",
    "element_scale",
    "fake_quantize",
    "global_scale_of",
    "grid_range",
    "qparams",
    "quantize",
    "round_grid",
    "round_grid_",
    "to_codes",
]
