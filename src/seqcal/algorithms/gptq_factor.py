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
from seqcal.algorithms.in_place import (
    FACTOR_BLOCK,
    _permute_,
    _reverse_,
    _transpose_,
    cholesky_in_place_,
    lower_inverse_in_place_,
)
from seqcal.algorithms.kept_hessian import KeptHessian
from seqcal.backend import onednn_applies
from seqcal.backend.host import free_mkl_buffers, trim_host_memory


class GPTQNumericalError(RuntimeError):
    """The Hessian could not be inverted even after extra dampening; fall back to RTN for this module."""


# MKL's work buffers for the Cholesky factor and the triangular solve beside the [n, n] factor: LAPACK_PANEL floats
# per input column and LAPACK_CODE bytes, the envelope of RSS measured on 1 and 2 threads (2-core x86: 1024 inputs
# 7.4 MiB, 2048: 11.4, 4096: 19.5, 8192: 35.6; benchmarks/RESULTS.md)
LAPACK_PANEL = 1024
LAPACK_CODE = 4 << 20


# What it holds at most beside the Hessian, in [block, block] float32 blocks, and LAPACK_PANEL / 2 floats per input
# column: its temporaries and MKL's buffers for the blocks' products, the envelope of RSS measured on 2 threads
# (2-core x86: 2048 inputs 19.6 MiB, 4096: 22.1, 8192: 29.6; torch's own allocations 4 blocks at 2048)
IN_PLACE_BLOCKS = 16
# CPU Hessians this wide or wider are factored in their own memory whatever the run asks (``in_place``): no second
# [in, in] matrix beside the Hessian (268 MB at a 8192-wide down_proj), and no slower than LAPACK's there (2-core x86,
# 2 threads, best of two: 4096 inputs 0.42 s against 0.76 s, 5632 0.91 s against 1.58 s, 8192 2.51 s against 4.35 s;
# docs/notes/journal.md). Narrower ones keep LAPACK's factor: SmolLM2's checkpoints were recorded with its bits.
IN_PLACE_FROM = 4096


def factors_in_place(n: int, device_on_host: bool, in_place: bool = False) -> bool:
    """Whether the inverse factor of an [n, n] Hessian is computed in its own memory (``in_place.cholesky_in_place_``):
    on the host, wider than one block, when the run asks (``in_place``) or from ``IN_PLACE_FROM`` inputs."""
    return device_on_host and n > FACTOR_BLOCK and (in_place or n >= IN_PLACE_FROM)


def factor_bytes(n: int, device_on_host: bool = True, in_place: bool = False) -> int:
    """Bytes the inverse factor of an [n, n] Hessian allocates beside the Hessian (its own memory the working copy).

    LAPACK's (or cuSOLVER's) Cholesky factor, an [n, n] float32 matrix, and on the host MKL's work buffers
    (``LAPACK_PANEL``; on a GPU they are the device's); the blocked factor of ``products`` takes three quarters
    of the matrix: this bounds it too. In place (:func:`factors_in_place`: CPU solves from ``IN_PLACE_FROM`` inputs,
    or wider than ``FACTOR_BLOCK`` where a host budget asks, ``in_place``): a few diagonal blocks, whatever ``n``.
    """
    if factors_in_place(n, device_on_host, in_place):
        return IN_PLACE_BLOCKS * FACTOR_BLOCK * FACTOR_BLOCK * 4 + n * LAPACK_PANEL // 2 * 4
    return n * n * 4 + (n * LAPACK_PANEL * 4 + LAPACK_CODE if device_on_host else 0)


def _processing_hessian_(H: Tensor, perm: Tensor | None, dead: Tensor, symmetric: bool = False) -> Tensor:
    """``H`` float32 in processing order, dead inputs' diagonal set to 1, in ``H``'s memory."""
    if perm is not None:
        _permute_(H, perm, symmetric)
    H.diagonal()[dead if perm is None else dead[perm]] = 1
    return H


@contextlib.contextmanager
def _factor_scratch(H32: Tensor, H: Tensor) -> Iterator[KeptHessian]:
    """``H32``'s memory as the inverse factor's working copy (:func:`_inverse_hessian_factor`); yields its values,
    kept meanwhile (``kept_hessian.KeptHessian``: the upper triangle, half an [in, in] matrix, of a symmetric one).

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
    damp_growth: float, in_place: bool = False,
) -> Iterator[Factor]:  # fmt: skip
    """The dampened inverse factor of ``H`` in processing order, for GPTQ's and GPTAQ's column loops.

    ``H`` as float32 on ``device`` (no copy when it already is: its memory is then the factor's scratch, and its
    values are written back, bit for bit, when the block ends); dead inputs' diagonal 1; columns ordered by
    descending ``diag(H)`` for ``actorder`` ``"weight"`` or ``"group"``; dampening raised ``damp_growth``x per
    failed Cholesky, up to ``max_retries`` times. The factor must not be read after the block. ``in_place``: on
    the CPU and wider than ``FACTOR_BLOCK``, the factor of ``in_place.cholesky_in_place_`` (no second [in, in] matrix;
    equal to LAPACK's up to float32 rounding, not bit for bit: for host budgets that need it).

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
            H32, kept, perm, dead, dampening_frac, max_retries, damp_growth, in_place
        )
        # MKL pools the factor's work buffers (56 MiB at 8192 inputs, the blocked factor): handed back to the OS
        # before the column loop's copies are made beside them
        if Hinv.device.type == "cpu":
            trim_host_memory()
        yield Factor(Hinv, dead, perm, frac, retries)


