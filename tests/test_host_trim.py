"""Host memory between subgraphs: ``trim_host_memory`` returns what the solves left pooled, not only glibc's
free heap, so the heap in use does not grow subgraph after subgraph."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from seqcal.backend.host import free_mkl_buffers, limit_onednn_cache, map_large_allocations

# Run in a fresh process: the heap in use as glibc counts it (mallinfo2), and the trim under test.
HEAP = textwrap.dedent("""
    import ctypes
    from seqcal.backend.host import trim_host_memory

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info

    def in_use():
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
""")

# The heap in use before and after GPTQ-sized Cholesky factorizations and Hessian products, once everything
# they returned is freed and the host memory trimmed.
SCRIPT = HEAP + textwrap.dedent("""
    import torch
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

# The heap in use after bf16 matmuls of 300 token counts (what routed experts produce), with the caches
# capped by ``limit_onednn_cache`` first ("cap") or left at the libraries' defaults.
SHAPES_SCRIPT = (
    textwrap.dedent("""
    import sys
    if sys.argv[1] == "cap":
        from seqcal.backend.host import limit_onednn_cache
        limit_onednn_cache()
""")
    + HEAP
    + textwrap.dedent("""
    import torch
    w = torch.randn(256, 128, dtype=torch.bfloat16)
    torch.nn.functional.linear(torch.randn(3, 128, dtype=torch.bfloat16), w)
    trim_host_memory()
    before = in_use()
    for tokens in range(1, 301):
        torch.nn.functional.linear(torch.randn(tokens, 128, dtype=torch.bfloat16), w)
    trim_host_memory()
    print(in_use() - before)
""")
)

# Whether a block 1 MB above MMAP_THRESHOLD, allocated after one 8 MB above it was freed, gets its own mapping:
# with glibc's dynamic threshold the free raises the threshold past it, and it comes from the heap. Mode "call": after
# map_large_allocations(); "cli": after the seqcal command ran; "none": neither.
MAPPED_SCRIPT = HEAP + textwrap.dedent("""
    import sys
    import torch
    from seqcal.backend.host import MMAP_THRESHOLD, map_large_allocations

    if sys.argv[1] == "call":
        print(map_large_allocations())
    elif sys.argv[1] == "cli":
        import seqcal.cli as cli
        try:
            cli.main(["--help"])
        except SystemExit:
            pass
    x = torch.ones(MMAP_THRESHOLD + (8 << 20), dtype=torch.uint8)
    del x
    before = libc.mallinfo2().hblkhd
    y = torch.ones(MMAP_THRESHOLD + (1 << 20), dtype=torch.uint8)
    print(libc.mallinfo2().hblkhd - before >= MMAP_THRESHOLD)
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


def _uses_onednn_for_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc_with_mallinfo2(), reason="glibc only")
@pytest.mark.skipif(not _uses_onednn_for_bf16(), reason="bf16 matmuls do not go through oneDNN here")
def test_capped_matmul_caches_do_not_grow_with_every_new_shape() -> None:
    """Measured: +160 MB over 300 shapes at the libraries' defaults, +18 MB capped at 32 entries each."""
    env = {k: v for k, v in os.environ.items() if "CACHE_CAPACITY" not in k}
    grown = {}
    for mode in ("cap", "default"):
        run = subprocess.run([sys.executable, "-c", SHAPES_SCRIPT, mode], capture_output=True, text=True,
                             timeout=300, env=env)  # fmt: skip
        assert run.returncode == 0, run.stderr
        grown[mode] = int(run.stdout.split()[-1]) / 2**20
    assert grown["cap"] < 40, grown
    assert grown["default"] > 2 * grown["cap"], grown


def test_limit_onednn_cache_leaves_the_users_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DNNL_PRIMITIVE_CACHE_CAPACITY", "7")  # oneDNN's older name counts as the user's
    assert limit_onednn_cache(16) == ["LRU_CACHE_CAPACITY"]
    assert os.environ["LRU_CACHE_CAPACITY"] == "16" and "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ
    assert limit_onednn_cache() == []  # everything set now: nothing changes
    assert os.environ["LRU_CACHE_CAPACITY"] == "16"
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        limit_onednn_cache(0)


def test_the_seqcal_command_caps_the_caches_before_anything_else() -> None:
    code = (
        "import os, seqcal.cli as cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'), os.environ.get('LRU_CACHE_CAPACITY'))"
    )
    env = {k: v for k, v in os.environ.items() if "CACHE_CAPACITY" not in k}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "32 32"


def _mapped(mode: str, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    run = subprocess.run([sys.executable, "-c", MAPPED_SCRIPT, mode], capture_output=True, text=True, timeout=120,
                         env={**environ, **env})  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout.split()[-2:] if mode == "call" else run.stdout.split()[-1:]


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc_with_mallinfo2(), reason="glibc only")
def test_large_blocks_get_their_own_mappings_after_map_large_allocations() -> None:
    """glibc's dynamic threshold serves the block from the heap (where it stays resident once freed); with the
    threshold fixed at MMAP_THRESHOLD it is mapped, by the call and by the seqcal command; a threshold the user
    set in the environment is left alone."""
    assert _mapped("none") == ["False"]
    assert _mapped("call") == ["True", "True"]
    assert _mapped("cli") == ["True"]
    assert _mapped("call", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=33554432") == ["False", "False"]


def test_map_large_allocations_leaves_the_users_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert map_large_allocations() is False
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000")
    assert map_large_allocations() is False
    with pytest.raises(ValueError, match="threshold must be >= 1 byte"):
        map_large_allocations(0)
