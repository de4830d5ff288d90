"""Automatic mixed precision: each module's scheme chosen in the sequential pass under a size budget.

``MixedPrecisionModifier`` is GPTQ whose per-module scheme is chosen from ``candidates`` so that the
quantized modules meet ``average_bits`` (stored bits per weight, scales and zero points counted) or the whole
checkpoint meets ``max_size``. ``GPTQModifier``, ``AWQModifier`` (widths chosen before it smooths),
``AutoRoundModifier`` (both with min-max curves, the ranges their searches round with) and ``QuantizationModifier``
(round to nearest) take the same choice as their ``mixed_precision`` argument: ``{average_bits: 3.0,
candidates: [...], pin: {...}}``.

How it chooses. The bits every candidate costs every module are known before the run (from the shapes,
``mixed_schemes.stored_bits``). When the pass reaches a group of modules, each candidate's error is measured on the
group's own calibration inputs, which the solver holds already: the relative output error
``||(Q_c - W) X^T||^2 / ||W X^T||^2`` of the weight rounded to nearest under candidate ``c`` (with its observer),
from GPTQ's Hessian ``X^T X`` (round to nearest: from the inputs' ``E[x^2]``, the Hessian's diagonal); no extra
pass runs and only the group's curve (one number per candidate) is kept. The modules a serving engine fuses (q/k/v,
gate/up, an MoE layer's experts) form one unit with one scheme; the error of a unit is the sum of its modules'
relative errors weighted by their sizes. ``seqcal.algorithms.allocation.OnlineAllocation`` then takes the unit's
candidate minimising ``error + lambda * bits``, ``lambda`` solved over this unit and the units still to come (their
curves predicted from the last unit of the same role, e.g. the previous layer's down_proj) with the budget that
remains, and never more bits than leave the later units their cheapest candidates: the total is guaranteed within
the budget. The solver (GPTQ or round to nearest) then quantizes with the chosen scheme.

The default candidates are 3 and 4 bits in groups of 128 and 64 and 8 bits per channel, and 2 bits in groups of
64 only where the budget cannot be met without them: the curves underrate what a 2-bit module costs the model.

Candidates and pins named by an integer preset search their ranges (the ``imatrix_mse`` weight observer), in the
curves and in the solve: min-max ranges at 2 and 3 bits cost more than the allocation wins. A dict candidate keeps
its observer; ``weight_observer`` / ``observer`` set every candidate's and pin's.

Pinned modules (``pin: {pattern: scheme}``) keep their scheme and count against the budget; ``ignore`` stays
in full precision and does not count. Each module's report entry (quantization_report.json) gives its
``scheme``, ``bits`` (per weight, stored) and the ``predicted_rel_error`` beside the solver's measured
``rel_error``; ``mixed_precision_recipe.yaml`` in the output directory replays the allocation.

Resume and several processes: each choice depends on the curves and the budget spent before it, so the unit's
first module records the unit's curve and the step it was chosen at in its report entry (``allocation``), which
travels with its codes to the other processes and into the resume files. Before its next choice the allocation
chooses again, in step order, from the curves it did not measure itself (``MixedPrecision.catch_up``): a run
resumed after any subgraph, or run by any number of processes, makes the same choices. With several processes
a subgraph's units are solved by one process, in module order (``Needs.one_solver``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from seqcal.modifiers.gptq import GPTQModifier
from seqcal.modifiers.mixed_allocator import MixedPrecision

__all__ = ["MixedPrecision", "MixedPrecisionModifier"]


@dataclass
class MixedPrecisionModifier(GPTQModifier):
    """GPTQ with each module's scheme chosen under a size budget (module docstring: how, and the guarantee).

    Args (besides GPTQModifier's targets, ignore, block_size, dampening_frac, actorder, ...):
        average_bits: stored bits per weight over the quantized modules (scales and zero points counted).
        max_size: bytes of the whole checkpoint's tensors (``"70MB"``, an int), instead of average_bits.
        candidates: the schemes to choose from: presets, ``PRESET:g<N>`` / ``PRESET:channel``, scheme dicts; by
            default ``MixedPrecision.DEFAULT_CANDIDATES`` (3 and 4 bits at groups of 128 and 64, 8 bits per
            channel), with 2 bits in groups of 64 only where the budget cannot be met without them.
        pin: ``{pattern: scheme}``: modules matching a pattern (class name or ``re:``) keep that scheme.
        error: "relative" (default: the modules' relative errors, weighted by their sizes) or "absolute" (their output
            errors summed, which on SmolLM2 chose the better allocation at 3 bits per weight and the worse at 3.5:
            benchmarks/RESULTS.md).

    Example:
        >>> MixedPrecisionModifier(average_bits=3.0, candidates=["W2A16:g64", "W3A16:g64", "W4A16", "W8A16"],
        ...                        ignore=["lm_head"])  # doctest: +SKIP
    """

    name: ClassVar[str] = "MixedPrecisionModifier"
    average_bits: float | None = None
    max_size: int | str | None = None
    candidates: list[Any] | None = None
    pin: dict[str, Any] = field(default_factory=dict)
    error: str = "relative"

    def mixed_arguments(self) -> dict[str, Any] | None:
        if self.mixed_precision is not None:
            raise ValueError(f"{self.name}: give average_bits / max_size, candidates and pin as its own arguments, "
                             "not mixed_precision (that is GPTQModifier's and QuantizationModifier's form)")  # fmt: skip
        return {"average_bits": self.average_bits, "max_size": self.max_size, "candidates": self.candidates,
                "pin": self.pin, "error": self.error}  # fmt: skip
