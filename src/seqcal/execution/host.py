"""Host memory the native libraries keep: glibc's free heap, MKL's buffer pool, oneDNN's primitive cache.

A run holds one subgraph's weights at a time, so its resident memory should fall back after each subgraph;
these libraries keep memory the run no longer uses unless told otherwise (measurements in
benchmarks/RESULTS.md, "Mixture-of-experts models").

Example:
    >>> limit_onednn_cache()  # doctest: +SKIP   (first thing in a process: before any bf16 matmul)
    >>> trim_host_memory()  # doctest: +SKIP     (after each subgraph)
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import torch

__all__ = ["ONEDNN_CACHE_CAPACITY", "free_mkl_buffers", "limit_onednn_cache", "trim_host_memory"]

# torch's bf16/fp16 matmuls on the CPU go through ideep and oneDNN, which each cache what they built for a
# matmul shape (1024 entries by default; ~0.25 MB per shape in each). Routed experts get a different token
# count per expert, batch and layer, so nearly every call is a new shape and both caches fill with entries
# never used again: 300 shapes held 160 MB, 18 MB with both capped at 32 (tests/test_host_trim.py). One layer
# of a dense model uses a few dozen shapes, which 32 entries still hold.
ONEDNN_CACHE_CAPACITY = 32
# each cache's variable(s); the first of a tuple is the one set here, the others are older names read too
_CACHE_VARIABLES = (
    ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"),  # oneDNN's primitive cache
    ("LRU_CACHE_CAPACITY",),  # ideep's cache of matmul computations, in front of oneDNN's
)


def trim_host_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``); returns whether it could.

    Why: glibc serves allocations below its mmap threshold (which adapts up to 32 MB: Hessians of 2048-wide
    inputs, activations, weight-sized GPTQ temporaries) from the heap and keeps the pages after ``free``.
    Tensors of different sizes come and go every subgraph, the free space fragments and stays resident:
    measured on the synthetic Llama (benchmarks/RESULTS.md), RSS grew by ~0.4 GB of free heap over the first
    subgraphs. Trimming after each subgraph keeps RSS at what is alive. Elsewhere (musl, macOS, Windows)
    it does nothing.

    MKL's memory manager pools the work buffers of its BLAS/LAPACK calls (the Hessians' products, GPTQ's
    Cholesky factorizations) and never frees them on its own: on the 6-layer synthetic MoE the pool grew the
    heap in use by ~50 MB over the layers, and with it every later subgraph's peak (benchmarks/RESULTS.md).
    They are handed back to the heap first, so that the trim returns them too.

    Example:
        >>> trim_host_memory()  # doctest: +SKIP
        True
    """
    if not sys.platform.startswith("linux"):
        return False
    free_mkl_buffers()
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):  # not glibc
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(malloc_trim(0))


def free_mkl_buffers() -> bool:
    """Free the buffers MKL keeps pooled after BLAS/LAPACK calls (``mkl_free_buffers``); returns whether it could.

    torch's CPU build links MKL into ``libtorch_cpu`` and exports its service functions; other builds
    (OpenBLAS, macOS Accelerate) have no such pool and this does nothing.

    Example:
        >>> free_mkl_buffers()  # doctest: +SKIP
        True
    """
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not library.is_file():
        return False
    try:  # the library is loaded already: dlopen only returns its handle
        free = ctypes.CDLL(str(library)).mkl_serv_free_buffers
    except (OSError, AttributeError):  # not an MKL build
        return False
    free.argtypes, free.restype = [], None
    free()
    return True


def limit_onednn_cache(capacity: int = ONEDNN_CACHE_CAPACITY) -> list[str]:
    """Cap the caches of torch's CPU matmul libraries (ideep, oneDNN) at ``capacity`` entries each, unless the
    process's environment sets them already.

    Both libraries read their variable once, when they build their first entry, and torch exposes no other
    way to set them: this takes effect when called before the process's first bf16/fp16 matmul on the CPU
    (the ``seqcal`` command calls it first thing, ``oneshot`` on entry) and changes nothing after. The
    user's own values always win.

    Args:
        capacity: entries to keep in each cache (see ``ONEDNN_CACHE_CAPACITY`` for the default's reason).

    Returns:
        The variables set here (empty if the environment had them all).

    Example:
        >>> limit_onednn_cache()  # doctest: +SKIP
        ['ONEDNN_PRIMITIVE_CACHE_CAPACITY', 'LRU_CACHE_CAPACITY']
    """
    if capacity < 1:  # ideep does not run with an empty cache
        raise ValueError(f"limit_onednn_cache: capacity must be >= 1, got {capacity}")
    set_here = []
    for names in _CACHE_VARIABLES:
        if not any(name in os.environ for name in names):
            os.environ[names[0]] = str(capacity)
            set_here.append(names[0])
    return set_here
