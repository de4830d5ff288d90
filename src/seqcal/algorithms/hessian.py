"""The GPTQ Hessian ``H = 2 X^T X / tokens`` of a layer's inputs: accumulation, and errors measured with it.

Notation as in ``gptq.py``: ``X [tokens, in]`` a layer's inputs, ``W [out, in]`` its weight, ``Q`` the
quantized weight. With ``H``, the mean squared output error of ``Q`` over every calibration token is
``tr((W - Q) H (W - Q)^T) / 2``: no forward pass needed.
"""

from __future__ import annotations

import math
import tempfile
import weakref
from typing import Any

import torch
from torch import Tensor

from seqcal.algorithms.products import add_transposed_products
from seqcal.backend import linear, onednn_applies, onednn_for

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


KEPT_ROWS = 2 * UPPER_BLOCK  # rows per kept block of a Hessian's upper triangle (KeptHessian)
# A CPU Hessian whose kept triangle is this large or larger keeps it in a temporary file, not in RAM: at a 8192-wide
# down_proj that is 134 MB of the process's peak (the solve's largest part after the Hessian itself), for about
# 0.1 s of writing and reading back per solve. Smaller ones (SmolLM2's 1536 inputs: 5 MB) stay in memory.
SPILL_BYTES = 32 << 20


def read_exactly(file: Any, t: Tensor, what: str) -> None:
    """Fill contiguous cpu ``t`` from ``file``'s next ``t.nbytes`` bytes, in its own memory (no temporary).

    Raises:
        OSError: the file ends first (``what``: the values, named in the message).
    """
    if file.readinto(memoryview(t.numpy()).cast("B")) != t.nbytes:
        raise OSError(f"{what} could not be read back from their temporary file")


def kept_bytes(n: int, rows: int = KEPT_ROWS) -> int:
    """Bytes :class:`KeptHessian` keeps of an exactly symmetric float32 [n, n] Hessian."""
    return sum((n - r) * min(rows, n - r) for r in range(0, n, rows)) * 4


def kept_in_ram(n: int, device_type: str = "cpu") -> int:
    """Bytes of host memory :class:`KeptHessian` takes for an [n, n] Hessian on ``device_type``: none when a CPU
    Hessian's kept triangle goes to a file (``SPILL_BYTES``)."""
    kept = kept_bytes(n)
    return 0 if device_type == "cpu" and kept >= SPILL_BYTES else kept


class KeptHessian:
    """A Hessian's values while its memory serves as scratch; :meth:`restore` writes them back, bit for bit.

    What is kept is the upper triangle in copies of row blocks (``H[r:r + rows, r:]``): about half of ``H``'s
    memory (``n^2 / 2 + n rows / 2`` values) where ``H`` is exactly symmetric (``symmetrize_upper`` makes it
    so), a whole copy otherwise. It is kept in host memory: on a GPU that takes nothing from the device, where
    the solve then holds the Hessian and the Cholesky factor only. The copies are pinned and asynchronous on
    CUDA, ordered on the current stream with the kernels that overwrite and later restore ``H``. On the CPU, a
    kept triangle of ``SPILL_BYTES`` or more is written to an unnamed temporary file instead (``spill``), read
    back block by block by :meth:`restore`: the solve's peak then holds the Hessian and the factor's scratch only.

    Example:
        >>> H = symmetrize_upper(accumulate_hessian(None, torch.randn(64, 500), 0)[0])
        >>> before, kept = H.clone(), KeptHessian(H)
        >>> torch.equal(kept.restore(H.fill_(0.0)), before)
        True
    """

    def __init__(self, H: Tensor, rows: int = KEPT_ROWS, spill: bool | None = None) -> None:
        self.symmetric = is_symmetric(H)
        parts = [H[r : r + rows, r:] for r in range(0, H.shape[0], rows)] if self.symmetric else [H]
        self.shapes = [part.shape for part in parts]
        self.nbytes = sum(part.numel() for part in parts) * H.element_size()
        spill = H.device.type == "cpu" and self.nbytes >= SPILL_BYTES if spill is None else spill
        self.file = (
            tempfile.TemporaryFile() if spill else None
        )  # unnamed: gone when closed, or the process ends
        self.blocks: list[Tensor] = []  # the upper triangle's row blocks, or the whole matrix (in RAM)
        if self.file is not None:
            weakref.finalize(self, self.file.close)
            for part in parts:  # a row at a time: a row of a contiguous H is written without a copy
                for row in part:
                    row.numpy().tofile(self.file)
            return
        # one allocation for all of it: large enough to be mapped on its own (backend.host), so that its
        # pages go back to the OS when the solve ends instead of staying in the heap
        flat = _host_empty(sum(p.numel() for p in parts), H)
        asynchronous = H.device.type == "cuda"
        start = 0
        for part in parts:
            block = flat[start : start + part.numel()].view(part.shape)
            self.blocks.append(block.copy_(part, non_blocking=asynchronous))
            start += part.numel()

    def _read_rows(self, H: Tensor) -> Tensor:
        """The spilled values read back straight into ``H``'s rows (no temporary); returns ``H``."""
        self.file.seek(0)
        r = 0
        for shape in self.shapes:
            for row in H[r : r + shape[0], H.shape[1] - shape[1] :]:
                read_exactly(self.file, row, "the Hessian's kept values")
            r += shape[0]
        return H

    def restore(self, H: Tensor) -> Tensor:
        """The kept values into ``H``'s memory (in place), both triangles; returns ``H``."""
        if self.file is not None:
            self._read_rows(H)
        elif not self.symmetric:
            H.copy_(self.blocks[0], non_blocking=H.device.type == "cuda")
        else:
            r = 0
            for block in self.blocks:
                H[r : r + block.shape[0], r:].copy_(block, non_blocking=H.device.type == "cuda")
                r += block.shape[0]
        return symmetrize_upper(H) if self.symmetric else H


def _host_empty(numel: int, like: Tensor) -> Tensor:
    """Host memory for ``numel`` values of ``like``'s dtype: pinned when ``like`` is on CUDA (asynchronous,
    stream-ordered copies)."""
    return torch.empty(numel, dtype=like.dtype, pin_memory=like.device.type == "cuda")


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
