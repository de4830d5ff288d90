"""REAP (Router-weighted Expert Activation Pruning): which experts of a mixture-of-experts layer to remove.

An expert's saliency is the mean, over the calibration tokens the router sends to it, of the router's gate
weight for it times the L2 norm of its output: ``S_j = mean_t(g_j(t) * ||f_j(t)||)``. The experts with the
lowest saliency are removed (Lasby et al., 2025, arXiv:2510.13999). Pure tensor functions; the modifier
(``seqcal.modifiers.reap``) gathers the sums and prunes the modules.

Example:
    >>> sums, counts = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    >>> add_saliency(sums, counts, 2, torch.tensor([0.5, 0.25]), torch.ones(2, 3))
    >>> retained_experts(sums, counts, drop=2)
    [2, 3]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DropPlan:
    """How many experts each MoE layer loses.

    Attributes:
        drop: experts removed per layer.
        per_group: experts removed per routing group (group-limited routers, DeepSeek-V3 style), or None.
        groups: the number of routing groups (1 without group-limited routing).
    """

    drop: int
    per_group: int | None = None
    groups: int = 1


def plan_drop(
    num_experts: int, sparsity: float, top_k: int, groups: int | None = None, top_k_groups: int | None = None
) -> DropPlan:
    """The experts to remove per layer for ``sparsity``, checked against what the router must still reach.

    Args:
        num_experts: experts per layer.
        sparsity: fraction of them to remove, in (0, 1); ``int(num_experts * sparsity)`` are removed.
        top_k: experts the router picks per token.
        groups: routing groups of a group-limited router (``n_group``), or None.
        top_k_groups: groups the router picks per token (``topk_group``), with ``groups``.

    Returns:
        The plan; with groups the same number is removed from each (the total rounded to a multiple).

    Raises:
        ValueError: nothing would be removed, or fewer than ``top_k`` experts would stay reachable.
    """
    drop = int(num_experts * sparsity)
    if drop == 0:
        raise ValueError(f"REAPPruningModifier: sparsity={sparsity} removes no expert of {num_experts}; raise "
                         f"it to at least {1 / num_experts:.4g}")  # fmt: skip
    per_group, available = None, num_experts - drop
    if groups is not None:
        if num_experts % groups:
            raise ValueError(f"REAPPruningModifier: {num_experts} experts do not split into n_group={groups} "
                             "equal routing groups; this router cannot be pruned per group")  # fmt: skip
        per_group = round(drop / groups)
        if per_group == 0:
            raise ValueError(f"REAPPruningModifier: sparsity={sparsity} removes no expert from each of the "
                             f"{groups} routing groups of {num_experts // groups}; raise the sparsity")  # fmt: skip
        drop = per_group * groups
        available = (top_k_groups or groups) * (num_experts // groups - per_group)
    if top_k > available:
        raise ValueError(f"REAPPruningModifier: sparsity={sparsity} leaves {available} experts the router can "
                         f"reach, fewer than the {top_k} it picks per token (num_experts_per_tok); lower the "
                         "sparsity")  # fmt: skip
    return DropPlan(drop, per_group, groups or 1)


def add_saliency(
    sums: torch.Tensor, counts: torch.Tensor, expert: int, gate: torch.Tensor, output: torch.Tensor
) -> None:
    """Add one batch of expert ``expert``'s routed tokens to the running sums (in place, float64).

    Args:
        sums: [E] sum of ``g * ||f||`` per expert.
        counts: [E] routed tokens per expert.
        expert: the expert's index.
        gate: [n] the router's weight for it on each of its tokens.
        output: [n, H] its output on them (before the gate weight multiplies it).
    """
    norms = torch.linalg.vector_norm(output.detach().to(torch.float64), dim=-1)
    sums[expert] += (gate.detach().to(torch.float64) * norms).sum()
    counts[expert] += gate.shape[0]


def retained_experts(
    sums: torch.Tensor, counts: torch.Tensor, drop: int, per_group: int | None = None, groups: int = 1
) -> list[int]:
    """The experts to keep, ascending: all but the ``drop`` of lowest mean saliency (``per_group`` from each
    routing group when the router is group-limited). An expert no token reached has saliency 0. Ties go to
    the lower index (a stable sort), so every process picks the same experts.

    Example:
        >>> retained_experts(torch.tensor([3.0, 1.0, 2.0, 4.0]), torch.ones(4), drop=1, per_group=1, groups=2)
        [0, 3]
    """
    saliency = sums.double().cpu() / counts.double().cpu().clamp(min=1.0)
    size = saliency.numel() // groups
    dropped = set()
    for g in range(groups):
        order = torch.sort(saliency[g * size : (g + 1) * size], stable=True).indices
        dropped.update(g * size + int(i) for i in order[: per_group if per_group is not None else drop])
    return [e for e in range(saliency.numel()) if e not in dropped]
