"""oneDNN's float32 products on the CPU, where torch's default BLAS takes a slow path, selected explicitly.

torch's CPU build computes float32 ``linear`` / ``mm`` with Intel MKL, which picks its code path by CPU vendor:
on AMD processors it runs its AVX2 kernels even where the CPU has AVX-512. oneDNN, which torch links as well
(its bf16 matmuls run there), picks its kernels by the instruction set alone. On a Zen 5 EPYC with AVX-512,
one thread, SmolLM2's Linear shapes at 512 tokens: MKL 115-119 GFLOP/s, oneDNN 255-270 GFLOP/s; both
accumulate in float32 (relative error against float64 of the same order: 2.5e-7 and 3.8-5.2e-7). Measurements in
benchmarks/RESULTS.md ("float32 products through oneDNN").

What uses it: every ``torch.nn.functional.linear`` and ``scaled_dot_product_attention`` of a calibration or
propagation pass (through :func:`linears_on_onednn`, a torch function mode entered around the subgraph runs;
attention by :func:`attention`, whose products are oneDNN's), the Hessian and Gram products
(``seqcal.algorithms.hessian``), and GPTQ's inverse Cholesky factor (``seqcal.algorithms.products``), all
through :func:`matmul_nt`. Only
float32 operands on the CPU without gradients, with at least ``MIN_ROWS`` rows: with fewer (routed experts'
few tokens), oneDNN's per-shape setup (~0.5 ms for a shape it has not seen) costs what its kernel saves.

``SEQCAL_CPU_MATMUL`` chooses: ``auto`` (default: oneDNN on AMD CPUs with an MKL build of torch, where the
gap was measured; torch's default elsewhere), ``onednn`` (always) or ``native`` (never). The kernel is a private
torch operator, ``torch.ops.mkldnn._linear_pointwise``: :func:`linear_pointwise_problem` checks once that it
exists and gives ``torch.nn.functional.linear``'s result before it is used. ``onednn`` refuses to run without
it; ``auto`` warns and keeps torch's kernels (tests/test_backend.py fails on a torch where it is missing). Inputs that are not contiguous are copied first, and weights that are not keep torch's kernel:
oneDNN's kernels for strided operands are a reference path hundreds of times slower (a transposed
[128, 512] x [1536, 512] product: 1.3 s against 6 ms).

Example:
    >>> x, w = torch.randn(64, 8), torch.randn(4, 8)
    >>> torch.allclose(linear(x, w), torch.nn.functional.linear(x, w), atol=1e-5)
    True
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = [
    "CAUSAL_CHUNK",
    "MIN_ROWS",
    "attention",
    "linear",
    "linear_pointwise_problem",
    "linears_on_onednn",
    "matmul_nt",
    "onednn_applies",
    "onednn_for",
    "use_onednn",
]

logger = logging.getLogger("seqcal")

MIN_ROWS = 32  # rows (tokens) below which torch's default kernel is kept; see the module docstring
# Queries per attention product: smaller chunks skip more of a causal mask's upper triangle, larger ones make
# fewer, larger products; 128 was the fastest of 64-256 for SmolLM2 (one thread, 512 tokens).
CAUSAL_CHUNK = 128
_CHOICES = ("auto", "onednn", "native")


@functools.cache
def use_onednn() -> bool:
    """Whether float32 CPU products go through oneDNN in this process (``SEQCAL_CPU_MATMUL``, read once).

    Example:
        >>> isinstance(use_onednn(), bool)
        True
    """
    choice = os.environ.get("SEQCAL_CPU_MATMUL", "auto").strip().lower()
    if choice not in _CHOICES:
        raise ValueError(f"SEQCAL_CPU_MATMUL must be one of {', '.join(_CHOICES)}, got {choice!r}")
    if choice == "native" or (choice == "auto" and not (_mkl_blas() and _cpu_vendor() == "AuthenticAMD")):
        return False
    problem = linear_pointwise_problem()
    if problem is None:
        return True
    if choice == "onednn":
        raise RuntimeError(
            f"SEQCAL_CPU_MATMUL=onednn, but {problem}: unset SEQCAL_CPU_MATMUL or set it to native"
        )
    logger.warning("float32 CPU products stay on torch's kernels (slower on this CPU): %s", problem)
    return False


# The probe's shape: MIN_ROWS rows, widths that are no multiple of a vector length
_PROBE = (MIN_ROWS, 72, 40)


@functools.cache
def linear_pointwise_problem() -> str | None:
    """Why ``torch.ops.mkldnn._linear_pointwise`` cannot stand in for ``torch.nn.functional.linear`` in this
    process, or None when it can: it exists and gives ``F.linear``'s result (float64 reference, float32
    tolerance) on a probe drawn from its own generator (the run's random numbers are untouched).

    Returns:
        None, or one clause naming the problem (no oneDNN in this torch, no such operator, an error, other
        results).

    Example:
        >>> linear_pointwise_problem() is None or isinstance(linear_pointwise_problem(), str)
        True
    """
    if not torch.backends.mkldnn.is_available():
        return "this torch is built without oneDNN (torch.backends.mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return f"torch {torch.__version__} has no torch.ops.mkldnn._linear_pointwise"
    rows, width, out = _PROBE
    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=generator) for shape in ((rows, width), (out, width), (out,)))
    try:
        got = _linear_pointwise(x, w, b)
    except RuntimeError as exc:
        return f"torch.ops.mkldnn._linear_pointwise failed on a float32 probe ({exc})"
    want = F.linear(x.double(), w.double(), b.double())
    if (
        got.shape != want.shape
        or got.dtype != torch.float32
        or not torch.allclose(got.double(), want, 1e-5, 1e-5)
    ):
        return "torch.ops.mkldnn._linear_pointwise gives other results than torch.nn.functional.linear"
    return None


def _mkl_blas() -> bool:
    return torch.backends.mkl.is_available() and "BLAS_INFO=mkl" in torch.__config__.show()


def _cpu_vendor() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:  # not Linux: no measurement says oneDNN is faster there
        return ""
    return next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), ""
    )


def onednn_for(device: torch.device, rows: int) -> bool:
    """Whether a float32 product with ``rows`` rows on ``device`` goes through oneDNN (:func:`use_onednn`,
    the CPU, ``MIN_ROWS`` rows or more)."""
    return device.type == "cpu" and rows >= MIN_ROWS and use_onednn()


def onednn_applies(x: Tensor, w: Tensor) -> bool:
    """Whether ``linear(x, w)`` takes oneDNN: both float32 on the CPU, no gradient, ``x`` with ``MIN_ROWS``
    rows or more, ``w`` two-dimensional and contiguous, and :func:`use_onednn`."""
    return (
        x.dtype == torch.float32
        and w.dtype == torch.float32
        and w.device.type == "cpu"
        and w.dim() == 2
        and w.is_contiguous()  # a weight is; a view (expanded stand-ins of the memory plan) is not copied
        and x.dim() >= 1
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        and onednn_for(x.device, x.numel() // max(x.shape[-1], 1))
    )


def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:  # noqa: A002 (F.linear's names)
    """``input @ weight.T + bias`` as ``torch.nn.functional.linear`` computes it, with oneDNN's kernel where it
    applies (:func:`onednn_applies`; the bias must be float32 on the CPU too)."""
    if not onednn_applies(input, weight) or (
        bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu")
    ):
        return F.linear(input, weight, bias)
    return _linear_pointwise(input.contiguous(), weight, bias)


def matmul_nt(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b.T`` on oneDNN: ``a [m, k]`` and ``b [n, k]`` contiguous float32 on the CPU, where
    :func:`use_onednn` (the algorithms' one entry to the kernel; callers check :func:`onednn_applies`).

    Example:
        >>> a, b = torch.randn(64, 8), torch.randn(4, 8)
        >>> not use_onednn() or torch.allclose(matmul_nt(a, b), a @ b.T, atol=1e-5)
        True
    """
    return _linear_pointwise(a, b, None)


def _linear_pointwise(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """oneDNN's float32 ``x @ w.T + b`` (the operator torch's compiler uses for CPU Linears; no post-op)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


# scaled_dot_product_attention's arguments after (query, key, value) that attention() takes; a call with any
# other (a newer torch's) keeps torch's kernel
_SDPA_KEYWORDS = frozenset({"attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"})


class _Depth(threading.local):
    depth = 0  # torch's function mode stack is per thread, and so is this count of ours on it


_inside = _Depth()


class _OneDNNLinears(TorchFunctionMode):
    """Sends ``torch.nn.functional.linear`` to :func:`linear` and ``scaled_dot_product_attention`` to
    :func:`attention`; everything else runs as it is."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if args and type(args[0]) is Tensor:  # plain tensors (no proxies, no subclasses)
            if func is F.linear:
                return linear(*args, **kwargs)  # the mode is off inside this method: no recursion
            if func is F.scaled_dot_product_attention and len(args) <= 8 and set(kwargs) <= _SDPA_KEYWORDS:
                out = attention(*args, **kwargs)
                if out is not None:
                    return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def linears_on_onednn(device: torch.device | str | None) -> Iterator[None]:
    """Run the ``torch.nn.functional.linear`` calls inside (those of ``nn.Linear`` modules included) with
    :func:`linear`, and ``scaled_dot_product_attention`` with :func:`attention`; does nothing unless
    :func:`use_onednn` and ``device`` (the execution device) is the CPU (None: no execution device, torch's
    own kernels).

    Example:
        >>> with linears_on_onednn("cpu"):
        ...     y = torch.nn.Linear(8, 4)(torch.randn(64, 8))
        >>> y.shape
        torch.Size([64, 4])
    """
    if device is None or torch.device(device).type != "cpu" or not use_onednn() or _inside.depth:
        yield  # off, or already on in this thread (a second mode on the stack would only add overhead)
        return
    _inside.depth += 1
    try:
        with _OneDNNLinears():
            yield
    finally:
        _inside.depth -= 1


def attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
) -> Tensor | None:  # fmt: skip
    """``torch.nn.functional.scaled_dot_product_attention`` with oneDNN's products, or None where it does not
    apply (the caller then runs torch's own).

    torch's CPU attention kernel computes its inner products with MKL (the slow path on AMD, see the module
    docstring); here ``Q K^T`` and ``P V`` are oneDNN products, all the query heads that share a key/value head
    in one product, ``CAUSAL_CHUNK`` queries at a time. With ``is_causal`` a chunk only meets the keys it may
    attend (top-left aligned, as torch's), 62.5% of the full products' flops at 512 tokens. Rows whose
    mask lets nothing through give 0, as torch's kernels do. On SmolLM2's layers (9 heads over 3, 512 tokens,
    one thread): 2.9 ms against torch's 6.1 ms (two threads: 2.65 against 3.55), maximum difference 1e-6.

    Applies to CPU tensors ``[batch, heads, tokens, dim]`` of one dtype, float32, bfloat16 or float16 (the half
    types are computed in float32 and the output rounded once, as the model's dtype: faster than torch's kernel
    here and closer to float64), without gradient or dropout, with ``MIN_ROWS`` queries or more
    (:func:`use_onednn`), and a mask that is None, boolean, float32 or of the tensors' dtype broadcasting to
    ``[batch, heads, queries, keys]``.

    Example:
        >>> q, k, v = torch.randn(1, 4, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
        >>> out = attention(q, k, v, is_causal=True, enable_gqa=True)
        >>> out is None or torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True,
        ...                                                                    enable_gqa=True), atol=1e-5)
        True
    """
    if not _attention_applies(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        return None
    dtype = query.dtype
    if dtype != torch.float32:  # bfloat16 / float16: computed in float32, rounded once at the end
        query, key, value = query.float(), key.float(), value.float()
        if attn_mask is not None and attn_mask.dtype == dtype:
            attn_mask = attn_mask.float()
    B, H, L, D = query.shape
    Hk, S, Dv = key.shape[1], key.shape[2], value.shape[-1]
    g = H // Hk  # query heads per key/value head
    scale = 1 / math.sqrt(D) if scale is None else scale
    mask = None if attn_mask is None else attn_mask.expand(B, H, L, S)  # a view: nothing copied
    causal = _causal_mask(L, S) if is_causal else None
    out = query.new_empty(B, H, L, Dv)
    for b in range(B):
        for h in range(Hk):
            heads = slice(h * g, (h + 1) * g)
            k, v = key[b, h].contiguous(), value[b, h]
            vt_all = v.T.contiguous()  # [Dv, S]: a contiguous weight for oneDNN (a column slice of it is not)
            for a in range(0, L, CAUSAL_CHUNK):
                e = min(a + CAUSAL_CHUNK, L)
                width = min(e, S) if is_causal else S  # the keys this chunk may attend
                q = query[b, heads, a:e].reshape(g * (e - a), D)  # the group's heads stacked: one product
                s = _linear_pointwise(q, k[:width], None).view(g, e - a, width).mul_(scale)
                dead = None
                if causal is not None:
                    s.add_(causal[a:e, :width])
                elif mask is not None:
                    m = mask[b, heads, a:e]  # [g, chunk, S]
                    if m.dtype == torch.bool:
                        s.masked_fill_(~m, float("-inf"))
                        dead = ~m.any(-1, keepdim=True)
                    else:
                        s.add_(m)
                        dead = torch.isneginf(m).all(-1, keepdim=True)
                p = torch.softmax(s, -1)
                if dead is not None:
                    p.masked_fill_(dead, 0.0)  # nothing to attend: 0, not softmax's NaN
                vt = vt_all if width == S else v[:width].T.contiguous()  # a causal chunk's first keys
                out[b, heads, a:e] = _linear_pointwise(p.view(-1, width), vt, None).view(g, e - a, Dv)
    return out.to(dtype)


# What attention() takes: float32, and the half types, which it computes in float32 too. torch's CPU kernel for
# bfloat16 on the AMD machine of the module docstring: 3.65 ms per SmolLM2 layer (9 heads over 3, 512 tokens, two
# threads) against 2.25 ms here with the conversions, and a larger error against float64 (2.0e-3 against
# 1.6e-3, the output's own bfloat16 rounding being ~1.5e-3).
_ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=8)
def _causal_mask(queries: int, keys: int) -> Tensor:
    """``[queries, keys]`` float32: 0 where query i may attend key j (j <= i, top-left as torch's), -inf above."""
    return torch.full((queries, keys), float("-inf")).triu_(1)


def _attention_applies(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, is_causal: bool, enable_gqa: bool
) -> bool:
    tensors = (q, k, v) if mask is None else (q, k, v, mask)
    if any(type(t) is not Tensor or t.device.type != "cpu" for t in tensors):
        return False
    if q.dtype not in _ATTENTION_DTYPES or any(t.dtype != q.dtype or t.dim() != 4 for t in (q, k, v)):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if dropout_p != 0.0 or (is_causal and mask is not None) or not onednn_for(q.device, q.shape[2]):
        return False
    (B, H, L, D), (Bk, Hk, S, Dk), (Bv, Hv, Sv, _) = q.shape, k.shape, v.shape
    if not (B == Bk == Bv and Hk == Hv and S == Sv and D == Dk and S > 0 and Hk > 0 and H % Hk == 0):
        return False
    if H != Hk and not enable_gqa:
        return False
    if mask is not None:
        if mask.dtype not in (torch.bool, torch.float32, q.dtype) or mask.dim() > 4:
            return False
        try:
            return torch.broadcast_shapes(mask.shape, (B, H, L, S)) == (B, H, L, S)
        except RuntimeError:
            return False
    return True
