"""GPTQ's and SparseGPT's inverse factor computed in the Hessian's own memory, its values kept as half a matrix
meanwhile and written back after the solve (``kept_hessian.KeptHessian``, ``gptq._factor_scratch``)."""

from __future__ import annotations

import pytest
import torch

import seqcal.algorithms.gptq_factor as gptq_module
import seqcal.backend.onednn as kernels
from seqcal.algorithms import GPTQNumericalError, gptq_quantize, products
from seqcal.algorithms.hessian import accumulate_hessian, is_symmetric, symmetrize_upper
from seqcal.algorithms.kept_hessian import KeptHessian, kept_bytes
from seqcal.algorithms.sparsegpt import sparsegpt_prune
from test_products import _allocation_peak


def _hessian(n: int, seed: int = 0, symmetric: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(4 * n, n // 2, generator=g) @ torch.randn(n // 2, n, generator=g)
    X += 0.1 * torch.randn(4 * n, n, generator=g)
    H, _ = accumulate_hessian(None, X, 0)
    return symmetrize_upper(H) if symmetric else H


@pytest.mark.parametrize("kind", ["identity", "random", "one cycle", "reversal", "two swaps"])
def test_permute_in_place_equals_the_indexed_copy(kind):
    """Rows and columns permuted in the matrix's memory, a strip of a few rows at a time (``rows=4``), equal
    ``H[perm][:, perm]``: any square matrix, and one known to be symmetric (one transpose fewer)."""
    n = 37
    H = torch.randn(n, n, generator=torch.Generator().manual_seed(1))
    perm = {
        "identity": torch.arange(n),
        "random": torch.randperm(n, generator=torch.Generator().manual_seed(2)),
        "one cycle": torch.roll(torch.arange(n), 5),
        "reversal": torch.arange(n).flip(0),
        "two swaps": torch.tensor([1, 0, *range(2, n - 2), n - 1, n - 2]),
    }[kind]
    for matrix, symmetric in ((H, False), (symmetrize_upper(H.clone()), True)):
        expected = matrix[perm[:, None], perm]
        A = matrix.clone()
        assert gptq_module._permute_(A, perm, symmetric, rows=4).data_ptr() == A.data_ptr()
        assert torch.equal(A, expected)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_transpose_in_place(rows):
    t = torch.randn(37, 37, generator=torch.Generator().manual_seed(3))
    expected = t.T.clone()
    assert torch.equal(gptq_module._transpose_(t, rows=rows), expected)


def test_kept_hessian_is_half_of_a_symmetric_one_and_restores_bit_for_bit():
    H = _hessian(600)
    assert is_symmetric(H)
    before, kept = H.clone(), KeptHessian(H)
    assert kept.symmetric
    kept_bytes = sum(b.nbytes for b in kept.blocks)
    assert kept_bytes < 0.75 * H.nbytes  # n^2 / 2 + n rows / 2 values
    assert torch.equal(kept.restore(H.fill_(float("nan"))), before)


def test_kept_hessian_copies_one_that_is_not_exactly_symmetric():
    """A Hessian whose triangles differ in a bit (a full product's rounding) is kept whole: restored exactly."""
    H = _hessian(300, symmetric=False)
    H[0, 5] = torch.nextafter(H[5, 0], torch.tensor(float("inf")))
    assert not is_symmetric(H)
    before, kept = H.clone(), KeptHessian(H)
    assert not kept.symmetric
    assert torch.equal(kept.restore(H.zero_()), before)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("actorder", [None, "static"])
def test_solves_leave_the_hessian_as_it_was(symmetric, actorder):
    """After GPTQ and SparseGPT the caller's Hessian holds its values again, bit for bit, and a second solve
    with it gives the same result (the next chunk of experts sharing one Hessian, the error measured with it)."""
    n = 256
    H = _hessian(n, symmetric=symmetric)
    W = torch.randn(24, n, generator=torch.Generator().manual_seed(4))
    before = H.clone()
    first = gptq_quantize(W, H, num_bits=4, group_size=64, actorder=actorder)
    assert torch.equal(H, before)
    second = gptq_quantize(W, H, num_bits=4, group_size=64, actorder=actorder)
    assert torch.equal(first.q, second.q) and torch.equal(first.Q, second.Q)
    pruned = sparsegpt_prune(W, H, n=2, m=4)
    assert torch.equal(H, before)
    assert torch.equal(pruned.W, sparsegpt_prune(W, H, n=2, m=4).W)


def test_a_hessian_of_another_dtype_is_not_touched():
    """A bfloat16 Hessian is converted to a float32 working copy: the caller's tensor is only read."""
    H = _hessian(128).bfloat16()
    W = torch.randn(8, 128, generator=torch.Generator().manual_seed(5))
    before = H.clone()
    gptq_quantize(W, H, num_bits=4, group_size=32)
    assert torch.equal(H, before)


def _indefinite(n: int, shift: float) -> torch.Tensor:
    """A symmetric Hessian whose smallest eigenvalue is ``-shift`` times its mean diagonal."""
    H = _hessian(n)
    lowest = torch.linalg.eigvalsh(H.double())[0].item()
    H.diagonal().sub_(lowest + shift * H.diagonal().mean().item())
    return symmetrize_upper(H)


@pytest.mark.parametrize("blocked", [False, True])
def test_a_retry_rebuilds_from_the_kept_values(monkeypatch, blocked):
    """The first Cholesky fails (1% dampening does not make this Hessian positive definite, 10% does): the retry
    rebuilds the permuted Hessian from the kept values, and the caller's Hessian is restored afterwards."""
    monkeypatch.setenv("SEQCAL_CPU_MATMUL", "onednn" if blocked else "native")
    kernels.use_onednn.cache_clear()
    try:
        n = products.FACTOR_LEAF + 40 if blocked else 200
        H = _indefinite(n, 0.03)
        W = torch.randn(16, n, generator=torch.Generator().manual_seed(6))
        before = H.clone()
        result = gptq_quantize(W, H, num_bits=8, group_size=None, strategy="channel", actorder="static")
        assert result.retries == 1 and result.dampening_frac == pytest.approx(0.1)
        assert torch.equal(H, before)
        assert (result.Q - W).abs().max() < 0.1 * W.abs().max()
    finally:
        kernels.use_onednn.cache_clear()


def test_a_failed_solve_still_restores_the_hessian():
    """Every dampening fails: GPTQNumericalError (the modifier falls back to RTN and may solve the next chunk
    with the same Hessian), and the Hessian holds its values again."""
    H = _indefinite(64, 5.0)
    before = H.clone()
    with pytest.raises(GPTQNumericalError):
        gptq_quantize(torch.randn(4, 64), H, num_bits=4, group_size=32, max_retries=1)
    assert torch.equal(H, before)


@pytest.mark.parametrize("path", ["native", "onednn"])
def test_a_solve_holds_less_than_two_hessians_beside_its_own(monkeypatch, path):
    """The whole GPTQ solve of a wide input (a few weight rows) holds, besides the caller's Hessian and weight,
    its kept upper triangle and the factor's temporaries: under 1.8 [n, n] matrices counted from torch's CPU
    allocations, where the copy made before held 2 on LAPACK's path (copy and Cholesky factor) and 1.75 on the
    blocked one (copy and three quarter blocks), plus the permuted copy's gather."""
    monkeypatch.setenv("SEQCAL_CPU_MATMUL", path)
    kernels.use_onednn.cache_clear()
    try:
        n = 1024
        H = _hessian(n)
        W = torch.randn(8, n, generator=torch.Generator().manual_seed(7))
        _, peak, _ = _allocation_peak(
            lambda: gptq_quantize(W, H, num_bits=4, group_size=128, actorder="static")
        )
    finally:
        kernels.use_onednn.cache_clear()
    assert peak / H.nbytes < 1.75, peak / H.nbytes


@pytest.mark.parametrize("n", [100, 256, 600, 1537])
def test_kept_bytes_is_what_a_kept_hessian_holds(n):
    """The memory plan's figure (``kept_bytes``) for the kept upper triangle is what ``KeptHessian`` holds."""
    H = symmetrize_upper(torch.randn(n, n))
    assert KeptHessian(H).nbytes == kept_bytes(n)
