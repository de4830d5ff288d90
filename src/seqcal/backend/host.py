"""Host memory the native libraries keep: glibc's free heap, MKL's buffer pool, oneDNN's primitive cache.

A run holds one subgraph's weights at a time, so its resident memory should fall back after each subgraph;
these libraries keep memory the run no longer uses unless told otherwise (measurements in
benchmarks/RESULTS.md, "Mixture-of-experts models").

Who sets what: these are settings of the whole process, so only their owner changes them for good. The
``seqcal`` command's ``main`` caps oneDNN's caches and fixes glibc's thresholds first thing. ``oneshot``, a
library call, caps the caches for its own duration (``onednn_cache_limited``: the variables it set are gone
when it returns) and leaves glibc's thresholds alone: a ``mallopt`` cannot be undone (glibc stops adapting
its thresholds for good), so a Python caller who wants them calls ``map_large_allocations`` itself. Every
``mallopt`` goes through ``_mallopt`` here (tests/test_backend.py checks that ``oneshot`` makes none).

Example:
    >>> limit_onednn_cache()  # doctest: +SKIP   (first thing in a process: before any bf16 matmul)
    >>> map_large_allocations()  # doctest: +SKIP   (first thing in a process)
    >>> trim_host_memory()  # doctest: +SKIP     (after each subgraph)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = [
    "MMAP_THRESHOLD",
    "ONEDNN_CACHE_CAPACITY",
    "free_mkl_buffers",
    "limit_onednn_cache",
    "map_large_allocations",
    "onednn_cache_limited",
    "trim_host_memory",
]

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

# glibc's mmap threshold for a run, in bytes: blocks this large or larger get their own mapping, returned to the
# OS the moment they are freed. glibc's own threshold starts at 128 KB and rises with each mapped block freed, up
# to 32 MB: after the first subgraphs the solves' Hessian-sized temporaries (the inverse factor of a 5632-wide
# down_proj works in 32 MB quarter blocks) come from the heap, where blocks of changing sizes fragment it and stay
# resident. Fixed at 16 MB, the 8-layer synthetic 1.64B Llama peaked at 0.931 GB instead of 0.957 (4 MB: 0.919,
# 8 MB: 0.924; benchmarks/RESULTS.md), and SmolLM2's per-batch tensors (at most 3 MB at 512 tokens) stay on the
# heap: a mapped block pays its page faults on every allocation.
MMAP_THRESHOLD = 16 << 20
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# the environment's ways to set glibc's thresholds: the user's setting wins
_MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def map_large_allocations(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (and its trim threshold at twice that) for this
    process, unless the environment sets either; returns whether it set them.

    Why: see ``MMAP_THRESHOLD``. Fixing the mmap threshold also stops glibc's own raising of the trim threshold
    (the free memory at the top of the heap it keeps), which would otherwise stay at 128 KB and return the
    heap's top after nearly every free; twice the mmap threshold is where glibc's dynamic rule would put it.
    Does nothing outside glibc (musl, macOS, Windows) or when ``GLIBC_TUNABLES`` / ``MALLOC_*_THRESHOLD_``
    set glibc's thresholds already.

    Example:
        >>> map_large_allocations()  # doctest: +SKIP
        True
    """
    if threshold < 1:
        raise ValueError(f"map_large_allocations: threshold must be >= 1 byte, got {threshold}")
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if not sys.platform.startswith("linux") or any(name in os.environ for name in _MALLOC_VARIABLES):
        return False
    if any(f"glibc.malloc.{name}" in tunables for name in ("mmap_threshold", "trim_threshold")):
        return False
    return _mallopt(_M_MMAP_THRESHOLD, threshold) and _mallopt(_M_TRIM_THRESHOLD, 2 * threshold)


def _mallopt(parameter: int, value: int) -> bool:
    """glibc's ``mallopt(parameter, value)`` in this process; False outside glibc or when glibc refuses."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(parameter, value))


def trim_host_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``); returns whether it could.

    Why: glibc serves allocations below its mmap threshold (16 MB in a run, ``map_large_allocations``; else it
    adapts up to 32 MB: Hessians of 2048-wide inputs, activations, weight-sized GPTQ temporaries) from the heap
    and keeps the pages after ``free``.
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


@contextlib.contextmanager
def onednn_cache_limited(capacity: int = ONEDNN_CACHE_CAPACITY) -> Iterator[list[str]]:
    """:func:`limit_onednn_cache` for the block inside: the variables it set are removed from the environment on
    exit (those the block changed itself are left as they are), so a library call leaves ``os.environ`` as it
    found it. The libraries keep the capacity they read meanwhile (they read it once).

    Args:
        capacity: entries to keep in each cache.

    Returns:
        A context manager yielding the variables set (empty if the environment had them all).

    Example:
        >>> with onednn_cache_limited() as names:  # doctest: +SKIP
        ...     run()
    """
    set_here = limit_onednn_cache(capacity)
    try:
        yield set_here
    finally:
        for name in set_here:
            if os.environ.get(name) == str(capacity):
                del os.environ[name]
