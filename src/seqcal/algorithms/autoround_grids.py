"""AutoRound's learned rounding on a grid whose scales the format fixes first: GGUF's types (``scale="gguf"``).

A GGUF type's scales are llama.cpp's own (its quantizer's rule, ``seqcal.gguf.grids``), computed once from the
weight and, where given, the inputs' E[x^2] (``llama-quantize --imatrix``'s rule); what is left free is the codes. So, unlike the int and float formats
(``seqcal.algorithms.autoround``, ``seqcal.algorithms.autoround_formats``), only the rounding offsets are learned:

- ``V [out, in]`` in [-0.5, 0.5], added before rounding: ``c = round(clamp((W - b) / s + V))`` with each
  sub-block's ``s`` and ``b``;

by the same signed steps. There are no range factors: shrinking a sub-block's range would change the scales
llama.cpp stores, which the type computes by its own rule (as GPTQ, AutoRound chooses codes on the type's scales).
The forward value is the weight llama.cpp computes from the codes, ``s * c + b`` in float32 (``formats.dequantize``),
exactly; its gradient in ``V`` is ``s`` where the code is inside the type's range (straight-through rounding).
``V = 0`` is the type's round to nearest (``formats.quantize``) bit for bit.

Example:
    >>> from seqcal.gguf.grids import gguf_format
    >>> fmt = gguf_format("Q4_K"); W = torch.randn(4, 256)
    >>> gq = GridQuantizer.of(W, fmt); p = gq.start()
    >>> q, scale, zero = gq.codes(p)
    >>> torch.equal(formats.dequantize(q, scale, zero, fmt, dtype=torch.float32), gq(p).detach())
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqcal.algorithms import formats
from seqcal.algorithms.autoround import RoundingParams
from seqcal.algorithms.formats import WeightFormat

__all__ = ["GridQuantizer"]


@dataclass
class GridQuantizer:
    """The learned fake quantization of one weight on a fixed-scale grid (see the module docstring).

    Attributes:
        W: the weight ``[out, in]``, float32.
        fmt: its format (``scale="gguf"``).
        scale, zero: the format's stored qparams of ``W`` (``formats.qparams``), fixed.
        step: ``[out, in]`` float32, each weight's ``s`` (a sub-block whose ``s`` is 0 gets a tiny stand-in, as GPTQ's
            column loop, so that its offsets still divide).
        shifted: ``[out, in]`` float32, ``(W - b) / s``: the value the offsets are added to.
    """

    W: Tensor
    fmt: WeightFormat
    scale: Tensor
    zero: Tensor | None
    step: Tensor
    shifted: Tensor

    @classmethod
    def of(cls, W: Tensor, fmt: WeightFormat, importance: Tensor | None = None) -> GridQuantizer:
        """The quantizer of ``W [out, in]`` on ``fmt``'s grid, its scales fixed by the format's rule, weighted by
        ``importance`` (``[in]``, the inputs' E[x^2]) where the type's rule takes one."""
        if fmt.scale != "gguf":
            raise ValueError(
                f"GridQuantizer: learns the codes of formats with fixed scales (GGUF), not {fmt}"
            )
        W = W.detach().float()
        scale, zero = formats.qparams(W, fmt, importance=importance)
        s, z, col_group = formats.column_qparams(scale, zero, fmt, tuple(W.shape), None)  # [out, G] each
        step, offset = s[:, col_group], z[:, col_group]  # [out, in]
        return cls(W, fmt, scale, zero, step, W / step + offset)

    def start(self) -> RoundingParams:
        """Round to nearest (``V = 0``), with gradients on ``V`` only (``alpha`` and ``beta`` are unused)."""
        V = torch.zeros(self.W.shape, dtype=torch.float32, device=self.W.device)
        ones = torch.ones(self.W.shape[0], 1, dtype=torch.float32, device=self.W.device)
        return RoundingParams(V.requires_grad_(), ones, ones.clone())

    def _codes(self, V: Tensor) -> Tensor:
        """The codes with offsets ``V``: the format's own rounding of ``W + V s`` (exactly round to nearest at 0)."""
        return formats.quantize(self.W + V * self.step, self.scale, self.zero, self.fmt)

    def __call__(self, p: RoundingParams, dtype: torch.dtype | None = None) -> Tensor:
        """``W`` fake-quantized with ``p``, ``[out, in]`` in ``dtype`` (default float32), differentiable in ``V``:
        the value is llama.cpp's ``s * c + b``, the gradient ``s`` where the code is inside the type's range."""
        V = p.V
        with torch.no_grad():
            exact = formats.dequantize(self._codes(V.detach()), self.scale, self.zero, self.fmt)
            qmin, qmax = formats.grid_range(self.fmt)
            t = (self.shifted + V.detach()).round_()
            inside = (t >= qmin) & (t <= qmax)
        # the value is exact (V - V is 0); the product carries the straight-through gradient
        out = exact + self.step * inside * (V - V.detach())
        return out.to(dtype or torch.float32)

    def codes(self, p: RoundingParams) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(codes int8 [out, in], scale, zero)`` with the learned offsets, as the format stores them:
        ``formats.dequantize`` of them equals this quantizer's output."""
        with torch.no_grad():
            return self._codes(p.V.detach()), self.scale, self.zero
