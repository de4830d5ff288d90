"""A quantized weight's output error measured with its inputs' Hessian, with no forward pass.

Notation as in ``gptq.py``: ``X [tokens, in]`` a layer's inputs, ``W [out, in]`` its weight, ``Q`` the
quantized weight, ``H = 2 X^T X / tokens`` (``seqcal.algorithms.hessian``). The mean squared output error of
``Q`` over every calibration token is ``tr((W - Q) H (W - Q)^T) / 2``: quadratic forms of the rows of
``W - Q``, taken a chunk of rows at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqcal.algorithms.hessian import UPPER_BLOCK
from seqcal.backend import linear, onednn_applies


def quadratic_forms(A: Tensor, H: Tensor) -> Tensor:
    """``a_r^T H a_r`` for every row ``a_r`` of ``A`` with ``H`` symmetric, from its upper blocks only.

    On the CPU, column block ``J`` of ``UPPER_BLOCK`` columns adds ``A_J . (A_J H_JJ + 2 A_<J H_<J,J)``: the
    products cover the upper triangle and the diagonal blocks, ``(k + 1) / 2k`` of the flops of ``(A H) * A``
    (0.6x the time for SmolLM2's 576 and 1536 features on one CPU thread). Same sums in another order: equal
    up to float rounding. On a GPU one full product is cheaper than ``k`` small ones (as for
    :func:`accumulate_hessian`'s ``upper``), so it is ``((A H) * A).sum(1)`` there, and so it is where the CPU's
    float32 products go through oneDNN (``products``: about 0.45x the time of the full product on MKL).

    Args:
        A: ``[rows, in]`` in H's dtype.
        H: ``[in, in]`` symmetric (both triangles filled; only the upper blocks are read).

    Returns:
        ``[rows]`` in H's dtype.

    Example:
        >>> H = torch.tensor([[2.0, 1.0], [1.0, 3.0]])
        >>> quadratic_forms(torch.tensor([[1.0, 1.0], [1.0, 0.0]]), H)
        tensor([7., 2.])
    """
    if H.device.type != "cpu":
        return ((A @ H) * A).sum(dim=1)
    if onednn_applies(A, H):  # one full product on oneDNN beats MKL's upper blocks (0.45x vs 0.6x)
        return (linear(A, H) * A).sum(dim=1)  # A H^T = A H: H is symmetric
    d = H.shape[0]
    out = torch.zeros(A.shape[0], dtype=H.dtype, device=H.device)
    for j0 in range(0, d, UPPER_BLOCK):
        j1 = min(j0 + UPPER_BLOCK, d)
        AJ = A[:, j0:j1]
        P = AJ @ H[j0:j1, j0:j1]  # [rows, j1 - j0]
        if j0:
            P.addmm_(A[:, :j0], H[:j0, j0:j1], alpha=2)  # the block's column above the diagonal, twice
        out += (AJ * P).sum(dim=1)
    return out


# Values per row chunk of relative_output_error: 256 rows up to SmolLM2's 1536 inputs, fewer for wider ones, whose
# chunk's temporaries (about six [rows, in] float32 matrices) would otherwise reach 50 MB at a 8192-wide down_proj,
# above what the memory plan counts for the end of a solve
ERROR_CHUNK_FLOATS = 256 * 1536


def relative_output_error(W: Tensor, Q: Tensor, H: Tensor, rows: int | None = None) -> float:
    """``||(Q - W) X^T|| / ||W X^T||`` over every calibration input row of X, from its Hessian alone.

    With ``H = 2/n X^T X`` (:func:`accumulate_hessian`), ``||A X^T||_F^2 = n/2 tr(A H A^T)``; the scale
    cancels in the ratio. Per weight, quadratic forms of its rows instead of a forward pass
    (:func:`quadratic_forms`: half an [out, in] x [in, in] product each for the error and the weight), taken
    ``rows`` output rows at a time: whole-weight float32 temporaries would set the memory peak of a wide
    layer (4 x 46 MB for a [5632, 2048] gate_proj), chunks cost about 6 x rows x in floats.

    Args:
        W: original weight ``[out, in]``.
        Q: quantized (dequantized) weight ``[out, in]``.
        H: Hessian ``[in, in]`` of the inputs, float32.
        rows: output rows per chunk (None: 256, fewer past ``ERROR_CHUNK_FLOATS`` values).

    Returns:
        The relative error of the module's output (0 when ``Q == W``).

    Example:
        >>> from seqcal.algorithms.hessian import accumulate_hessian
        >>> X = torch.randn(64, 8); H, _ = accumulate_hessian(None, X, 0)
        >>> W = torch.randn(4, 8); round(relative_output_error(W, 1.1 * W, H), 4)
        0.1
    """
    rows = rows or error_rows(W.shape[1])
    error = OutputError(H)
    for r in range(0, W.shape[0], rows):
        error.add(W[r : r + rows], Q[r : r + rows])
    return error.value()


def error_rows(n_in: int) -> int:
    """Output rows per chunk of :func:`relative_output_error` for ``n_in`` inputs (``ERROR_CHUNK_FLOATS``)."""
    return max(16, min(256, ERROR_CHUNK_FLOATS // max(n_in, 1)))


class OutputError:
    """:func:`relative_output_error` summed over chunks of rows as they come (the same sums in the same order),
    for a caller that overwrites each chunk of W once its error is taken (``gptq_quantize(overwrite=True)``)."""

    def __init__(self, H: Tensor) -> None:
        self.H = H
        self.num = torch.zeros((), dtype=H.dtype, device=H.device)
        self.den = torch.zeros((), dtype=H.dtype, device=H.device)

    def add(self, W: Tensor, Q: Tensor) -> None:
        """Adds the rows ``W [rows, in]`` and their quantized values ``Q``."""
        w = W.to(self.H.dtype)  # [rows, in]
        d = Q.to(self.H.dtype) - w  # [rows, in]
        forms = quadratic_forms(torch.cat([d, w]), self.H)  # [2 rows]: the error's rows, then the weight's
        self.num += forms[: d.shape[0]].sum()
        self.den += forms[d.shape[0] :].sum()

    def value(self) -> float:
        """The relative error of the rows added so far (0 when every ``Q == W``)."""
        return (self.num.clamp_min(0) / self.den.clamp_min(torch.finfo(self.H.dtype).tiny)).sqrt().item()
