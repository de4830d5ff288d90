"""MagnitudePruningModifier and ConstantPruningModifier: llm-compressor's data-free pruning modifiers, one-shot.

In llm-compressor both are training-time modifiers: MagnitudePruning raises the sparsity of its targets'
weights along a schedule (``init_sparsity`` at ``start`` to ``final_sparsity`` at ``end``, every ``update``
steps), ConstantPruning keeps the zeros its targets already have while training goes on. A one-shot run has no
training steps, so seqcal applies each once:

* MagnitudePruning prunes every target to the sparsity its schedule ends at (``final_sparsity`` for the
  built-in ``linear``, ``cubic``, ``polynomial`` and ``polynomial_decay`` schedules, the last step of
  ``multi_step``), smallest ``|W|`` first across the whole weight (llm-compressor's ``unstructured`` mask) or by
  blocks (``block_R,C``: the blocks with the smallest sum of ``|W|``). llm-compressor's own oneshot evaluates the
  schedule at step 0 instead (``init_sparsity`` when ``start`` is 0, no pruning at all without ``start``).
* ConstantPruning records the zeros of its targets as their sparsity mask: a later quantizer keeps them (GPTQ
  solves with the mask) and the checkpoint records the sparsity, as for the other pruning modifiers.

Targets are llm-compressor's: module class names, ``re:`` patterns or names, matched against the in-memory and
the checkpoint names (``seqcal.mappings.names``); only Linear weights are pruned.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from seqcal.algorithms.sparsity import sparsity_of
from seqcal.mappings.names import checkpoint_names
from seqcal.modifiers.base import Modifier, RunState
from seqcal.modifiers.schemes import matches_target
from seqcal.tracing.partition import Subgraph

SCHEDULERS = ("linear", "cubic", "polynomial", "polynomial_decay", "multi_step")
_BLOCK = re.compile(r"^block_(\d+),(\d+)$")


@dataclass
class _OneShotPruning(Modifier):
    """What both share: targets resolved to Linear modules, the per-subgraph loop, the sparsity record."""

    own_modules_only: ClassVar[bool] = True  # changes only the weights it prunes

    name: ClassVar[str] = "_OneShotPruning"
    input_only: ClassVar[bool] = True  # data-free: the one-pass cut is fine
    targets: str | list[str] | None = None
    start: float | None = None
    end: float | None = None
    update: float | None = None

    def __post_init__(self) -> None:
        if self.targets is None or self.targets == []:
            raise ValueError(f"{self.name}: targets is required (module class names or 're:' patterns), "
                             "e.g. targets: ['re:.*mlp.*proj']")  # fmt: skip
        if isinstance(self.targets, str):
            self.targets = [self.targets]
        self.pruned: dict[str, float] = {}  # module name -> the sparsity it is pruned to

    def validate(self, model: torch.nn.Module) -> None:
        aliases = checkpoint_names(model)
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        found = [n for n, m in linears if matches_target(m, n, self.targets, aliases.get(n))]
        if not found:
            raise ValueError(f"{self.name}: no Linear layer matches targets {self.targets!r}; targets are class "
                             "names such as 'Linear' or 're:' patterns on module names")  # fmt: skip
        self.pruned = {n: self._sparsity() for n in found}

    def _sparsity(self) -> float:
        return 0.0

    def initialize(self, model: torch.nn.Module, state: RunState) -> None:
        if not self.pruned:
            self.validate(model)

    def modules_in(self, subgraph: Subgraph) -> list[str]:
        if subgraph.target_inputs:
            return [n for n in self.pruned if n in set(subgraph.targets)]
        return [n for n in self.pruned if subgraph.holds(n)]

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        names = [n for n in self.modules_in(subgraph) if n not in state.results.sparsity]
        for name in names:
            weight = model.get_submodule(name).weight
            weight.data = weight.data.masked_fill(self._mask(weight.data, self.pruned[name]), 0)
            state.results.module_errors.setdefault(name, {})["sparsity"] = sparsity_of(weight)
            state.results.sparsity[name] = "unstructured"
        return bool(names)

    def _mask(self, W: torch.Tensor, sparsity: float) -> torch.Tensor:
        return torch.zeros_like(W, dtype=torch.bool)


@dataclass
class MagnitudePruningModifier(_OneShotPruning):
    """Prune the targets' weights of smallest magnitude, once, to the sparsity the schedule ends at.

    Args (llm-compressor's names):
        targets: modules whose weight is pruned (class names, ``re:`` patterns or names); required.
        init_sparsity, final_sparsity: the schedule's first and last sparsity, in [0, 1); required.
        update_scheduler: linear, cubic (default), polynomial, polynomial_decay or multi_step
            (``scheduler_args: {steps: [[index, sparsity], ...]}``); a ``calc(...)`` expression is refused
            (seqcal never evaluates recipe content).
        scheduler_args: the scheduler's arguments (``exponent``, ``steps``).
        mask_structure: "unstructured" (default) or "block_R,C" (R x C blocks of the weight, which must divide it).
        leave_enabled: deprecated in llm-compressor (always False there); accepted and ignored.
        apply_globally: one threshold across all targets; not implemented by llm-compressor either (refused).
        start, end, update: the schedule's steps; a one-shot run ends it at once.

    Example:
        >>> MagnitudePruningModifier(targets="Linear", init_sparsity=0.1, final_sparsity=0.5)._sparsity()
        0.5
    """

    name: ClassVar[str] = "MagnitudePruningModifier"
    init_sparsity: float | None = None
    final_sparsity: float | None = None
    update_scheduler: str = "cubic"
    scheduler_args: dict[str, Any] = field(default_factory=dict)
    mask_structure: str = "unstructured"
    leave_enabled: bool = False
    apply_globally: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for arg in ("init_sparsity", "final_sparsity"):
            value = getattr(self, arg)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{self.name}: {arg} is required, a number in [0, 1), got {value!r}")
        if self.update_scheduler not in SCHEDULERS:
            why = (
                " (seqcal never evaluates recipe content)"
                if str(self.update_scheduler).startswith("calc(")
                else ""
            )
            raise ValueError(f"{self.name}: update_scheduler {self.update_scheduler!r} is not one of "
                             f"{', '.join(SCHEDULERS)}{why}")  # fmt: skip
        if self.apply_globally:
            raise ValueError(f"{self.name}: apply_globally (one threshold across all targets) is not implemented, "
                             "nor by llm-compressor; remove it to prune each target to the sparsity")  # fmt: skip
        if self.mask_structure != "unstructured" and not _BLOCK.match(str(self.mask_structure)):
            raise ValueError(f"{self.name}: mask_structure {self.mask_structure!r} is not supported for Linear "
                             "weights; use 'unstructured' or 'block_R,C' (channel and filter are for "
                             "convolutions)")  # fmt: skip
        self._sparsity()  # multi_step's steps checked here

    def _sparsity(self) -> float:
        """Where the schedule ends: the last step of multi_step, final_sparsity for the others."""
        if self.update_scheduler != "multi_step":
            return float(self.final_sparsity)  # type: ignore[arg-type]
        steps = (self.scheduler_args or {}).get("steps", [])
        try:
            last = sorted((float(i), float(s)) for i, s in steps)[-1][1] if steps else self.init_sparsity
        except (TypeError, ValueError):
            raise ValueError(f"{self.name}: scheduler_args.steps must be [[index, sparsity], ...], "
                             f"got {steps!r}") from None  # fmt: skip
        if not 0 <= float(last) < 1:  # type: ignore[arg-type]
            raise ValueError(f"{self.name}: multi_step sparsity {last!r} is not in [0, 1)")
        return float(last)  # type: ignore[arg-type]

    def validate(self, model: torch.nn.Module) -> None:
        super().validate(model)
        if block := _BLOCK.match(self.mask_structure):
            r, c = int(block.group(1)), int(block.group(2))
            for name in self.pruned:
                rows, cols = model.get_submodule(name).weight.shape
                if rows % r or cols % c:
                    raise ValueError(f"{self.name}: mask_structure {self.mask_structure} does not divide {name}'s "
                                     f"[{rows}, {cols}] weight; use blocks that divide it or 'unstructured'")  # fmt: skip

    def _mask(self, W: torch.Tensor, sparsity: float) -> torch.Tensor:
        """True where pruned: the ``int(sparsity * count)`` smallest ``|W|`` (or block sums of ``|W|``)."""
        block = _BLOCK.match(self.mask_structure)
        r, c = (int(block.group(1)), int(block.group(2))) if block else (1, 1)
        scores = (
            W.abs().float().reshape(W.shape[0] // r, r, W.shape[1] // c, c).sum(dim=(1, 3))
        )  # [out/r, in/c]
        count = int(sparsity * scores.numel())
        mask = torch.zeros(scores.numel(), dtype=torch.bool, device=W.device)
        if count:
            mask[scores.flatten().topk(count, largest=False).indices] = True
        return mask.reshape(scores.shape).repeat_interleave(r, 0).repeat_interleave(c, 1)


@dataclass
class ConstantPruningModifier(_OneShotPruning):
    """Keep the zeros the targets' weights already have (a model pruned before): they become the modules'
    sparsity mask, which a later quantizer keeps and the checkpoint records. No weight changes.

    Args (llm-compressor's names):
        targets: modules whose zeros are kept (class names, ``re:`` patterns or names); required.
        start, end, update: when llm-compressor applies the mask during training; a one-shot run has no steps.

    Example:
        >>> ConstantPruningModifier(targets=["re:.*mlp.*"]).targets
        ['re:.*mlp.*']
    """

    name: ClassVar[str] = "ConstantPruningModifier"

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        super().compress(subgraph, model, state)
        return False  # the zeros were there already: no weight changed
