"""What SparseGPTModifier and WandaPruningModifier share: llm-compressor's arguments, their checks, targets.

Targets follow llm-compressor's ``SparsityModifierBase``: ``targets`` name the *layers* (class names or
``re:`` patterns, default every Linear), and every Linear inside a matched layer (the layer itself included)
that ``ignore`` does not match is pruned. A list of sparsities gives one per matched layer, in order.
Everything is checked in ``validate``, before any calibration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from seqcal.algorithms.sparsity import lowest_mask, nm_mask, parse_mask_structure, sparsity_of
from seqcal.mappings.names import checkpoint_names
from seqcal.modifiers.base import Batch, BatchCursor, Modifier, RunState, Statistic
from seqcal.modifiers.hessians import SharedInputs
from seqcal.modifiers.schemes import _check_patterns, matches_target
from seqcal.tracing.partition import Subgraph

# Module classes llm-compressor prunes; seqcal prunes Linear layers and refuses a target that reaches the others.
_PRUNABLE_ELSEWHERE = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


@dataclass
class PruningModifier(Modifier):
    """Base of the pruning modifiers (llm-compressor's arguments; see the subclasses)."""

    own_modules_only: ClassVar[bool] = True  # changes only the weights it prunes

    name: ClassVar[str] = "PruningModifier"
    needs_calibration: ClassVar[bool] = True
    input_only: ClassVar[bool] = True  # the statistics need only each Linear's input
    statistic: ClassVar[str] = (
        "inputs"  # what the subclass accumulates per input (the keys of its statistics)
    )
    sparsity: float | list[float] | None = None
    sparsity_profile: str | None = None
    mask_structure: str = "0:0"
    owl_m: int | None = None
    owl_lmbda: float | None = None
    sequential_update: bool | None = False  # deprecated in llm-compressor; accepted and ignored
    targets: str | list[str] = field(default_factory=lambda: ["Linear"])
    ignore: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            self.targets = [self.targets]
        if isinstance(self.ignore, str):
            self.ignore = [self.ignore]
        try:
            self._n, self._m = parse_mask_structure(self.mask_structure)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None
        if self.sparsity_profile is not None or self.owl_m is not None or self.owl_lmbda is not None:
            raise ValueError(
                f"{self.name}: OWL layer-wise sparsity (sparsity_profile, owl_m, owl_lmbda) is not supported by "
                "seqcal; remove those arguments to prune every layer to the same sparsity"
            )
        values = self.sparsity if isinstance(self.sparsity, list) else [self.sparsity]
        values = [] if self.sparsity is None and self._n else values  # N:M fixes the sparsity itself
        for value in values:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                raise ValueError(
                    f"{self.name}: sparsity must be a number in (0, 1) (or a list of them, one per target "
                    f"layer), got {self.sparsity!r}; e.g. sparsity: 0.5"
                )
        self.pruned: dict[str, float] = {}  # module name -> its sparsity (the modules this modifier prunes)
        self._inputs = SharedInputs(self._add)

    def _add(self, acc: Any, X: torch.Tensor) -> None:
        raise NotImplementedError  # the subclass's input statistic

    @property
    def structure(self) -> str:
        """The mask structure as the checkpoint records it ("2:4", or "unstructured")."""
        return f"{self._n}:{self._m}" if self._n else "unstructured"

    def validate(self, model: torch.nn.Module) -> None:
        modules, aliases = list(model.named_modules()), checkpoint_names(model)
        self.warnings = _check_patterns(model, modules, self.targets, self.ignore, self.name, aliases)
        layers = [(n, m) for n, m in modules if matches_target(m, n, self.targets, aliases.get(n))]
        if isinstance(self.sparsity, list) and len(self.sparsity) != len(layers):
            raise ValueError(
                f"{self.name}: sparsity is a list of {len(self.sparsity)} values but targets {self.targets} "
                f"match {len(layers)} layers; give one value per layer or a single number"
            )
        self.pruned = {}
        for i, (layer, module) in enumerate(layers):
            value = self.sparsity[i] if isinstance(self.sparsity, list) else self.sparsity
            for sub, child in module.named_modules(prefix=layer):
                if sub in self.pruned or matches_target(child, sub, self.ignore, aliases.get(sub)):
                    continue
                if isinstance(child, _PRUNABLE_ELSEWHERE):
                    raise ValueError(
                        f"{self.name}: targets reach {sub} ({type(child).__name__}), which seqcal cannot prune "
                        f"(Linear layers only); add {sub!r} to ignore"
                    )
                if isinstance(child, torch.nn.Linear):
                    self.pruned[sub] = float(value if value is not None else self._n / max(self._m, 1))
        if not self.pruned:
            raise ValueError(
                f"{self.name}: no Linear layer matches targets {self.targets!r} (ignore={self.ignore!r}); "
                "targets are class names such as 'Linear' or 're:' patterns on layer names"
            )
        self._check_modules(model)

    def _check_modules(self, model: torch.nn.Module) -> None:
        """Widths the N:M structure cannot divide, and weights tied to another module, refused up front."""
        tied: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            tied.setdefault(id(param), []).append(name)
        for name in self.pruned:
            weight = model.get_submodule(name).weight
            if self._n and weight.shape[1] % self._m:
                raise ValueError(
                    f"{self.name}: mask_structure {self.mask_structure!r} needs input widths divisible by "
                    f"{self._m}, but {name} has {weight.shape[1]} inputs; add {name!r} to ignore or use "
                    "mask_structure '0:0' (unstructured)"
                )
            if len(tied.get(id(weight), [])) > 1:
                others = [n for n in tied[id(weight)] if n != f"{name}.weight"]
                raise ValueError(
                    f"{self.name}: {name}.weight is tied to {others[0]}, so pruning it would prune that too; "
                    f"add {name!r} to ignore (e.g. ignore: ['re:.*lm_head'])"
                )
        if self._n and self.sparsity is not None and self.sparsity != self._n / self._m:
            self._note = (
                f"{self.name}: sparsity {self.sparsity} ignored: mask_structure {self.mask_structure} "
            )
            self._note += f"prunes {self._n / self._m:g} of the weights"

    def initialize(self, model: torch.nn.Module, state: RunState) -> None:
        if not self.pruned:
            self.validate(model)
        state.results.log.extend(w for w in getattr(self, "warnings", []) if w not in state.results.log)
        if note := getattr(self, "_note", None):
            state.results.log.append(note)

    def prunes(self) -> dict[str, float]:
        return self.pruned

    def modules_in(self, subgraph: Subgraph) -> list[str]:
        """The modules this modifier prunes that ``subgraph`` uses (as ``QuantizationModifier.modules_in``)."""
        if subgraph.target_inputs:
            return [n for n in self.pruned if n in set(subgraph.targets)]
        return [n for n in self.pruned if subgraph.holds(n)]

    @contextlib.contextmanager
    def calibrate(
        self, subgraph: Subgraph, model: torch.nn.Module, state: RunState, batches: BatchCursor
    ) -> Iterator[None]:
        names = [n for n in self.modules_in(subgraph) if n not in state.results.sparsity]
        with self._inputs.hooks(names, model, batches):
            yield

    def observe(self, names: list[str], x: torch.Tensor, state: RunState, batch: Batch) -> None:
        self._inputs.observe(
            [n for n in names if n in self.pruned and n not in state.results.sparsity], x, batch
        )

    def partial_statistics(self) -> dict[str, dict[str, Statistic]]:
        """Per shared accumulator (``SharedInputs.partial_statistics``): SparseGPT's Hessians, Wanda's squared
        norms, each as a sum with its tokens."""
        return self._inputs.partial_statistics(self.statistic)

    def load_statistics(self, reduced: dict[str, dict[str, torch.Tensor]]) -> None:
        self._inputs.load_statistics(reduced, self.statistic)

    def shares_statistics(self) -> bool:
        """The input statistics reduce across processes (``partial_statistics``)."""
        return True

    def magnitude_prune(self, name: str, model: torch.nn.Module, state: RunState) -> None:
        """A module never called during calibration: pruned by weight magnitude, and the log says so."""
        W = model.get_submodule(name).weight.data
        mask = (
            nm_mask(W.abs(), self._n, self._m)
            if self._n
            else lowest_mask(W.abs(), int(W.shape[1] * self.pruned[name]), 1)
        )
        model.get_submodule(name).weight.data = W.masked_fill(mask, 0)
        state.results.log.append(f"{name}: never called during calibration; pruned by weight magnitude")
        state.results.module_errors.setdefault(name, {})["sparsity"] = sparsity_of(
            model.get_submodule(name).weight
        )
        state.results.sparsity[name] = self.structure
