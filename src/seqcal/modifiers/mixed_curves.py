"""What each candidate scheme would cost a module, as the mixed-precision allocation reads it: the module's weight
rounded to nearest under every candidate (with the candidate's own range search, as the solver will round it), and
the error that adds to the module's output over the calibration inputs, from their Hessian or their E[x^2].

One curve per module, ``[(error, size)]`` per candidate: the allocation (``mixed_allocator``) holds these curves,
never the Hessians they were measured from.

Example:
    >>> curve = error_curve(W, schemes, H, None, round_to_nearest.rounded)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from compressed_tensors.quantization import QuantizationScheme

from seqcal.algorithms.observe import importance_from_hessian
from seqcal.algorithms.output_error import OutputError
from seqcal.modifiers.importance import unusable, uses_importance

# module name -> (its inputs' Hessian [in, in], or None; their E[x^2] [in], or None)
InputsOf = Callable[[str], tuple[torch.Tensor | None, torch.Tensor | None]]
# a weight rounded to nearest under a scheme with the scheme's observer (``round_to_nearest.rounded``), given the
# inputs' E[x^2] for imatrix_mse
Rounding = Callable[[torch.Tensor, QuantizationScheme, torch.Tensor | None], torch.Tensor]


def error_curve(W: torch.Tensor, schemes: list[QuantizationScheme], H: torch.Tensor | None,
                diag: torch.Tensor | None, rounded: Rounding,
                bits: list[float] | None = None) -> list[tuple[float, float]]:  # fmt: skip
    """The output error of ``W`` rounded to nearest under each of ``schemes`` and the output's size
    (``output_errors``): ``(inf, 1)`` for a candidate that cannot hold ``W`` or that its unit cannot take (``bits``
    ``inf``, not measured), zeros when no input reached it."""
    out = []
    for i, scheme in enumerate(schemes):
        if bits is not None and math.isinf(bits[i]):
            out.append((math.inf, 1.0))
            continue
        if H is None and diag is None:
            out.append((0.0, 0.0))
            continue
        try:
            Q = rounded(W, scheme, curve_importance(scheme, H, diag, W.shape[1]))
        except (ValueError, RuntimeError):  # a width this candidate cannot hold: its bits are inf already
            out.append((math.inf, 1.0))
            continue
        out.append(output_errors(W, Q, H, diag))
    return out


def output_errors(
    W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor | None, diag: torch.Tensor | None
) -> tuple[float, float]:
    """``(||(Q - W) X^T||^2, ||W X^T||^2)`` per calibration token, from the inputs' Hessian ``H``
    (``OutputError``: ``H`` is ``2/n X^T X``) or, without it, their ``E[x^2]`` ``diag`` (its diagonal, halved)."""
    if H is not None:
        error = OutputError(H)
        for r in range(0, W.shape[0], 256):
            error.add(W[r : r + 256], Q[r : r + 256])
        return error.num.item() / 2, error.den.item() / 2
    d = diag.to(device=W.device, dtype=torch.float32)  # type: ignore[union-attr]
    return ((Q.float() - W.float()).pow(2) * d).sum().item(), (W.float().pow(2) * d).sum().item()


def curve_importance(
    scheme: QuantizationScheme, H: torch.Tensor | None, diag: torch.Tensor | None, in_features: int
) -> torch.Tensor | None:
    """The inputs' E[x^2] for a candidate whose observer weighs the range search by it (imatrix_mse); None where
    the solve would search uniformly (``usable_importance``: the tensor strategy, or statistics it cannot use), so
    the curve predicts the search the solve makes. The solve logs that fallback (or refuses it, when strict)."""
    if not uses_importance(scheme):
        return None
    importance = diag if diag is not None else importance_from_hessian(H)  # type: ignore[arg-type]
    return None if unusable(scheme, importance, in_features) else importance


def relative(num: float, den: float) -> float:
    """The relative error ``sqrt(num / den)`` of an ``(error, size)`` pair (0 for an output of size 0)."""
    return math.sqrt(max(num, 0.0) / den) if den > 0 else 0.0
