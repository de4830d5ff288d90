"""SparseGPTModifier: Hessians from the calibration pass, SparseGPT per Linear (math in algorithms.sparsegpt)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from seqcal.algorithms import GPTQNumericalError, relative_output_error, symmetrize_upper
from seqcal.algorithms.sparsegpt import sparsegpt_prune
from seqcal.algorithms.sparsity import sparsity_of
from seqcal.modifiers.base import RunState
from seqcal.modifiers.hessians import add_hessian
from seqcal.modifiers.pruning import PruningModifier
from seqcal.tracing.partition import Subgraph


@dataclass
class SparseGPTModifier(PruningModifier):
    """SparseGPT (Frantar & Alistarh, 2023) one-shot pruning, calibrated layer by layer.

    Args (llm-compressor's names):
        sparsity: fraction of weights pruned (0 < sparsity < 1), or one value per target layer; for N:M
            masks the structure fixes it (N / M).
        mask_structure: "N:M" (e.g. "2:4": 2 of every 4 consecutive input weights of a row) or "0:0"
            (unstructured).
        targets: layers whose Linear modules are pruned (class names or ``re:`` patterns), default Linear.
        ignore: modules left dense (class names or ``re:`` patterns), e.g. ["re:.*lm_head"].
        block_size: columns pruned together (lazy batch updates).
        dampening_frac: fraction of mean(diag(H)) added to the diagonal.
        sequential_update, offload_hessians: accepted for llm-compressor compatibility; seqcal always
            calibrates layer by layer and keeps one subgraph's Hessians.
        preserve_sparsity_mask, sparsity_profile ("owl"), owl_m, owl_lmbda: not supported (refused).

    Example:
        >>> SparseGPTModifier(sparsity=0.5, mask_structure="2:4", ignore=["re:.*lm_head"])  # doctest: +SKIP
    """

    name: ClassVar[str] = "SparseGPTModifier"
    statistic: ClassVar[str] = "hessian"
    block_size: int = 128
    dampening_frac: float | None = 0.01
    preserve_sparsity_mask: bool = False
    offload_hessians: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"{self.name}: block_size must be a positive integer, got {self.block_size!r}")
        damp = 0.0 if self.dampening_frac is None else self.dampening_frac
        if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 <= damp < 1:
            raise ValueError(
                f"{self.name}: dampening_frac must be a number in [0, 1), got {self.dampening_frac!r}"
            )
        if self.preserve_sparsity_mask:
            raise ValueError(
                f"{self.name}: preserve_sparsity_mask is not supported by seqcal; remove it (the model is "
                "pruned from its dense weights)"
            )
        self._add_hessian = add_hessian("float32")

    def _add(self, acc, X: torch.Tensor) -> None:
        self._add_hessian(acc, X)

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        names = [n for n in self.modules_in(subgraph) if n not in state.results.sparsity]
        for name in names:
            acc = self._inputs.acc.pop(name, None)
            if acc is None or acc.H is None:
                self.magnitude_prune(name, model, state)
                continue
            if not acc.symmetric:  # shared by q/k/v: the first of them makes it whole
                acc.symmetric, acc.upper = True, False
                symmetrize_upper(acc.H)
            self._prune(name, model, acc.H, acc.n, state)
        return bool(names)

    def _prune(
        self, name: str, model: torch.nn.Module, H: torch.Tensor, tokens: int, state: RunState
    ) -> None:
        module = model.get_submodule(name)
        W = module.weight.data
        start = time.perf_counter()
        try:
            result = sparsegpt_prune(
                W, H, sparsity=self.pruned[name], n=self._n, m=self._m, block_size=self.block_size,
                dampening_frac=float(self.dampening_frac or 0.0),
            )  # fmt: skip
        except GPTQNumericalError as exc:
            state.results.log.append(f"{name}: SparseGPT failed ({exc})")
            self.magnitude_prune(name, model, state)
            return
        errors = state.results.module_errors.setdefault(name, {})
        errors.update(
            tokens=tokens, rel_error=relative_output_error(W, result.W, H), sparsegpt_loss=result.loss,
            sparsity=sparsity_of(result.W), sparsegpt_seconds=time.perf_counter() - start,
        )  # fmt: skip
        if result.retries:
            state.results.log.append(
                f"{name}: Cholesky needed {result.retries} retries (dampening {result.dampening_frac})"
            )
        module.weight.data = result.W
        state.results.sparsity[name] = self.structure
