"""WandaPruningModifier: input norms from the calibration pass, Wanda's mask per Linear (algorithms.wanda)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from seqcal.algorithms.sparsity import sparsity_of
from seqcal.algorithms.wanda import accumulate_sq_norms, wanda_mask
from seqcal.modifiers.base import RunState
from seqcal.modifiers.pruning import PruningModifier
from seqcal.tracing.partition import Subgraph


@dataclass
class WandaPruningModifier(PruningModifier):
    """Wanda (Sun et al., 2023): prune the weights with the lowest ``|W_ij| * ||X_j||_2``; no weight update.

    Args (llm-compressor's names): sparsity, mask_structure, targets, ignore as for SparseGPTModifier
    (sparsity_profile "owl", owl_m, owl_lmbda are refused; sequential_update is accepted and ignored).

    Example:
        >>> WandaPruningModifier(sparsity=0.5, mask_structure="2:4", ignore=["re:.*lm_head"])  # doctest: +SKIP
    """

    name: ClassVar[str] = "WandaPruningModifier"
    statistic: ClassVar[str] = "norms"

    def _add(self, acc: Any, X: torch.Tensor) -> None:
        acc.H, acc.n = accumulate_sq_norms(acc.H, X, acc.n)  # H holds the [in] mean squared inputs here

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        names = [n for n in self.modules_in(subgraph) if n not in state.results.sparsity]
        for name in names:
            acc = self._inputs.acc.pop(name, None)
            if acc is None or acc.H is None:
                self.magnitude_prune(name, model, state)
                continue
            module = model.get_submodule(name)
            mask = wanda_mask(module.weight.data, acc.H, sparsity=self.pruned[name], n=self._n, m=self._m)
            module.weight.data = module.weight.data.masked_fill(mask, 0)
            state.results.module_errors.setdefault(name, {}).update(
                tokens=acc.n, sparsity=sparsity_of(module.weight)
            )
            state.results.sparsity[name] = self.structure
        return bool(names)
