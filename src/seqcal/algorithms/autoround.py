"""AutoRound (Cheng et al., 2024, "Optimize Weight Rounding via Signed Gradient Descent"): learned rounding.

For a weight ``W [out, in]`` quantized in groups of ``g`` columns (``g = in``: per channel), AutoRound learns

- ``V [out, in]`` in [-0.5, 0.5], added before rounding: ``q = clamp(round(W / s + V) + z)``;
- ``alpha, beta [out, G]`` in [0, 1], which shrink each group's range: ``min' = alpha min``, ``max' = beta max``,
  from which the scale ``s`` (and the zero point ``z``, asymmetric) follow as for round to nearest,

by signed gradient descent (``p -= lr_t sign(dL/dp)``, ``lr_t`` decayed linearly to 0) on the error of a block's
output against its full-precision output. ``V = 0, alpha = beta = 1`` is round to nearest with min-max ranges;
rounding has a straight-through gradient. Asymmetric scales follow the compressed-tensors convention
(``seqcal.algorithms.quant.compute_qparams``). Symmetric ones use the whole code range, as auto-round (and
llama.cpp) do: the group's wider side maps exactly onto the lowest code, ``s = m / 2^(bits-1)`` with ``m`` the
signed extreme (``|min'|`` when it is the wider side, else ``-max'``, so the scale is negative then), and all
``2^bits`` codes are in use (compressed-tensors' round to nearest, ``max|w| / 7.5`` at 4 bits, clamps its top
code away). The codes and signed scales go into a checkpoint as they are: ``(q - z) s`` reads them, and
llm-compressor's AutoRoundModifier writes the same signed scales.

The search around these pieces (its loss, learning rate, batches of rows and the kernels of its
differentiable re-runs) is in ``seqcal.algorithms.search_steps``.

Example:
    >>> from seqcal.algorithms.quant import dequantize, quantize
    >>> W = torch.randn(8, 64)
    >>> p = RoundingParams.start(W, group_size=32)
    >>> Wq = learned_fake_quantize(W, p, num_bits=4, symmetric=True, group_size=32)
    >>> s, z = learned_qparams(W, p.alpha, p.beta, num_bits=4, symmetric=True, group_size=32)
    >>> torch.equal(Wq, dequantize(quantize(W, s, num_bits=4, group_size=32), s, group_size=32))
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from seqcal.algorithms.quant import quant_range, quantize

__all__ = [
    "LearnedQuantizer",
    "RoundingParams",
    "learned_codes",
    "learned_fake_quantize",
    "learned_qparams",
    "sign_step_",
]


@dataclass
class RoundingParams:
    """The learned values of one weight: ``V [out, in]``, ``alpha`` and ``beta [out, G]`` (float32 leaves)."""

    V: Tensor
    alpha: Tensor
    beta: Tensor

    @classmethod
    def start(cls, W: Tensor, group_size: int | None) -> RoundingParams:
        """Round to nearest with min-max ranges (``V = 0``, ``alpha = beta = 1``), with gradients on.

        Args:
            W: weight ``[out, in]``.
            group_size: columns per group; None: one group per row (channel).
        """
        groups = 1 if group_size is None else W.shape[-1] // group_size
        ones = torch.ones(W.shape[0], groups, dtype=torch.float32, device=W.device)
        V = torch.zeros(W.shape, dtype=torch.float32, device=W.device)
        return cls(V.requires_grad_(), ones.clone().requires_grad_(), ones.requires_grad_())

    def tensors(self) -> list[Tensor]:
        return [self.V, self.alpha, self.beta]

    def detached(self) -> RoundingParams:
        """A copy without gradients (the best iterate so far)."""
        return RoundingParams(*(t.detach().clone() for t in self.tensors()))


def _round_ste(x: Tensor) -> Tensor:
    """``round(x)`` with the identity's gradient (straight-through)."""
    return x + (x.round() - x).detach()


