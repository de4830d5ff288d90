"""Pruning masks: N:M structures, unstructured top-k, and the checks a mask passes.

A mask is a bool tensor shaped like the weight ``W [out, in]``; True marks a pruned weight (set to 0).
``N:M`` (llm-compressor's ``mask_structure``) prunes ``N`` weights in every group of ``M`` consecutive
input columns of each row (``"2:4"``: half of them, the layout sparse tensor cores run); ``"0:0"`` is
unstructured.

Example:
    >>> parse_mask_structure("2:4")
    (2, 4)
    >>> mask = nm_mask(torch.tensor([[4.0, 1.0, 3.0, 2.0]]), 2, 4)
    >>> mask.tolist()
    [[False, True, False, True]]
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

_STRUCTURE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_mask_structure(structure: str) -> tuple[int, int]:
    """``"N:M"`` -> ``(N, M)``; ``"0:0"`` (or ``"unstructured"``) -> ``(0, 0)``.

    Args:
        structure: llm-compressor's ``mask_structure`` string.

    Returns:
        ``(n, m)`` with ``0 < n < m``, or ``(0, 0)`` for unstructured.

    Raises:
        ValueError: not of the form N:M with 0 < N < M (or 0:0).

    Example:
        >>> parse_mask_structure("0:0")
        (0, 0)
    """
    if isinstance(structure, str) and structure.strip().lower() == "unstructured":
        return 0, 0
    match = _STRUCTURE.match(structure) if isinstance(structure, str) else None
    n, m = (int(match.group(1)), int(match.group(2))) if match else (-1, -1)
    if not match or not ((n, m) == (0, 0) or 0 < n < m):
        raise ValueError(
            f"mask_structure={structure!r} is not valid; give 'N:M' with 0 < N < M (e.g. '2:4': 2 of every 4 "
            "consecutive input columns pruned) or '0:0' for unstructured sparsity"
        )
    return n, m


def nm_mask(metric: Tensor, n: int, m: int) -> Tensor:
    """Prune the ``n`` lowest-``metric`` entries of every group of ``m`` consecutive columns, row by row.

    Args:
        metric: importance ``[out, in]`` (higher is kept); ``in`` divisible by ``m``.
        n, m: the N:M structure.

    Returns:
        bool mask ``[out, in]``, exactly ``n`` True per group.
    """
    rows, cols = metric.shape
    groups = metric.reshape(rows, cols // m, m)  # [out, in / m, m]
    drop = torch.topk(groups, n, dim=-1, largest=False).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, drop, True)
    return mask.reshape(rows, cols)


def lowest_mask(metric: Tensor, k: int, dim: int | None = None) -> Tensor:
    """Prune exactly the ``k`` lowest-``metric`` entries, of the whole tensor (``dim=None``) or per row (``dim=1``).

    Ties are broken by position (stable sort), so the count is exact whatever the values.
    """
    mask = torch.zeros_like(metric, dtype=torch.bool)
    if k <= 0:
        return mask
    if dim is None:
        order = torch.sort(metric.flatten(), stable=True).indices[:k]
        return mask.view(-1).index_fill_(0, order, True).view(metric.shape)
    order = torch.sort(metric, dim=dim, stable=True).indices.narrow(dim, 0, k)
    return mask.scatter_(dim, order, True)


def follows_structure(W: Tensor, n: int, m: int) -> bool:
    """Whether every group of ``m`` consecutive columns of every row of ``W`` holds at least ``n`` zeros."""
    if n == 0:
        return True
    if W.shape[-1] % m:
        return False
    zeros = (W.reshape(-1, m) == 0).sum(dim=1)
    return bool((zeros >= n).all())


def sparsity_of(W: Tensor) -> float:
    """Fraction of exact zeros in ``W``."""
    return (W == 0).sum().item() / max(W.numel(), 1)
