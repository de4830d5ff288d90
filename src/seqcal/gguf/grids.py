"""GGUF grids as seqcal formats: qparams by the type's own rule, codes, and the values llama.cpp computes.

``qparams`` fixes a weight's scales the way llama.cpp's reference quantizer does (``quantize_row_*_ref``): the
legacy types from each block's extremes, the k-quants from llama.cpp's sub-block searches
(``seqcal.gguf.search``) with the sub-block scales and minimums then quantized to 4, 6 or 8 bits against the
block's fp16 ``d`` / ``dmin``; given the inputs' E[x^2], as ``llama-quantize --imatrix`` does for Q4_0, Q5_0 and
Q4_K to Q6_K (fits weighted by it). After that only the codes are free: round to nearest (``quantize``) or GPTQ, whose
column loop reads the effective per-sub-block ``s`` and ``b`` (``column_qparams``). ``dequantize`` computes
``s * c + b`` in float32 with the operations gguf-py and ggml use, so its result equals
``gguf.quants.dequantize`` of the packed blocks bit for bit (``seqcal.gguf.pack``). The layout of ``scale`` and
``zero`` is described in ``seqcal.gguf.types``.

Example:
    >>> fmt = gguf_format("Q4_K"); W = torch.randn(4, 256)
    >>> scale, zero = qparams(W, fmt)
    >>> scale.shape, zero.shape
    (torch.Size([4, 1, 9]), torch.Size([4, 1, 9]))
    >>> dequantize(quantize(W, scale, zero, fmt), scale, zero, fmt).shape
    torch.Size([4, 256])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqcal.algorithms.columns import one_intra_op_thread
from seqcal.algorithms.formats import WeightFormat
from seqcal.gguf import search
from seqcal.gguf.refit import refit_scales
from seqcal.gguf.types import GGUFType, gguf_type


@dataclass(frozen=True)
class GGUFFormat(WeightFormat):
    """A ``WeightFormat`` on a GGUF type's grid (``scale="gguf"``): int codes in groups of the type's sub-block,
    with the type's own stored scales. ``seqcal.algorithms.formats`` calls its ``grid_*`` methods for it."""

    gguf: str = "Q4_0"

    @property
    def gtype(self) -> GGUFType:
        return gguf_type(self.gguf)

    # what seqcal.algorithms.formats calls for a format with scale="gguf"
    def grid_qparams(self, W: Tensor, importance: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return qparams(W, self, importance)

    def grid_columns(self, scale: Tensor, zero: Tensor | None, shape: tuple[int, int]) -> tuple[Tensor, ...]:
        return column_qparams(scale, zero, self, shape)

    def grid_quantize(self, W: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
        return quantize(W, scale, zero, self)

    def grid_dequantize(
        self, q: Tensor, scale: Tensor, zero: Tensor | None, dtype: torch.dtype | None
    ) -> Tensor:
        return dequantize(q, scale, zero, self, dtype)

    def grid_refit(
        self, W: Tensor, q: Tensor, scale: Tensor, zero: Tensor | None, H: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """GPTQ's scales once its codes are chosen: refitted to them for Q4_0, Q5_0 and Q8_0 (one fp16 scale per
        block; ``seqcal.gguf.refit``), as they are for the types with minimums or sub-block scales."""
        t = self.gtype
        if t.sub_bits or t.has_min:
            return scale, zero
        return refit_scales(W, q, scale, H, t.block), zero


def gguf_format(name: str) -> GGUFFormat:
    """The format of GGUF type ``name`` ("Q4_K")."""
    t = gguf_type(name)
    return GGUFFormat(num_bits=t.bits, type="int", strategy="group", symmetric=not t.has_min,
                      group_size=t.sub, scale="gguf", gguf=t.name)  # fmt: skip


def _fp16(x: Tensor) -> Tensor:
    """``x`` rounded to fp16 (ggml's GGML_FP32_TO_FP16: nearest, ties to even), kept in float32."""
    return x.to(torch.float16).to(torch.float32)


def _legacy(blocks: Tensor, t: GGUFType, importance: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Q4_0 / Q5_0 / Q8_0 / Q4_1 / Q5_1 from each block's extremes ([out, nb, 32] -> [out, nb, 1]); Q4_0 and Q5_0
    with ``importance`` ([in]: the inputs' E[x^2]) as llama.cpp quantizes them with an importance matrix."""
    if importance is not None and not t.has_min and t.name != "Q8_0":
        return _fp16(_weighted_legacy(blocks, t, importance)), None
    if t.has_min:
        lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        return _fp16((hi - lo) / t.qmax), _fp16(lo)
    if t.name == "Q8_0":
        return _fp16(blocks.abs().amax(-1, keepdim=True) / 127), None
    # the signed extreme takes code qmin, the side with one more step
    index = blocks.abs().argmax(-1, keepdim=True)
    return _fp16(blocks.gather(-1, index) / t.qmin), None


def _weighted_legacy(blocks: Tensor, t: GGUFType, importance: Tensor) -> Tensor:
    """``quantize_row_q4_0_impl`` / ``q5_0``'s scale with quant weights: each block's ``make_qx_quants`` fit
    weighted by ``importance * sqrt(sigma2 + x^2)``, ``sigma2`` the row's mean square (float32, [out, nb, 1])."""
    out, nb, size = blocks.shape
    sigma2 = blocks.pow(2).sum((1, 2), keepdim=True) / (nb * size)  # the row's, over all its blocks
    weights = importance.float().reshape(1, nb, size) * (sigma2 + blocks.pow(2)).sqrt()
    with one_intra_op_thread():
        scale = search.qx(blocks.reshape(-1, size), -t.qmin, weights.reshape(-1, size))
    return scale.reshape(out, nb, 1)


# the k-quants llama-quantize fits to an importance matrix by another rule than without one (Q2_K and Q3_K: seqcal
# keeps the rule without one for them)
WEIGHTED_K = ("Q4_K", "Q5_K", "Q6_K")


def _sub_scales(x: Tensor, t: GGUFType) -> tuple[Tensor, Tensor | None]:
    """Each sub-block's scale (and minimum) as llama.cpp's reference quantizer searches it; ``x [N, sub]``."""
    if t.name in ("Q4_K", "Q5_K"):
        weights = x.pow(2).mean(1, keepdim=True).sqrt() + x.abs()
        rmin, nstep = (-1.0, 20) if t.name == "Q4_K" else (-0.5, 15)
        return search.qkx2(x, weights, t.qmax, rmin, 0.1, nstep)
    if t.name == "Q2_K":
        return search.qkx2(x, x.abs(), t.qmax, -0.5, 0.1, 15, use_mad=True)
    if t.name == "Q6_K":
        return search.qx(x, 32), None
    return search.q3(x, 4), None


def _weighted_k(W: Tensor, t: GGUFType, importance: Tensor) -> tuple[Tensor, Tensor | None]:
    """Q4_K, Q5_K and Q6_K as ``llama-quantize --imatrix`` quantizes them (``quantize_row_q*_K_impl``): Q6_K's
    sub-block scales fitted with ``importance`` as the weights; Q4_K's and Q5_K's scales and minimums with
    ``importance * sqrt(sigma2 + x^2)`` (``sigma2``: twice the block's mean square) on ``make_qkx3_quants``' steps,
    then quantized against ``d`` / ``dmin`` by a fit weighted by each sub-block's summed weights (``search.qp``)."""
    out, n = W.shape
    blocks = n // t.block
    columns = importance.float().reshape(1, blocks, t.subs, t.sub)
    x = W.reshape(out, blocks, t.subs, t.sub)
    if t.name == "Q6_K":
        scales = search.qx(x.reshape(-1, t.sub), 32, columns.expand_as(x).reshape(-1, t.sub))
        return _quantized_scales(scales.reshape(out, blocks, t.subs), t), None
    sigma2 = 2 * x.pow(2).sum((2, 3), keepdim=True) / t.block  # [out, blocks, 1, 1]
    w = columns * (sigma2 + x.pow(2)).sqrt()
    scales, mins = search.qkx2(x.reshape(-1, t.sub), w.reshape(-1, t.sub), t.qmax, -0.9, 0.05, 36)
    weight = w.sum(-1).reshape(-1, t.subs)  # each sub-block's summed weights
    top = 2**t.sub_bits - 1

    def fitted(values: Tensor) -> Tensor:
        d, ints = search.qp(values.reshape(-1, t.subs), top, weight)
        return torch.cat([_fp16(d)[:, None], ints], dim=-1).reshape(out, blocks, 1 + t.subs)

    return fitted(scales), fitted(mins)


def _quantized_scales(values: Tensor, t: GGUFType) -> Tensor:
    """Sub-block scales ``[out, nb, subs]`` -> ``[out, nb, 1 + subs]``: the block's fp16 ``d``, then the integer
    scales llama.cpp stores (``values ~ d * integer``)."""
    if t.sub_signed:  # Q3_K, Q6_K: the signed extreme takes the most negative integer
        index = values.abs().argmax(-1, keepdim=True)
        peak = values.gather(-1, index)
        top = 2 ** (t.sub_bits - 1)
        live = peak.abs() >= search.GROUP_MAX_EPS
        iscale = torch.where(live, -top / torch.where(live, peak, 1.0), torch.zeros_like(peak))
        ints = torch.round(iscale * values).clamp_(-top, top - 1)
        d = _fp16(torch.where(live, 1 / torch.where(live, iscale, 1.0), torch.zeros_like(peak)))
    else:  # Q2_K, Q4_K, Q5_K: scales and minimums are never below 0
        top = 2**t.sub_bits - 1
        peak = values.amax(-1, keepdim=True)
        inv = torch.where(peak > 0, top / torch.where(peak > 0, peak, 1.0), torch.zeros_like(peak))
        ints = torch.round(inv * values).clamp_(0, top)
        d = _fp16(peak / top)
    return torch.cat([d, ints], dim=-1)


def qparams(W: Tensor, fmt: GGUFFormat, importance: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The stored scales of ``W [out, in]`` in ``fmt``'s type, by llama.cpp's rule: with ``importance`` (the
    inputs' E[x^2] per column, what ``llama-imatrix`` collects; GPTQ passes its Hessian's diagonal, AutoRound the
    mean squares of the module's inputs), the rule ``llama-quantize --imatrix`` follows for Q4_0, Q5_0, Q4_K, Q5_K
    and Q6_K (the other types keep the rule without one).

    Returns:
        ``(scale, zero)``: float32 ``[out, in // block, 1 + subs]``; zero None for the symmetric types.
    """
    t = fmt.gtype
    W = W.float()
    out, n = W.shape
    if n % t.block:
        raise ValueError(f"{t.name} needs widths that are multiples of {t.block}, got {n}")
    blocks = n // t.block
    if not t.sub_bits:
        return _legacy(W.reshape(out, blocks, t.block), t, importance)
    # the searches are dozens of small elementwise passes: on one intra-op thread, as GPTQ's column loop, since a
    # thread hand-off per pass dominates on a busy machine (15x slower with two threads on two loaded cores)
    with one_intra_op_thread():
        if importance is not None and t.name in WEIGHTED_K:
            return _weighted_k(W, t, importance)
        scales, mins = _sub_scales(W.reshape(-1, t.sub), t)
    scale = _quantized_scales(scales.reshape(out, blocks, t.subs), t)
    zero = None if mins is None else _quantized_scales(mins.reshape(out, blocks, t.subs), t)
    return scale, zero


def effective(scale: Tensor, zero: Tensor | None, fmt: GGUFFormat) -> tuple[Tensor, Tensor | None]:
    """Per sub-block ``s`` and ``b`` ``[out, in // sub]`` in float32 (exact: products of fp16 and small ints)."""
    scale = scale.float()
    out = scale.shape[0]
    if not fmt.gtype.sub_bits:
        s, b = scale[..., 0], None if zero is None else zero.float()[..., 0]
        return s.reshape(out, -1), None if b is None else b.reshape(out, -1)
    s = (scale[..., :1] * scale[..., 1:]).reshape(out, -1)
    if zero is None:
        return s, None
    zero = zero.float()
    return s, (-(zero[..., :1] * zero[..., 1:])).reshape(out, -1)


def quantize(W: Tensor, scale: Tensor, zero: Tensor | None, fmt: GGUFFormat) -> Tensor:
    """Round-to-nearest codes ``round(clamp((W - b) / s))`` (int8 ``[out, in]``; 0 where ``s`` is 0)."""
    t = fmt.gtype
    s, b = effective(scale, zero, fmt)
    x = W.float().unflatten(-1, (-1, t.sub))  # [out, G, sub]
    if b is not None:
        x = x - b[..., None]
    live = s != 0
    x = x / torch.where(live, s, 1.0)[..., None]
    codes = torch.round(x.clamp_(t.qmin, t.qmax)) * live[..., None]
    return codes.reshape(W.shape).to(torch.int8)


def dequantize(
    q: Tensor, scale: Tensor, zero: Tensor | None, fmt: GGUFFormat, dtype: torch.dtype | None = None
) -> Tensor:
    """``s * c + b`` in float32, as gguf-py and ggml compute it, cast to ``dtype`` (default float32)."""
    s, b = effective(scale, zero, fmt)
    x = s[..., None] * q.float().unflatten(-1, (-1, fmt.gtype.sub))
    if b is not None:
        x = x + b[..., None]
    return x.reshape(q.shape).to(dtype or torch.float32)


def column_qparams(
    scale: Tensor, zero: Tensor | None, fmt: GGUFFormat, shape: tuple[int, int]
) -> tuple[Tensor, Tensor, Tensor]:
    """Qparams as GPTQ's column loop reads them, ``c = round(clamp(w / s + z))``, ``(c - z) * s``: float32
    ``(s [out, G], z [out, G], col_group [in])`` with ``z = -b / s``.

    The loop's dequantized values are then within a rounding of ``s * c + b``; the solver takes its final
    weight from the codes with :func:`dequantize`. A sub-block whose ``s`` is 0 (every weight is ``b``) gets a
    tiny stand-in scale, so that its error ``w - b`` is still spread.
    """
    s, b = effective(scale, zero, fmt)
    s = torch.where(s == 0, torch.full_like(s, 2.0**-100), s)
    z = torch.zeros_like(s) if b is None else -b / s
    return s, z, torch.arange(shape[1], device=scale.device) // fmt.gtype.sub
