"""GPTQ's inverse Hessian factor in processing order (paper, Sec. 3.4 / Alg. 1): the Hessian permuted in place,
dead columns fixed, dampened and factored, in the Hessian's own memory where it can be (pure tensor functions).

``gptq_quantize`` (``seqcal.algorithms.gptq``) and ``gptaq_quantize`` (``seqcal.algorithms.gptaq``) solve with
the factor :func:`processing_factor` yields (:func:`_inverse_hessian_factor` inside :func:`_factor_scratch`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

import seqcal.algorithms.products as products
from seqcal.algorithms.hessian import KeptHessian
from seqcal.backend import onednn_applies


class GPTQNumericalError(RuntimeError):
    """The Hessian could not be inverted even after extra dampening; fall back to RTN for this module."""


def _reverse_(t: Tensor, chunk: int = 1 << 20) -> Tensor:
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


def _transpose_(t: Tensor, rows: int = 256) -> Tensor:
    """Transpose contiguous square ``t`` in place, a strip of ``rows`` rows at a time (no full-size temporary)."""
    n = t.shape[0]
    for i0 in range(0, n, rows):
        i1 = min(i0 + rows, n)
        block = t[i0:i1, i0:i1]
        block.copy_(block.T.clone())
        right = t[i0:i1, i1:].clone()  # [rows, n - i1]
        t[i0:i1, i1:] = t[i1:, i0:i1].T
        t[i1:, i0:i1] = right.T
    return t


def _permute_(H: Tensor, perm: Tensor, symmetric: bool = False, rows: int = 256) -> Tensor:
    """``H[perm][:, perm]`` in ``H``'s memory (contiguous, square), with temporaries of ``rows`` rows.

    ``P^T H P = ((H^T P)^T) P``: columns are permuted a strip of rows at a time (a gather each), and a transpose in
    place turns permuted columns into permuted rows; ``symmetric`` (``H == H^T`` exactly) skips the first
    transpose. A constant number of passes, however many cycles ``perm`` has.
    """
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


def _processing_hessian_(H: Tensor, perm: Tensor | None, dead: Tensor, symmetric: bool = False) -> Tensor:
    """``H`` float32 in processing order, dead inputs' diagonal set to 1, in ``H``'s memory."""
    if perm is not None:
        _permute_(H, perm, symmetric)
    H.diagonal()[dead if perm is None else dead[perm]] = 1
    return H


@contextlib.contextmanager
def _factor_scratch(H32: Tensor, H: Tensor) -> Iterator[KeptHessian]:
    """``H32``'s memory as the inverse factor's working copy (:func:`_inverse_hessian_factor`); yields its values,
    kept meanwhile (``hessian.KeptHessian``: the upper triangle, half an [in, in] matrix, of a symmetric one).

    When ``H32`` is ``H``'s memory (a float32 Hessian on the weight's device: the usual case), ``H``'s values are
    written back on exit, bit for bit, for the caller's later reads (errors measured with ``H``, the next chunk
    of a shared Hessian). The factor lives in that memory until then: it must not be read after the block.
    """
    kept = KeptHessian(H32)
    try:
        yield kept
    finally:
        if H32.data_ptr() == H.data_ptr():
            kept.restore(H32)


@dataclass(frozen=True)
class Factor:
    """What :func:`processing_factor` yields.

    Attributes:
        Hinv: upper Cholesky factor of ``(Hp + damp I)^-1`` [in, in] float32, in processing order.
        dead: bool [in], inputs never seen (``H_ii == 0``; their diagonal was set to 1).
        perm: the processing order (``actorder``), or None for the original one.
        dampening_frac: the dampening fraction that made the Cholesky succeed.
        retries: how many times dampening had to be increased.
    """

    Hinv: Tensor
    dead: Tensor
    perm: Tensor | None
    dampening_frac: float
    retries: int


@contextlib.contextmanager
def processing_factor(
    H: Tensor, device: torch.device, actorder: str | None, dampening_frac: float, max_retries: int,
    damp_growth: float,
) -> Iterator[Factor]:  # fmt: skip
    """The dampened inverse factor of ``H`` in processing order, for GPTQ's and GPTAQ's column loops.

    ``H`` as float32 on ``device`` (no copy when it already is: its memory is then the factor's scratch, and its
    values are written back, bit for bit, when the block ends); dead inputs' diagonal 1; columns ordered by
    descending ``diag(H)`` for ``actorder`` ``"weight"`` or ``"group"``; dampening raised ``damp_growth``x per
    failed Cholesky, up to ``max_retries`` times. The factor must not be read after the block.

    Raises:
        GPTQNumericalError: ``H`` has NaN or inf, or no dampening made it positive definite.

    Example:
        >>> with processing_factor(torch.eye(4) * 2, torch.device("cpu"), None, 0.01, 3, 10.0) as f:
        ...     f.Hinv.shape, f.retries
        (torch.Size([4, 4]), 0)
    """
    H32 = H.detach().to(device=device, dtype=torch.float32).contiguous()  # [in, in]
    dead = H32.diagonal() == 0  # inputs never seen: H_ii = 1 (and the solvers zero W[:, i])
    perm = _order(H32, dead, actorder)
    with _factor_scratch(H32, H) as kept:
        Hinv, frac, retries = _inverse_hessian_factor(
            H32, kept, perm, dead, dampening_frac, max_retries, damp_growth
        )
        yield Factor(Hinv, dead, perm, frac, retries)


def _inverse_hessian_factor(
    H: Tensor,
    kept: KeptHessian,
    perm: Tensor | None,
    dead: Tensor,
    dampening_frac: float,
    max_retries: int,
    damp_growth: float,
) -> tuple[Tensor, float, int]:
    """Upper Cholesky factor of ``(Hp + damp I)^-1`` in ``H``'s memory, raising dampening ``damp_growth``x per
    failure.

    ``Hp`` is ``H`` [in, in] float32 (contiguous) permuted by ``perm`` with the ``dead`` inputs' diagonal set to
    1. ``H`` is overwritten: it becomes ``Hp``, then the factor; ``kept`` holds its values
    (:func:`_factor_scratch`), from which a retry rebuilds ``Hp`` and replays the dampening steps, so the values
    are those of dampening one copy step by step. Memory besides ``H`` and ``kept``: the Cholesky factor (one
    [in, in] matrix), or with the blocked factor of ``products.inverse_cholesky_factor_`` (float32 CPU solves
    wider than ``FACTOR_LEAF`` where oneDNN is on) three quarters of one. Building the working copy in ``H``'s
    memory instead of a new [in, in] matrix bounds a layer's peak for wide inputs (down_proj: 5632^2 floats =
    127 MB each).
    """
    n = H.shape[0]
    steps: list[float] = []  # diagonal increments so far; each attempt applies them all, in order
    applied = mean_diag = 0.0
    for retry in range(max_retries + 1):
        Hp = _processing_hessian_(H if retry == 0 else kept.restore(H), perm, dead, kept.symmetric)
        if retry == 0:
            if not torch.isfinite(Hp.sum()):  # one reduction: any NaN/inf makes the sum non-finite
                raise GPTQNumericalError(
                    "Hessian contains NaN or inf (inputs overflowed?); use RTN for this module"
                )
            mean_diag = Hp.diagonal().mean().item()
        frac = dampening_frac * damp_growth**retry
        steps.append((frac - applied) * mean_diag)
        applied = frac
        # The upper Cholesky factor U of H^-1 (H^-1 = U^T U) without forming H^-1: with P the reversal
        # permutation and P H P = Lr Lr^T, U = P Lr^-1 P. One Cholesky and one triangular solve.
        Hr = _reverse_(Hp)  # P Hp P, in place
        del Hp
        for step in steps:
            Hr.diagonal().add_(step)  # the diagonal of P Hp P is Hp's, reversed: same values, same adds
        blocked = onednn_applies(Hr, Hr) and n > products.FACTOR_LEAF  # float32 CPU: on oneDNN
        inv = _lower_inverse(Hr, blocked)  # Lr^-1 in H's memory, or None when the Cholesky failed
        del Hr
        if inv is None:
            continue
        # P Lr^-1 P, row-major, in H's memory. The blocked factor is row-major already: reversed in place.
        # LAPACK's is column-major: reversing its memory in place reverses it too (still column-major), and
        # the in-place transpose makes it row-major (contiguous() would make a second [in, in] matrix)
        Hinv = _reverse_(inv) if blocked else _transpose_(_reverse_(inv.t()))
        del inv
        if torch.isfinite(Hinv.sum()) and bool((Hinv.diagonal() > 0).all()):
            return Hinv, frac, retry
    raise GPTQNumericalError(
        f"Cholesky of the Hessian failed up to dampening_frac={applied:g} "
        f"({max_retries} retries x{damp_growth:g}); raise dampening_frac, add calibration samples, "
        "or quantize this module with RTN"
    )


def _lower_inverse(Hr: Tensor, blocked: bool) -> Tensor | None:
    """``Lr^-1`` for the lower Cholesky factor ``Lr`` of ``Hr``, or None if ``Hr`` is not positive definite.

    ``blocked``: ``products.inverse_cholesky_factor_`` in ``Hr``'s memory (row-major). Otherwise LAPACK's (or
    cuSOLVER's) Cholesky, then ``Lr^-1`` in place of an identity written into ``Hr``'s memory and laid out
    column-major, as solve_triangular lays out its own output: same call, same values, one [in, in] matrix
    (the factor ``Lr``) besides ``Hr``.
    """
    if blocked:
        return products.inverse_cholesky_factor_(Hr)
    Lr, info = torch.linalg.cholesky_ex(Hr)
    if info.item() != 0:
        return None
    inv = Hr.zero_().fill_diagonal_(1).t()  # Hr is spent: the identity in its memory, column-major
    return torch.linalg.solve_triangular(Lr, inv, upper=False, out=inv)


def _order(H: Tensor, dead: Tensor, actorder: str | None) -> Tensor | None:
    """Processing order of the input columns: most active first (descending diag(H)), or None."""
    if actorder is None:
        return None
    diag = H.diagonal().clone()  # [in]
    diag[dead] = 1
    return torch.argsort(diag, descending=True, stable=True)
