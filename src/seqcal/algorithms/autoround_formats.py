"""AutoRound's learned rounding for the float and scaled weight formats: fp8 (per tensor, channel or group), NVFP4
(fp4 under fp8 group scales and a float32 global scale) and MX (fp4, fp6 or fp8 under power-of-two group scales).

The int formats are ``seqcal.algorithms.autoround``'s. Here each of a weight's groups (the format's: ``group_size``
columns, one row per channel, the whole weight per tensor) learns

- ``V [out, in]`` in [-0.5, 0.5], added to ``W / s`` before it is rounded onto the format's grid;
- ``beta [rows, G]`` in [0, 1], which shrinks the group's largest magnitude before the format computes the scale
  from it (NVFP4's fp8 rounding under the global scale, MX's power of two). Float formats are symmetric: there is
  no ``alpha``.

by the same signed steps as the int weights. The grid's rounding and the scale's own rounding have straight-through
gradients. ``V = 0, beta = 1`` is the format's round to nearest (``formats.qparams`` and ``formats.quantize``) bit
for bit, and :meth:`FormatQuantizer.codes` gives codes and scales as round to nearest stores them. auto-round learns
NVFP4 and MX weights the same way (an offset before the fp4 cast, a factor on each group's maximum).

Example:
    >>> fmt = WeightFormat(4, "float", "tensor_group", group_size=16, scale="fp8")
    >>> W = torch.randn(8, 32); g = formats.global_scale_of(W)
    >>> fq = FormatQuantizer.of(W, fmt, g); p = fq.start()
    >>> q, scale = fq.codes(p)
    >>> torch.equal(formats.dequantize(q, scale, None, fmt, g, dtype=W.dtype), fq(p).detach())
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqcal.algorithms import formats
from seqcal.algorithms.autoround import RoundingParams
from seqcal.algorithms.formats import WeightFormat
from seqcal.algorithms.fp4 import group_absmax

__all__ = ["FormatQuantizer"]


def _grouped(W: Tensor, fmt: WeightFormat) -> Tensor:
    """``W [out, in]`` as ``[rows, G, g]``: the format's groups along the last dimension."""
    if fmt.strategy in ("group", "tensor_group"):
        return W.unflatten(-1, (-1, fmt.group_size))
    if fmt.strategy == "channel":
        return W.unsqueeze(1)
    return W.reshape(1, 1, -1)  # tensor


@dataclass
class FormatQuantizer:
    """The learned fake quantization of one weight in a float or scaled format (see the module docstring).

    Attributes:
        W: the weight ``[out, in]`` in its own dtype.
        fmt: its format (any strategy but ``block``; float grids are symmetric).
        global_scale: float32 ``[1]`` NVFP4 global scale (shared by a fused group), else None.
        amax: ``[rows, G]`` each group's largest magnitude, W's dtype.
    """

    W: Tensor
    fmt: WeightFormat
    global_scale: Tensor | None
    amax: Tensor

    @classmethod
    def of(cls, W: Tensor, fmt: WeightFormat, global_scale: Tensor | None = None) -> FormatQuantizer:
        if fmt.strategy == "block" or fmt.type != "float" or not fmt.symmetric:
            raise ValueError(
                f"FormatQuantizer: learns float formats in groups, channels or tensors, not {fmt}"
            )
        if fmt.needs_global_scale and global_scale is None:
            raise ValueError(
                "FormatQuantizer: NVFP4 needs the weight's global scale (formats.global_scale_of)"
            )
        W = W.detach()
        return cls(W, fmt, global_scale, group_absmax(_grouped(W, fmt)))

    def start(self) -> RoundingParams:
        """Round to nearest (``V = 0``, ``beta = 1``), with gradients on; ``alpha`` is unused (no gradient)."""
        V = torch.zeros(self.W.shape, dtype=torch.float32, device=self.W.device)
        ones = torch.ones(self.amax.shape, dtype=torch.float32, device=self.W.device)
        return RoundingParams(V.requires_grad_(), ones.clone(), ones.requires_grad_())

    def _shrunk(self, beta: Tensor) -> tuple[Tensor, Tensor]:
        """``(a, scale)``: the groups' maxima shrunk by ``beta`` (float32, differentiable) and the scale the format
        stores for them (``formats.amax_scale``, W's dtype)."""
        a = self.amax.float() * beta.clamp(0, 1)
        return a, formats.amax_scale(a.detach().to(self.W.dtype), self.fmt, self.global_scale)

    def _scale(self, beta: Tensor) -> Tensor:
        """``[rows, G]`` float32: the stored scale of the shrunk maxima, differentiable in ``beta`` through the
        scale before its rounding (straight-through)."""
        a, exact = self._shrunk(beta)
        smooth = (
            a / formats.grid_range(self.fmt)[1] * (self.global_scale if self.fmt.needs_global_scale else 1.0)
        )
        return smooth + (exact.float() - smooth).detach()

    def _divisor(self, scale: Tensor) -> Tensor:
        """What ``formats.quantize`` divides W by, per group ``[rows, G, 1]``: NVFP4's effective scale in float32,
        the others' scale in W's dtype."""
        if self.fmt.needs_global_scale:
            return (scale / self.global_scale).unsqueeze(-1)
        return scale.to(self.W.dtype).unsqueeze(-1)

    def _grid_values(self, p: RoundingParams, scale: Tensor) -> tuple[Tensor, Tensor]:
        """``(x, s)``: ``W / s + V`` clamped to the code range (float32 ``[rows, G, g]``) and the divisor ``s``."""
        s = self._divisor(scale)
        qmin, qmax = formats.grid_range(self.fmt)
        x = (_grouped(self.W, self.fmt) / s).float() + _grouped(p.V, self.fmt)
        return x.clamp(qmin, qmax), s

    def __call__(self, p: RoundingParams, dtype: torch.dtype | None = None) -> Tensor:
        """``W`` fake-quantized with ``p``, ``[out, in]`` in ``dtype`` (default W's), differentiable in ``p``."""
        x, s = self._grid_values(p, self._scale(p.beta))
        on_grid = formats.round_grid(x.detach(), self.fmt.grid)
        q = x + (on_grid - x).detach()  # straight-through rounding
        return (q * s.float()).reshape(self.W.shape).to(dtype or self.W.dtype)

    def codes(self, p: RoundingParams) -> tuple[Tensor, Tensor]:
        """``(codes [out, in], scale)`` with the learned values, as ``formats.quantize`` / ``formats.qparams``
        store them: ``formats.dequantize`` of them equals this quantizer's output."""
        with torch.no_grad():
            # the format's own scale (W's dtype), not the search's float32 straight-through sum that equals it
            _, scale = self._shrunk(p.beta)
            x, _ = self._grid_values(p, scale.float())
            q = formats.to_codes(formats.round_grid(x, self.fmt.grid), self.fmt.grid).reshape(self.W.shape)
        return q, scale.reshape(1) if self.fmt.strategy == "tensor" else scale