def _groups(W: Tensor, group_size: int | None) -> Tensor:
    """``W [out, in]`` as ``[out, G, g]`` (``G = 1`` per channel)."""
    return W.unsqueeze(1) if group_size is None else W.unflatten(-1, (W.shape[-1] // group_size, group_size))


def learned_qparams(
    W: Tensor, alpha: Tensor, beta: Tensor, *, num_bits: int, symmetric: bool, group_size: int | None
) -> tuple[Tensor, Tensor | None]:
    """Scale and (asymmetric) zero point of each group from its range shrunk by ``alpha`` / ``beta``.

    Args:
        W: weight ``[out, in]``.
        alpha, beta: ``[out, G]`` factors of each group's minimum and maximum (clamped to [0, 1]).
        num_bits, symmetric, group_size: the int format (``group_size`` None: per channel).

    Returns:
        ``(scale [out, G], zero_point [out, G] or None)`` in W's dtype, differentiable in ``alpha`` / ``beta``;
        the zero point is rounded (straight-through) and clamped to the code range.
    """
    qmin, qmax = quant_range(num_bits)
    Wg = _groups(W, group_size)  # [out, G, g]
    w_min = Wg.amin(-1).clamp(max=0) * alpha.clamp(0, 1).to(W.dtype)  # 0 stays representable
    w_max = Wg.amax(-1).clamp(min=0) * beta.clamp(0, 1).to(W.dtype)
    if symmetric:  # the whole range: the wider side onto qmin, the scale signed
        scale = torch.where(-w_min > w_max, -w_min, -w_max) / -qmin
    else:
        scale = (w_max - w_min) / (qmax - qmin)
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)  # an all-zero group
    if symmetric:
        return scale, None
    return scale, _round_ste(qmin - w_min / scale).clamp(qmin, qmax)


def learned_fake_quantize(
    W: Tensor, p: RoundingParams, *, num_bits: int, symmetric: bool, group_size: int | None
) -> Tensor:
    """``W`` quantized with the learned rounding and ranges and dequantized, differentiable in ``p``.

    Returns:
        ``[out, in]`` in W's dtype: ``(clamp(round(W / s + V) + z) - z) s``.
    """
    qmin, qmax = quant_range(num_bits)
    scale, zero = learned_qparams(
        W, p.alpha, p.beta, num_bits=num_bits, symmetric=symmetric, group_size=group_size
    )
    s = scale.unsqueeze(-1)  # [out, G, 1]
    z = 0 if zero is None else zero.unsqueeze(-1)
    x = _groups(W, group_size) / s + _groups(p.V.to(W.dtype), group_size)
    q = (_round_ste(x) + z).clamp(qmin, qmax)
    return ((q - z) * s).reshape(W.shape)


@dataclass
class LearnedQuantizer:
    """:func:`learned_fake_quantize` of one weight as a single autograd Function (straight-through rounding, the
    gradients of ``V``, ``alpha`` and ``beta`` written out), with the weight's group minima and maxima computed
    once: the search calls it every step, and the elementwise graph autograd would record costs more than the
    layer's products on a CPU. Its values and gradients are those of :func:`learned_fake_quantize`.

    Example:
        >>> W = torch.randn(8, 64); p = RoundingParams.start(W, 32)
        >>> fq = LearnedQuantizer.of(W, num_bits=4, symmetric=True, group_size=32)
        >>> torch.equal(fq(p), learned_fake_quantize(W, p, num_bits=4, symmetric=True, group_size=32))
        True
    """

    Wg: Tensor  # [out, G, g] float32
    w_min: Tensor  # [out, G] group minima clamped to <= 0
    w_max: Tensor  # [out, G] group maxima clamped to >= 0
    num_bits: int
    symmetric: bool

    @classmethod
    def of(cls, W: Tensor, *, num_bits: int, symmetric: bool, group_size: int | None) -> LearnedQuantizer:
        """The quantizer of ``W [out, in]`` in groups of ``group_size`` columns (None: per channel)."""
        Wg = _groups(W.detach().float(), group_size)
        return cls(Wg, Wg.amin(-1).clamp(max=0), Wg.amax(-1).clamp(min=0), num_bits, symmetric)

    def start(self) -> RoundingParams:
        """Round to nearest with min-max ranges, with gradients on (:meth:`RoundingParams.start`)."""
        return RoundingParams.start(self.Wg.flatten(1), self.Wg.shape[-1])

    def __call__(self, p: RoundingParams, dtype: torch.dtype | None = None) -> Tensor:
        """``W`` fake-quantized with ``p``, ``[out, in]`` in ``dtype`` (default float32), differentiable in ``p``."""
        return _LearnedFakeQuantize.apply(self, p.V, p.alpha, p.beta, dtype or torch.float32)

    def qparams(self, alpha: Tensor, beta: Tensor) -> dict[str, Any]:
        """The shrunk ranges ``lo``, ``hi``, the scale before (``raw``) and after the zero guard (``s``) and the
        zero point before its clamp (``z``, None when symmetric), all ``[out, G]``, as :func:`learned_qparams`."""
        qmin, qmax = quant_range(self.num_bits)
        lo, hi = self.w_min * alpha.clamp(0, 1), self.w_max * beta.clamp(0, 1)
        if self.symmetric:  # the whole range: the wider side onto qmin, the scale signed
            raw = torch.where(-lo > hi, -lo, -hi) / -qmin
        else:
            raw = (hi - lo) / (qmax - qmin)
        s = torch.where(raw == 0, torch.finfo(raw.dtype).eps, raw)
        z = None if self.symmetric else (qmin - lo / s).round()
        return {"lo": lo, "hi": hi, "raw": raw, "s": s, "z": z, "qmin": qmin, "qmax": qmax}


class _LearnedFakeQuantize(torch.autograd.Function):
    """``(clamp(round(W / s + V) + z) - z) s`` with the scale ``s`` and zero point ``z`` from the shrunk ranges; the
    backward pass reads the int8 codes and the clamp's mask kept by the forward pass."""

    @staticmethod
    def forward(
        ctx: Any, fq: LearnedQuantizer, V: Tensor, alpha: Tensor, beta: Tensor, dtype: torch.dtype
    ) -> Tensor:
        v = fq.qparams(alpha, beta)
        qmin, qmax, s, z = v["qmin"], v["qmax"], v["s"].unsqueeze(-1), v["z"]
        t = torch.addcdiv(_groups(V, fq.Wg.shape[-1]), fq.Wg, s).round_()  # round(W / s + V)  [out, G, g]
        if z is not None:
            t += z.clamp(qmin, qmax).unsqueeze(-1)
        q = t.clamp(qmin, qmax)
        inside = q == t  # where the clamp passes the gradient
        if z is not None:
            q -= z.clamp(qmin, qmax).unsqueeze(-1)
        ctx.fq, ctx.v = fq, v
        ctx.save_for_backward(q.to(torch.int16), inside, alpha, beta)
        return (q * s).flatten(1).to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        fq, v = ctx.fq, ctx.v
        q, inside, alpha, beta = ctx.saved_tensors  # q: the codes minus the zero point
        qmin, qmax, s, lo = v["qmin"], v["qmax"], v["s"], v["lo"]
        go = _groups(grad.float(), fq.Wg.shape[-1])  # [out, G, g]
        gV = go * s.unsqueeze(-1) * inside  # d/dV = s (straight-through rounding)
        # d/ds of (q - z) s with the codes' argument W / s + V: (q - z) - inside W / s
        gs = torch.linalg.vecdot(go, q.to(go.dtype)) - torch.linalg.vecdot(gV, fq.Wg) / s**2  # [out, G]
        if fq.symmetric:  # raw = lo / qmin where |lo| is the wider side, else hi / qmin (a tie: hi's)
            g_raw = gs * (v["raw"] != 0) / qmin
            wider_lo = -lo > v["hi"]
            g_lo, g_hi = g_raw * wider_lo, g_raw * ~wider_lo
        else:  # d/dz = s (inside - 1); z = clamp(round(qmin - lo / s)): straight-through, then the clamp's mask
            gz = (gV.sum(-1) - s * go.sum(-1)) * ((v["z"] >= qmin) & (v["z"] <= qmax))
            g_raw = (gs + gz * lo / s**2) * (v["raw"] != 0) / (qmax - qmin)
            g_lo, g_hi = -gz / s - g_raw, g_raw
        g_alpha = g_lo * fq.w_min * ((alpha >= 0) & (alpha <= 1))
        g_beta = g_hi * fq.w_max * ((beta >= 0) & (beta <= 1))
        return None, gV.flatten(1), g_alpha, g_beta, None


def learned_codes(
    W: Tensor, p: RoundingParams, *, num_bits: int, symmetric: bool, group_size: int | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The codes, scales and zero points of ``W`` with the learned values (what the checkpoint stores).

    Returns:
        ``(q int8 [out, in], scale [out, G], zero_point int8 [out, G] or None)``; ``dequantize`` of them equals
        :func:`learned_fake_quantize`.
    """
    with torch.no_grad():
        scale, zero = learned_qparams(
            W, p.alpha, p.beta, num_bits=num_bits, symmetric=symmetric, group_size=group_size
        )
        zp = None if zero is None else zero.to(torch.int8)
        # round(W / s + V) + z == round((W + V s) / s + z): seqcal's quantize adds the zero point before rounding
        shifted = W + (_groups(p.V.to(W.dtype), group_size) * scale.unsqueeze(-1)).reshape(W.shape)
        gs = W.shape[-1] if group_size is None else group_size
        q = quantize(shifted, scale, zp, num_bits=num_bits, group_size=gs)
    return q, scale, zp


def sign_step_(p: RoundingParams, lr: float) -> None:
    """One signed gradient step on ``p`` (in place), then its ranges clamped; gradients cleared.

    Example:
        >>> p = RoundingParams.start(torch.ones(1, 4), None)
        >>> p.V.grad = torch.tensor([[1.0, -1.0, 0.0, 2.0]]); p.alpha.grad = p.beta.grad = torch.ones(1, 1)
        >>> sign_step_(p, 0.25); p.V
        tensor([[-0.2500,  0.2500,  0.0000, -0.2500]], requires_grad=True)
    """
    with torch.no_grad():
        for t, (lo, hi) in zip(p.tensors(), ((-0.5, 0.5), (0.0, 1.0), (0.0, 1.0)), strict=True):
            if t.grad is not None:
                t.sub_(lr * t.grad.sign()).clamp_(lo, hi)
                t.grad = None
