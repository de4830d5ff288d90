"""SparseGPT (Frantar & Alistarh 2023, arXiv:2301.00774) as pure tensor functions.

Notation as in ``gptq.py``: ``W [out, in]`` the weight, ``H = 2 X^T X / tokens [in, in]`` the Hessian of the
layer's squared output error, ``Hinv`` the upper Cholesky factor of ``H^-1`` (the same factor GPTQ uses,
``gptq._inverse_hessian_factor``: dead inputs, dampening and its retries included). Columns are visited
left to right in blocks of ``block_size`` (lazy batch updates, paper Sec. 3.4 / GPTQ Sec. 3.4):

- the mask is chosen by the OBS saliency ``w^2 / [Hinv]_jj^2`` of the weights as they are when the choice is
  made (already updated by the earlier columns' errors): per block for unstructured sparsity (the lowest
  ``sparsity`` fraction of the block's weights, all rows together), per group of ``M`` columns for N:M
  (the ``N`` lowest of each row's group, chosen when the loop reaches the group's first column);
- each column's pruned weights are set to 0 and their error ``(w - q) / [Hinv]_jj`` is spread over the
  columns not yet visited (OBS update), exactly as GPTQ spreads a rounding error.

Everything is computed in float32 whatever W's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqcal.algorithms.columns import SUB_BLOCK
from seqcal.algorithms.gptq import _factor_scratch, _inverse_hessian_factor
from seqcal.algorithms.sparsity import lowest_mask, nm_mask


@dataclass(frozen=True)
class SparseGPTResult:
    """What :func:`sparsegpt_prune` returns.

    Attributes:
        W: the pruned and updated weight ``[out, in]`` in W's dtype (pruned entries exactly 0).
        mask: bool ``[out, in]``, True where a weight was pruned.
        loss: the OBS objective ``sum((w - q)^2 / Hinv_jj^2) / 2`` (llm-compressor's logged value).
        row_loss: ``[out]`` the objective per output row.
        dampening_frac: the dampening fraction that made the Cholesky succeed.
        retries: how many times dampening had to be increased.
    """

    W: Tensor
    mask: Tensor
    loss: float
    row_loss: Tensor
    dampening_frac: float
    retries: int


def _check(W: Tensor, H: Tensor, sparsity: float, n: int, m: int, block_size: int) -> None:
    if W.ndim != 2 or H.shape != (W.shape[1], W.shape[1]):
        raise ValueError(
            f"sparsegpt_prune: W must be [out, in] and H [in, in], got {list(W.shape)} and {list(H.shape)}"
        )
    if n == 0 and not 0 < sparsity < 1:
        raise ValueError(f"sparsegpt_prune: sparsity must be in (0, 1), got {sparsity!r}")
    if n and W.shape[1] % m:
        raise ValueError(f"sparsegpt_prune: in_features {W.shape[1]} is not divisible by M={m} of {n}:{m}")
    if block_size <= 0:
        raise ValueError(f"sparsegpt_prune: block_size must be > 0, got {block_size}")


def sparsegpt_prune(
    W: Tensor,
    H: Tensor,
    *,
    sparsity: float = 0.5,
    n: int = 0,
    m: int = 0,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    max_retries: int = 3,
    damp_growth: float = 10.0,
) -> SparseGPTResult:
    """Prune ``W`` with SparseGPT given the Hessian ``H`` of its inputs.

    Args:
        W: weight ``[out, in]``, any float dtype (not modified).
        H: Hessian ``[in, in]`` from :func:`seqcal.algorithms.accumulate_hessian`; its memory is the inverse
            factor's scratch meanwhile, its values the same after.
        sparsity: fraction pruned for unstructured masks (``n == 0``): exactly ``int(B * out * sparsity)``
            weights of every block of B columns. Ignored for N:M (the structure fixes it to ``n / m``).
        n, m: N:M structure (``n`` pruned of every ``m`` consecutive columns per row); ``0, 0`` unstructured.
        block_size: columns per lazy-update block; for N:M it is rounded down to a multiple of ``m``.
        dampening_frac: fraction of ``mean(diag(H))`` added to the diagonal (raised on Cholesky failure).
        max_retries, damp_growth: dampening retry policy (as :func:`seqcal.algorithms.gptq_quantize`).

    Returns:
        :class:`SparseGPTResult`.

    Example:
        >>> from seqcal.algorithms.hessian import accumulate_hessian
        >>> H, _ = accumulate_hessian(None, torch.randn(256, 16), 0)
        >>> r = sparsegpt_prune(torch.randn(8, 16), H, n=2, m=4)
        >>> int(r.mask.sum()), bool((r.W[r.mask] == 0).all())
        (64, True)
    """
    _check(W, H, sparsity, n, m, block_size)
    if n:
        block_size = max(m, block_size - block_size % m)  # an N:M group never straddles two blocks
    H32 = H.detach().to(device=W.device, dtype=torch.float32).contiguous()  # its memory: the factor's scratch
    dead = H32.diagonal() == 0  # inputs never seen: their weights are free, set to 0 (as GPTQ does)
    with _factor_scratch(H32, H) as kept:  # the factor in H's memory; H's values back after the loop
        Hinv, frac, retries = _inverse_hessian_factor(
            H32, kept, None, dead, dampening_frac, max_retries, damp_growth
        )
        WT = W.detach().to(torch.float32, copy=True).T.contiguous()  # [in, out]: a column of W is a row here
        WT[dead] = 0
        maskT = torch.zeros_like(WT, dtype=torch.bool)  # [in, out]
        losses = torch.zeros(WT.shape[1], dtype=torch.float32, device=W.device)
        for i1 in range(0, WT.shape[0], block_size):
            i2 = min(i1 + block_size, WT.shape[0])
            W1, Hinv1 = WT[i1:i2].clone(), Hinv[i1:i2, i1:i2]  # [B, out], [B, B]
            d = Hinv1.diagonal()  # [B]
            if n:
                M1 = torch.zeros_like(W1, dtype=torch.bool)  # filled group by group below
            else:  # the block's lowest saliencies, all rows together
                M1 = lowest_mask(W1.square() / d[:, None].square(), int(W1.numel() * sparsity))
            Err1 = _prune_block(W1, M1, Hinv1, n, m)
            WT[i1:i2], maskT[i1:i2] = W1, M1
            losses += Err1.square().sum(0) / 2
            WT[i2:].addmm_(Hinv[i1:i2, i2:].T, Err1, alpha=-1)  # lazy batch update of the later blocks
        del Hinv
    mask = maskT.T.contiguous()  # [out, in]
    return SparseGPTResult(
        W=WT.T.to(W.dtype).contiguous(), mask=mask, loss=losses.sum().item(), row_loss=losses,
        dampening_frac=frac, retries=retries,
    )  # fmt: skip


def _prune_block(W1: Tensor, M1: Tensor, Hinv1: Tensor, n: int, m: int) -> Tensor:
    """One block's column loop, in place on ``W1`` [B, out] and ``M1`` [B, out]; returns the scaled errors.

    For N:M the mask of a group of ``m`` columns is chosen when the loop reaches its first column, from the
    weights as the earlier columns' updates left them (the paper's adaptive mask selection). The updates are
    blocked once more: rank-1 inside sub-blocks of ``SUB_BLOCK`` columns, one matmul for the rest of the block
    after each (the same algebra; the rank-1 updates of a whole block bounded the loop by memory traffic).
    """
    d = Hinv1.diagonal()  # [B]
    Err1 = torch.zeros_like(W1)  # [B, out]
    B = W1.shape[0]
    # GPTQ's sub-block width, rounded to a multiple of M for N:M: a group's mask is chosen from weights that
    # every earlier column's update has reached
    sub = m * max(1, SUB_BLOCK // m) if n else SUB_BLOCK
    for j1 in range(0, B, sub):
        j2 = min(j1 + sub, B)
        for i in range(j1, j2):
            if n and i % m == 0:
                saliency = W1[i : i + m].square() / d[i : i + m, None].square()  # [m, out]
                M1[i : i + m] = nm_mask(saliency.T, n, m).T
            q = W1[i].masked_fill(M1[i], 0.0)  # [out]
            err = Err1[i]
            torch.sub(W1[i], q, out=err).div_(d[i])
            W1[i:j2].addr_(Hinv1[i, i:j2], err, alpha=-1)  # OBS update of this sub-block's later columns
            W1[i] = q  # exactly q: the update above gives it only up to rounding
        W1[j2:].addmm_(Hinv1[j1:j2, j2:].T, Err1[j1:j2], alpha=-1)  # the rest of the block, at once
    return Err1
