"""Dense square matrices transformed in their own memory, with temporaries of a strip or a block only: reversed,
transposed, permuted (``P^T H P``), factored (blocked Cholesky) and inverted (a lower triangular factor).

GPTQ's solve (``seqcal.algorithms.gptq_factor``) builds its inverse Hessian factor in the Hessian's memory with
them, so a wide layer's solve holds no second [in, in] matrix (268 MB at a 8192-wide down_proj).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Floats per temporary of the in-place passes below (1 MiB): they run between the Hessian's allocation and the
# Cholesky factor's, the solve's peak, so what they leave on the C heap adds to it. Strips of 256 rows (4 MB at a
# 4096-wide down_proj) and chunks of 4 MB left 26 MiB of free heap resident there (tests/test_host_peak.py).
STRIP_FLOATS = 1 << 18


def strip_rows(n: int) -> int:
    """Rows of an [n, n] matrix per temporary strip of the in-place passes (``STRIP_FLOATS``), at least one."""
    return max(1, STRIP_FLOATS // max(n, 1))


# Order of the diagonal blocks of the factor computed in the Hessian's own memory (:func:`cholesky_in_place_`):
# its temporaries are a few [block, block] matrices (1 MiB each), its products large enough to run near BLAS's rate
FACTOR_BLOCK = 512


def _reverse_(t: Tensor, chunk: int = STRIP_FLOATS) -> Tensor:
    """Reverse the elements of contiguous ``t`` in place, ``chunk`` at a time (no full-size temporary).

    For a contiguous square matrix that is ``P t P`` with P the reversal permutation.
    """
    flat = t.view(-1)
    n = flat.numel()
    for i in range(0, n // 2, chunk):
        j = min(i + chunk, n // 2)
        head = flat[i:j].flip(0)  # [j - i] copy
        flat[i:j] = flat[n - j : n - i].flip(0)
        flat[n - j : n - i] = head
    return t


def _transpose_(t: Tensor, rows: int | None = None) -> Tensor:
    """Transpose contiguous square ``t`` in place, a strip of ``rows`` rows at a time (no full-size temporary;
    None: ``strip_rows``)."""
    n = t.shape[0]
    rows = rows or strip_rows(n)
    for i0 in range(0, n, rows):
        i1 = min(i0 + rows, n)
        block = t[i0:i1, i0:i1]
        block.copy_(block.T.clone())
        right = t[i0:i1, i1:].clone()  # [rows, n - i1]
        t[i0:i1, i1:] = t[i1:, i0:i1].T
        t[i1:, i0:i1] = right.T
    return t


def _permute_(H: Tensor, perm: Tensor, symmetric: bool = False, rows: int | None = None) -> Tensor:
    """``H[perm][:, perm]`` in ``H``'s memory (contiguous, square), with temporaries of ``rows`` rows (None:
    ``strip_rows``).

    ``P^T H P = ((H^T P)^T) P``: columns are permuted a strip of rows at a time (a gather each), and a transpose in
    place turns permuted columns into permuted rows; ``symmetric`` (``H == H^T`` exactly) skips the first
    transpose. A constant number of passes, however many cycles ``perm`` has.
    """
    rows = rows or strip_rows(H.shape[0])
    if not symmetric:
        _transpose_(H, rows)  # H^T
    _permute_columns_(H, perm, rows)  # H^T P
    _transpose_(H, rows)  # P^T H
    return _permute_columns_(H, perm, rows)  # P^T H P


def _permute_columns_(H: Tensor, perm: Tensor, rows: int) -> Tensor:
    """``H[:, perm]`` in ``H``'s memory, a strip of ``rows`` rows at a time."""
    for r in range(0, H.shape[0], rows):
        H[r : r + rows] = H[r : r + rows].index_select(1, perm)
    return H


def cholesky_in_place_(A: Tensor, block: int = FACTOR_BLOCK) -> Tensor | None:
    """The lower Cholesky factor ``L`` of ``A`` (``A = L L^T``) in ``A``'s lower triangle, its upper triangle
    zeroed; None if ``A`` is not positive definite (``A`` then holds partial results). ``A``: contiguous [n, n],
    only its lower triangle read.

    Right-looking and blocked: LAPACK factors each diagonal block (a copy of ``block`` rows), the panel below it
    is solved against it ``block`` rows at a time, and the trailing lower triangle takes the panel's product in
    place, block row by block row (``addmm_`` on views of ``A``): temporaries of ``[block, block]`` only.

    Example:
        >>> A = torch.tensor([[4.0, 2.0], [2.0, 3.0]])
        >>> torch.allclose(cholesky_in_place_(A.clone(), block=1), torch.linalg.cholesky(A))
        True
    """
    n = A.shape[0]
    for k0 in range(0, n, block):
        k1 = min(k0 + block, n)
        L, info = torch.linalg.cholesky_ex(A[k0:k1, k0:k1])  # [b, b], a copy
        if info.item() != 0:
            return None
        A[k0:k1, k0:k1] = L
        for r0 in range(k1, n, block):  # L_ik = A_ik L_kk^-T
            rows = A[r0 : r0 + block, k0:k1]
            rows.copy_(torch.linalg.solve_triangular(L.T, rows, upper=True, left=False))
        for j0 in range(k1, n, block):  # A_jj' -= L_jk L_j'k^T, on and below the diagonal blocks
            j1 = min(j0 + block, n)
            A[j0:j1, k1:j1].addmm_(A[j0:j1, k0:k1], A[k1:j1, k0:k1].T, alpha=-1)
    return A.tril_()


def lower_inverse_in_place_(L: Tensor, block: int = FACTOR_BLOCK) -> Tensor:
    """``L^-1`` in ``L``'s memory for a lower triangular ``L`` (its upper triangle zero), blocked, with
    temporaries of ``[block, block]`` only.

    Block columns from the last: with ``X = L^-1`` known below and right of block ``j``, ``X_jj = L_jj^-1`` and
    ``X_ij = -(sum_k X_ik L_kj) X_jj`` for the blocks ``i`` below, computed from the bottom block up, so that the
    ``L_kj`` a block reads are not yet overwritten.

    Example:
        >>> L = torch.tensor([[2.0, 0.0], [1.0, 4.0]])
        >>> torch.allclose(lower_inverse_in_place_(L.clone(), block=1), torch.linalg.inv(L))
        True
    """
    n = L.shape[0]
    for j0 in reversed(range(0, n, block)):
        j1 = min(j0 + block, n)
        eye = torch.eye(j1 - j0, dtype=L.dtype, device=L.device)
        inverse = torch.linalg.solve_triangular(L[j0:j1, j0:j1], eye, upper=False)  # X_jj
        for r0 in reversed(range(j1, n, block)):
            r1 = min(r0 + block, n)
            below = L[r0:r1, j1:r1] @ L[j1:r1, j0:j1]  # X_i,j1: (lower triangular) times L_j1:, j
            L[r0:r1, j0:j1] = torch.mm(below, inverse).neg_()
        L[j0:j1, j0:j1] = inverse
    return L
