"""A calibrating modifier written outside seqcal: round-to-nearest with clipping weighted by the inputs.

Each group of weights is clipped at the ratio of its range whose rounding error, weighted per input column by
the calibration inputs' mean square E[x_j^2] (the diagonal of the Hessian X^T X / n), is smallest. The modifier
declares that statistic; seqcal gathers it in every cut, reduces it across processes and resumes it.

Run it from a recipe by import path (this directory on PYTHONPATH):
    PYTHONPATH=examples seqcal oneshot --model default --recipe examples/importance_clip.yaml --output-dir out/ic
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seqcal.algorithms import compute_qparams, dequantize, quantize
from seqcal.modifiers import Gather, QuantizationModifier, QuantizedWeight


def clipped_scales(
    W: torch.Tensor, d: torch.Tensor, bits: int, group: int, ratios: list[float]
) -> torch.Tensor:
    """Symmetric scales [out, in // group], each group's range clipped by the ratio with the least error
    ``sum_j d_j (w_j - Q(w)_j)^2``; W [out, in], d [in]."""
    Wg = W.float().reshape(W.shape[0], -1, group)  # [out, groups, group]
    absmax, dg = Wg.abs().amax(-1, keepdim=True), d.reshape(1, -1, group)
    best, best_err = None, None
    for ratio in ratios:
        scale, _ = compute_qparams(-ratio * absmax, ratio * absmax, num_bits=bits, symmetric=True)
        q = (Wg / scale).round().clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        err = ((q * scale - Wg) ** 2 * dg).sum(-1, keepdim=True)  # [out, groups, 1]
        better = err < best_err if best_err is not None else torch.ones_like(err, dtype=torch.bool)
        best = scale if best is None else torch.where(better, scale, best)
        best_err = err if best_err is None else torch.where(better, err, best_err)
    return best.squeeze(-1)


@dataclass
class ImportanceClipModifier(QuantizationModifier):
    """QuantizationModifier's arguments (symmetric int group scheme), plus ``grid``: clipping ratios tried."""

    grid: int = 20
    # the statistics seqcal gathers from each quantized Linear's inputs (padding dropped), then sums over all data
    gathers = (Gather("sq", lambda x: x.pow(2).sum(0)), Gather("tokens", lambda x: x.new_tensor([len(x)])))
    needs_calibration = True

    def validate(self, model) -> None:
        super().validate(model)
        if bad := [
            n for n, s in self.modules.items() if s.weights.strategy != "group" or not s.weights.symmetric
        ]:
            raise ValueError(f"{self.name}: {bad[0]} needs a symmetric int group scheme (strategy: group)")

    def compress(self, subgraph, model, state) -> bool:
        names = [n for n in self.modules_in(subgraph) if n not in state.results.quantized]
        for name in names:
            module, args = model.get_submodule(name), self.modules[name].weights
            stats = self.gathered(name)
            d = stats["sq"] / stats["tokens"]  # E[x_j^2] per input column
            ratios = torch.linspace(0.6, 1.0, self.grid).tolist()
            W = module.weight.data
            scale = clipped_scales(W, d, args.num_bits, args.group_size, ratios).to(W.dtype)
            q = quantize(W, scale, num_bits=args.num_bits, group_size=args.group_size)
            module.weight.data = dequantize(q, scale, group_size=args.group_size, dtype=W.dtype)
            state.results.quantized[name] = QuantizedWeight(q=q, scale=scale, zero_point=None, g_idx=None,
                                                    scheme=self.modules[name])  # fmt: skip
        return bool(names)
