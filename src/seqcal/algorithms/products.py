"""GPTQ's inverse Cholesky factor and the Hessian's products, blocked so that oneDNN computes them.

The math of the blocks is here; the kernel (oneDNN's float32 ``a @ b.T``, chosen by ``SEQCAL_CPU_MATMUL``) is
``seqcal.backend.onednn.matmul_nt``, which these functions call where ``seqcal.backend.onednn.use_onednn`` (the
measurements: benchmarks/RESULTS.md, "float32 products through oneDNN").

Example:
    >>> A = torch.tensor([[4.0, 2.0], [2.0, 3.0]])
    >>> X = inverse_cholesky_factor_(A.clone())
    >>> torch.allclose(X @ A @ X.T, torch.eye(2), atol=1e-6)
    True
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqcal.backend.onednn import matmul_nt

__all__ = ["FACTOR_LEAF", "add_transposed_products", "inverse_cholesky_factor_"]


def add_transposed_products(H: Tensor, Xt: Tensor, block: int, *, upper: bool, beta: float = 1.0) -> Tensor:
    """``H = beta H + Xt Xt^T`` in place with oneDNN (``Xt [in, m]`` contiguous float32 on the CPU),
    ``block`` rows at a time: with ``upper`` only the parts on and right of the diagonal blocks (the rest of
    ``H`` is neither rescaled nor updated); never an [in, in] temporary.
    """
    d = Xt.shape[0]
    for i0 in range(0, d, block):
        j0 = i0 if upper else 0
        part, product = H[i0 : i0 + block, j0:], matmul_nt(Xt[i0 : i0 + block], Xt[j0:])
        if beta != 1.0:
            part.mul_(beta)  # while the block row is in cache
        part.add_(product)
    return H


# Order of the diagonal blocks that the blocked inverse Cholesky factor hands to LAPACK (the rest is products)
FACTOR_LEAF = 384


def inverse_cholesky_factor_(A: Tensor) -> Tensor | None:
    """``L^-1`` in place of ``A``, for the lower Cholesky factor ``L`` of ``A`` (``A = L L^T``); None if ``A`` is
    not positive definite (``A`` then holds partial results). float32 on the CPU (:func:`use_onednn`), ``A``
    contiguous [n, n], only its lower triangle read.

    Why not LAPACK (``cholesky`` then a triangular solve against the identity): on AMD CPUs MKL runs both on its
    AVX2 path (``seqcal.backend.onednn``), 43 ms for a 1536-wide Hessian on two threads against 19 ms here. Recursively,
    with ``A = [[A11, .], [A21, A22]]``: ``L11^-1`` from ``A11``; ``L21 = A21 L11^-T``; ``L22^-1`` from the
    Schur complement ``A22 - L21 L21^T``; the lower-left block of the inverse is ``-L22^-1 L21 L11^-1``. Four
    products per level, all on oneDNN; below ``FACTOR_LEAF`` rows LAPACK factors and inverts the block. The same
    flops as LAPACK's two calls (4n^3/3), at oneDNN's rate; float32 rounding of the same order (tests compare
    both with float64). Memory besides ``A``: three quarter blocks of temporaries at the top level, the recursion
    fitting within them ((3/4) n^2 floats, 95 MB at n = 5632), a quarter more where the LAPACK leaves are a
    large part of it (n under ~1000).

    Example:
        >>> A = torch.tensor([[4.0, 2.0], [2.0, 3.0]])
        >>> X = inverse_cholesky_factor_(A.clone())
        >>> torch.allclose(X @ A @ X.T, torch.eye(2), atol=1e-6)
        True
    """
    n = A.shape[0]
    if n <= FACTOR_LEAF:
        L, info = torch.linalg.cholesky_ex(A)
        if info.item() != 0:
            return None
        return A.copy_(
            torch.linalg.solve_triangular(L, torch.eye(n, dtype=A.dtype, device=A.device), upper=False)
        )
    # (matmul_nt(a, b) is a b^T.) The order keeps at most three quarter blocks alive at this level.
    h = n // 2
    inv11 = inverse_cholesky_factor_(A[:h, :h].clone(memory_format=torch.contiguous_format))  # L11^-1 [h, h]
    if inv11 is None:
        return None
    L21 = matmul_nt(A[h:, :h].contiguous(), inv11)  # A21 L11^-T [n - h, h]
    inv11_t = inv11.T.contiguous()
    A[:h, :h] = inv11  # A11 and A21 are read: A takes the result from here on
    A[:h, h:] = 0
    del inv11
    Tt = matmul_nt(inv11_t, L21)  # L11^-T L21^T = (L21 L11^-1)^T [h, n - h]
    del inv11_t
    schur = matmul_nt(L21, L21)  # L21 L21^T
    del L21
    torch.sub(A[h:, h:], schur, out=schur)  # A22 - L21 L21^T [n - h, n - h]: its lower triangle is read
    inv22 = inverse_cholesky_factor_(schur)  # L22^-1 [n - h, n - h], in the Schur complement's memory
    if inv22 is None:
        return None
    A[h:, :h] = matmul_nt(inv22, Tt)  # L22^-1 L21 L11^-1
    A[h:, :h].neg_()
    A[h:, h:] = inv22
    return A
