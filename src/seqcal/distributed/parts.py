"""The part of a subgraph one process solves (its module groups), and the solve costs that spread them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from seqcal.tracing.partition import Subgraph


@dataclass
class Part(Subgraph):
    """The share of a subgraph one process compresses when its module groups are solved by several processes:
    the same subgraph, whose ``holds`` (and ``targets``) leave out the modules other processes solve.

    Attributes:
        mine: the only modules this process solves (None: every module no other process solves).
        others: the modules other processes solve.
    """

    mine: frozenset[str] | None = None
    others: frozenset[str] = frozenset()

    def holds(self, name: str) -> bool:
        if self.mine is not None:
            return name in self.mine
        return super().holds(name) and name not in self.others


def part_of(sg: Subgraph, parts: dict[str, int], rank: int, default: int) -> Subgraph | None:
    """What ``rank`` compresses of ``sg`` when ``parts`` (module -> rank) spreads its groups; ``default`` solves
    what ``parts`` does not name (and the subgraph's other work: KV-cache scales)."""
    if not parts:
        return sg if rank == default else None
    mine = frozenset(n for n, r in parts.items() if r == rank)
    if rank != default and not mine:
        return None
    others = frozenset(n for n, r in parts.items() if r != rank)
    part = Part(**{f.name: getattr(sg, f.name) for f in fields(Subgraph)},
                mine=None if rank == default else mine, others=others)  # fmt: skip
    part.kv_updates = list(sg.kv_updates) if rank == default else []  # the KV cache's scales: the owner's
    part.targets = [t for t in sg.targets if part.holds(t)]
    part.target_inputs = {
        k: kept for k, v in sg.target_inputs.items() if (kept := [t for t in v if part.holds(t)])
    }
    return part


def solve_costs(subgraphs: Sequence[Any], modifiers: Sequence[Any], model: torch.nn.Module) -> list[float]:
    """Estimated solve cost of each subgraph: ``out * in^2 + in^3`` per quantized or pruned Linear (GPTQ's and
    SparseGPT's column loop and the inverse of the Hessian); shapes are read from the model (parameters on
    meta too)."""
    costs = []
    for sg in subgraphs:
        cost = 0.0
        # each module once: a transform's consumers are its quantizer's modules too (SmoothQuant, GPTQ)
        for name in dict.fromkeys(n for m in modifiers for n in m.modules_in(sg)):
            out_features, in_features = model.get_submodule(name).weight.shape[:2]
            cost += float(out_features) * in_features**2 + float(in_features) ** 3
        costs.append(cost)
    return costs
