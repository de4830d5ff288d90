"""Host memory between subgraphs: ``trim_host_memory`` returns what the solves left pooled, not only glibc's
free heap, so the heap in use does not grow subgraph after subgraph."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest
import torch

from seqcal.execution.weights import free_mkl_buffers

# In a fresh process: the heap in use (glibc's mallinfo2) before and after GPTQ-sized Cholesky
# factorizations and Hessian products, once everything they returned is freed and the host memory trimmed.
SCRIPT = textwrap.dedent("""
    import ctypes
    import torch
    from seqcal.execution.weights import trim_host_memory

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info

    def in_use():
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    trim_host_memory()
    before = in_use()
    for n in (1024, 512, 768, 1024):  # the input widths of one layer's projections
        X = torch.randn(4 * n, n)
        H = X.T @ X + n * torch.eye(n)
        U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
        del X, H, U
    trim_host_memory()
    print(in_use() - before)
""")


def _glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc_with_mallinfo2(), reason="glibc only")
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")
def test_trim_returns_the_buffers_mkl_pooled_for_the_solves() -> None:
    """MKL's memory manager kept ~30 MB of work buffers after these solves; trimming now frees them."""
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    grown = int(run.stdout.split()[-1])
    assert grown < 4 * 2**20, f"the heap in use grew by {grown / 2**20:.1f} MiB over the solves"


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")
def test_free_mkl_buffers_finds_mkl_in_torch() -> None:
    assert free_mkl_buffers() is True
