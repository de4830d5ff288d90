"""Wanda (Sun et al. 2023, arXiv:2306.11695): prune by ``|W_ij| * ||X_j||_2``, no weight update.

``S [in]`` is the running mean over tokens of ``x_j^2`` (:func:`accumulate_sq_norms`); the metric's
``||X_j||_2`` is ``sqrt(tokens * S_j)``, and the constant ``tokens`` factor does not change any comparison,
so ``sqrt(S)`` is used. Unstructured masks compare the weights of one output row (the paper's per-output
groups), N:M masks the ``m`` consecutive columns of one row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqcal.algorithms.sparsity import lowest_mask, nm_mask


def accumulate_sq_norms(S: Tensor | None, X: Tensor, n_seen: int) -> tuple[Tensor, int]:
    """Running mean over tokens of the squared inputs, per input feature, in float32.

    Args:
        S: current means ``[in]`` (updated in place), or None to start on X's device.
        X: inputs ``[..., in]``; any leading dims are tokens (drop padding tokens first).
        n_seen: tokens already averaged into ``S``.

    Returns:
        ``(S, n_seen + tokens in X)``.

    Example:
        >>> S, n = accumulate_sq_norms(None, torch.ones(2, 3, 4), 0)
        >>> S.tolist(), n
        ([1.0, 1.0, 1.0, 1.0], 6)
    """
    X = X.reshape(-1, X.shape[-1])  # [tokens, in]
    if S is None:
        S = torch.zeros(X.shape[1], dtype=torch.float32, device=X.device)
    if X.shape[0] == 0:
        return S, n_seen
    n = n_seen + X.shape[0]
    S.mul_(n_seen / n).add_(X.to(S.device, torch.float32).square().sum(0), alpha=1 / n)
    return S, n


def wanda_mask(W: Tensor, S: Tensor, *, sparsity: float = 0.5, n: int = 0, m: int = 0) -> Tensor:
    """The Wanda mask of ``W [out, in]`` given the input statistics ``S [in]``; True = pruned.

    Args:
        W: weight ``[out, in]``.
        S: mean squared input per feature ``[in]``.
        sparsity: fraction pruned per row for unstructured masks (``int(in * sparsity)`` weights of each row).
        n, m: N:M structure, or ``0, 0`` for unstructured.

    Returns:
        bool ``[out, in]``.

    Example:
        >>> wanda_mask(torch.tensor([[1.0, 1.0, 1.0, 1.0]]), torch.tensor([4.0, 0.0, 1.0, 9.0]), n=2, m=4).tolist()
        [[False, True, True, False]]
    """
    metric = W.detach().float().abs() * S.to(W.device, torch.float32).sqrt()[None, :]  # [out, in]
    if n:
        return nm_mask(metric, n, m)
    return lowest_mask(metric, int(W.shape[1] * sparsity), dim=1)