def _inverse_hessian_factor(
    H: Tensor,
    kept: KeptHessian,
    perm: Tensor | None,
    dead: Tensor,
    dampening_frac: float,
    max_retries: int,
    damp_growth: float,
    in_place: bool = False,
) -> tuple[Tensor, float, int]:
    """Upper Cholesky factor of ``(Hp + damp I)^-1`` in ``H``'s memory, raising dampening ``damp_growth``x per
    failure.

    ``Hp`` is ``H`` [in, in] float32 (contiguous) permuted by ``perm`` with the ``dead`` inputs' diagonal set to
    1. ``H`` is overwritten: it becomes ``Hp``, then the factor; ``kept`` holds its values
    (:func:`_factor_scratch`), from which a retry rebuilds ``Hp`` and replays the dampening steps, so the values
    are those of dampening one copy step by step. Memory besides ``H`` and ``kept``: the Cholesky factor (one
    [in, in] matrix), or with the blocked factor of ``products.inverse_cholesky_factor_`` (float32 CPU solves
    wider than ``FACTOR_LEAF`` where oneDNN is on) three quarters of one, or with ``in_place`` (CPU) a few
    [FACTOR_BLOCK, FACTOR_BLOCK] blocks (``in_place.cholesky_in_place_``). Building the working copy in ``H``'s
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
        if factors_in_place(n, Hr.device.type == "cpu", in_place):  # narrower than a block: LAPACK's own
            method = "in_place"
        elif onednn_applies(Hr, Hr) and n > products.FACTOR_LEAF:  # float32 CPU: on oneDNN
            method = "blocked"
        else:
            method = "lapack"
        if Hr.device.type == "cpu":  # the factor, the solve's peak, on a trimmed heap: what the passes above
            trim_host_memory()  # left free on it (a few MiB at 4096 inputs) is not resident beside it
        inv = _lower_inverse(Hr, method)  # Lr^-1 in H's memory, or None when the Cholesky failed
        del Hr
        if inv is None:
            continue
        # P Lr^-1 P, row-major, in H's memory. The blocked factors are row-major already: reversed in place.
        # LAPACK's is column-major: reversing its memory in place reverses it too (still column-major), and
        # the in-place transpose makes it row-major (contiguous() would make a second [in, in] matrix)
        Hinv = _transpose_(_reverse_(inv.t())) if method == "lapack" else _reverse_(inv)
        del inv
        if torch.isfinite(Hinv.sum()) and bool((Hinv.diagonal() > 0).all()):
            return Hinv, frac, retry
    raise GPTQNumericalError(
        f"Cholesky of the Hessian failed up to dampening_frac={applied:g} "
        f"({max_retries} retries x{damp_growth:g}); raise dampening_frac, add calibration samples, "
        "or quantize this module with RTN"
    )


def _lower_inverse(Hr: Tensor, method: str) -> Tensor | None:
    """``Lr^-1`` for the lower Cholesky factor ``Lr`` of ``Hr``, or None if ``Hr`` is not positive definite.

    ``method`` ``"blocked"``: ``products.inverse_cholesky_factor_`` in ``Hr``'s memory (row-major);
    ``"in_place"``: ``in_place.cholesky_in_place_`` then ``lower_inverse_in_place_`` (row-major). ``"lapack"``:
    LAPACK's (or cuSOLVER's) Cholesky, then ``Lr^-1`` in place of an identity written into ``Hr``'s memory and
    laid out column-major, as solve_triangular lays out its own output: same call, same values, one [in, in]
    matrix (the factor ``Lr``) besides ``Hr``.
    """
    if method == "blocked":
        return products.inverse_cholesky_factor_(Hr)
    if method == "in_place":
        return None if cholesky_in_place_(Hr) is None else lower_inverse_in_place_(Hr)
    Lr, info = torch.linalg.cholesky_ex(Hr)
    if info.item() != 0:
        return None
    if Hr.device.type == "cpu":
        free_mkl_buffers()  # the Cholesky's pooled work buffers, not the solve's: 2-5 MiB off the peak
    inv = Hr.zero_().fill_diagonal_(1).t()  # Hr is spent: the identity in its memory, column-major
    return torch.linalg.solve_triangular(Lr, inv, upper=False, out=inv)


def _order(H: Tensor, dead: Tensor, actorder: str | None) -> Tensor | None:
    """Processing order of the input columns: most active first (descending diag(H)), or None."""
    if actorder is None:
        return None
    diag = H.diagonal().clone()  # [in]
    diag[dead] = 1
    return torch.argsort(diag, descending=True, stable=True)
