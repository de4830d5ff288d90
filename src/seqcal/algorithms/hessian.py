"""The GPTQ Hessian ``H = 2 X^T X / tokens`` of a layer's inputs, accumulated batch by batch.

Notation as in ``gptq.py``: ``X [tokens, in]`` a layer's inputs, ``W [out, in]`` its weight. On the CPU only the
block rows' upper parts are updated (``upper``), and :func:`symmetrize_upper` fills the rest before ``H`` is
used. What is measured with ``H`` (a quantized weight's output error, no forward pass) is in
``seqcal.algorithms.output_error``; how its values are kept while its memory serves as scratch, in
``seqcal.algorithms.kept_hessian``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from seqcal.algorithms.products import add_transposed_products
from seqcal.backend import onednn_applies, onednn_for

# Columns per block row of an upper-only update: small enough that the flops come near half of the square's
# (54% at 1536 features, 384 gave 62%), big enough to keep the GEMMs efficient; on one CPU thread 9-15%
# faster than 384 for SmolLM2's 576 and 1536 features.
UPPER_BLOCK = 128


def running_square(M: Tensor | None, X: Tensor, who: str, name: str) -> Tensor:
    """The ``[in, in]`` float32 running average that inputs ``X [m, in]`` update: ``M`` checked, or a new zero one
    on ``X``'s device (GPTQ's Hessian, GPTAQ's ``dXXT``).

    Raises:
        ValueError: ``M`` is not float32 ``[in, in]`` for ``X``'s width (``who``: the caller, ``name``: ``M``'s).
    """
    d = X.shape[1]
    if M is None:
        return torch.zeros(d, d, dtype=torch.float32, device=X.device)
    if M.shape != (d, d) or M.dtype != torch.float32:
        raise ValueError(
            f"{who}: {name} must be float32 [{d}, {d}] to match inputs with {d} features, got {M.dtype} "
            f"{list(M.shape)}"
        )
    return M


def accumulate_hessian(
    H: Tensor | None,
    X: Tensor,
    n_seen: int,
    product_dtype: torch.dtype = torch.float32,
    *,
    upper: bool = False,
) -> tuple[Tensor, int]:
    """Running average of ``2 x x^T`` over tokens: ``H_n = 2 / n * sum_t x_t x_t^T``, in float32.

    Same update as the GPTQ reference (``H *= n / (n + m); H += 2 / (n + m) X^T X``) except that
    every token counts, not every sequence, so padded batches or mixed lengths weigh tokens equally.
    Drop padding positions from ``X`` before calling.

    Args:
        H: current Hessian ``[in, in]`` float32 (updated in place), or None to start one on X's device.
        X: layer inputs ``[..., in]``; any leading dims are tokens.
        n_seen: tokens already averaged into ``H``.
        product_dtype: dtype of this batch's ``X^T X`` matmul. float32 (default) is exact up to float32
            rounding (on CUDA, bf16/fp16 inputs run on the half-precision tensor cores with float32
            accumulation, which is the same: their products are exact); bfloat16 (for bf16 activations, whose products are exact) uses the bf16 matmul units
            with float32 accumulation inside and rounds only the batch's partial sum, which ``H`` then
            accumulates in float32.
        upper: update only the block rows' parts on and right of the diagonal (``k`` blocks of
            ``UPPER_BLOCK`` columns: ``(k + 1) / 2k`` of the flops, 54% for 1536 features); what lies below
            the diagonal blocks goes stale, so :func:`symmetrize_upper` must run before ``H`` is used.
            Worth it where the matmul is compute-bound (CPU); on a GPU one product is cheaper than k.

    Returns:
        ``(H, n_seen + tokens in X)``.

    Example:
        >>> H, n = accumulate_hessian(None, torch.randn(2, 16, 8), 0)
        >>> H.shape, n
        (torch.Size([8, 8]), 32)
    """
    X = X.reshape(-1, X.shape[-1])  # [m, in]
    H = running_square(H, X, "accumulate_hessian", "H")
    m = X.shape[0]
    if m == 0:
        return H, n_seen
    n = n_seen + m
    if product_dtype == torch.float32 and not upper and _half_tensor_cores(H, X, n_seen / n, 2 / n):
        return H, n
    d = X.shape[1]
    if product_dtype != torch.float32:
        H.mul_(n_seen / n)
        blocks = [(i, min(i + UPPER_BLOCK, d)) for i in range(0, d, UPPER_BLOCK)] if upper else [(0, d)]
        Xp = X.to(device=H.device, dtype=product_dtype)  # [m, in]
        for i0, i1 in blocks:  # block row i0:i1, columns i0: (all of them when not upper)
            H[i0:i1, i0:].add_(torch.mm(Xp[:, i0:i1].T, Xp[:, i0:]).float(), alpha=2 / n)
        return H, n
    # The old average is rescaled block row by block row, where each block's product lands and while that part
    # of H is in cache (one pass over the whole H per batch cost as much again); with ``upper`` the parts below
    # the diagonal blocks are stale anyway (``symmetrize_upper``). Same operations on each element as scaling H
    # first: the result is the same bit for bit.
    # One float32 copy of X, scaled in place: a second [m, in] temporary per batch only fragments the heap.
    if onednn_for(H.device, m):  # oneDNN's kernel wants the rows of X^T: the copy is transposed
        Xt = X.T.to(device=H.device, dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
        Xt.mul_(math.sqrt(2 / n))
        return add_transposed_products(H, Xt, UPPER_BLOCK, upper=upper, beta=n_seen / n), n
    Xs = X.to(device=H.device, dtype=torch.float32, copy=True).mul_(math.sqrt(2 / n))  # [m, in]
    return add_products(H, Xs, upper=upper, beta=n_seen / n), n


def add_products(H: Tensor, X: Tensor, *, upper: bool, beta: float = 1.0) -> Tensor:
    """``H = beta H + X^T X`` in place (``X [m, in]`` on H's device, in H's dtype); with ``upper``, only
    the block rows' parts on and right of the diagonal (``UPPER_BLOCK`` columns each), as
    :func:`accumulate_hessian`'s.

    Example:
        >>> X = torch.randn(5, 3); torch.allclose(add_products(torch.zeros(3, 3), X, upper=False), X.T @ X)
        True
    """
    if onednn_applies(X, H):  # float32 on the CPU: oneDNN's kernel wants the rows of X^T
        Xt = X.T.contiguous()
        return add_transposed_products(H, Xt, UPPER_BLOCK, upper=upper, beta=beta)
    d = X.shape[1]
    step = UPPER_BLOCK if upper else d
    for i0 in range(0, d, step):  # block row i0:i0 + step, in place in H's rows
        part = H[i0 : i0 + step, i0:]
        if beta != 1.0:
            part.mul_(beta)  # as H.mul_(beta) would, while the block row is in cache
        part.addmm_(X[:, i0 : i0 + step].T, X[:, i0:])
    return H


def _half_tensor_cores(H: Tensor, X: Tensor, beta: float, alpha: float) -> bool:
    """``H = beta H + alpha X^T X`` on the half-precision tensor cores of a CUDA device, exactly; False if not.

    The products of two bf16 (or two fp16) values are exact in float32, so a half-precision matmul that
    accumulates and writes float32 (aten::addmm.dtype_out, CUDA only) equals the float32 matmul up to summation
    order, at 8-16x the rate of float32 CUDA cores (on an H100, 1.65 s -> a fraction for one down_proj Hessian
    of 524k tokens). It writes into ``H`` in place: no [in, in] temporary. Anything else (CPU, float32 inputs,
    a torch without the op) returns False and the caller takes the float32 path.
    """
    if X.device.type != "cuda" or H.device != X.device or X.dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        torch.addmm(H, X.T, X, out_dtype=torch.float32, beta=beta, alpha=alpha, out=H)
    except (TypeError, NotImplementedError, RuntimeError):  # torch before out_dtype, or a device without it
        return False
    return True


def symmetrize_upper(H: Tensor) -> Tensor:
    """Fill ``H`` below the diagonal from above it (in place), after ``accumulate_hessian(upper=True)``.

    Example:
        >>> H, _ = accumulate_hessian(None, torch.randn(64, 500), 0, upper=True)
        >>> torch.equal(symmetrize_upper(H), H.T)
        True
    """
    d = H.shape[0]
    for i0 in range(0, d, UPPER_BLOCK):  # in place, block by block: no [in, in] temporary (5632^2 = 127 MB)
        i1 = min(i0 + UPPER_BLOCK, d)
        block = H[i0:i1, i0:i1]  # both triangles computed; make them bit-equal
        block.copy_(torch.triu(block) + torch.triu(block, 1).T)
        H[i1:, i0:i1].copy_(H[i0:i1, i1:].T)  # below the diagonal blocks, from above
    return H


def is_symmetric(H: Tensor, rows: int = UPPER_BLOCK) -> bool:
    """Whether square ``H`` equals its transpose exactly, compared a strip of ``rows`` rows at a time."""
    n = H.shape[0]
    return all(torch.equal(H[r : r + rows, r:], H[r:, r : r + rows].T) for r in range(0, n, rows))
