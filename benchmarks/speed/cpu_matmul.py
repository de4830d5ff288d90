"""float32 products on this CPU: torch's default kernel (MKL on x86 builds) against oneDNN's, as seqcal uses
them (``seqcal.algorithms.products``): rate and error against float64 for SmolLM2-135M's Linear shapes, one
Hessian update, and attention (torch's kernel against ``seqcal.backend.onednn.attention``).

Usage: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/cpu_matmul.py [--tokens 512] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from seqcal.algorithms.hessian import UPPER_BLOCK
from seqcal.algorithms.products import add_transposed_products
from seqcal.backend.onednn import _linear_pointwise, attention, use_onednn


def seconds(fn: Callable[[], object], repeat: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def linear_row(name: str, n_in: int, n_out: int, m: int, g: torch.Generator) -> str:
    x, w = torch.randn(m, n_in, generator=g), torch.randn(n_out, n_in, generator=g)
    flops = 2 * m * n_in * n_out
    ref = F.linear(x.double(), w.double())
    native, onednn = seconds(lambda: F.linear(x, w)), seconds(lambda: _linear_pointwise(x, w, None))
    return (
        f"{name + f' [{m}x{n_in}] x [{n_in}x{n_out}]':<44} {flops / native / 1e9:13.1f} {flops / onednn / 1e9:14.1f} "
        f"{error(F.linear(x, w), ref):10.2e} {error(_linear_pointwise(x, w, None), ref):10.2e}"
    )


def hessian_row(d: int, m: int, g: torch.Generator) -> str:
    X = torch.randn(m, d, generator=g)
    H, H2 = torch.zeros(d, d), torch.zeros(d, d)
    blocks = range(0, d, UPPER_BLOCK)
    flops = sum(2 * m * UPPER_BLOCK * (d - i0) for i0 in blocks)

    def torch_upper() -> None:  # hessian.add_products without oneDNN
        for i0 in blocks:
            H[i0 : i0 + UPPER_BLOCK, i0:].addmm_(X[:, i0 : i0 + UPPER_BLOCK].T, X[:, i0:])

    def onednn_upper() -> None:  # hessian.add_products with oneDNN (X^T made contiguous first)
        add_transposed_products(H2, X.T.contiguous(), UPPER_BLOCK, upper=True)

    native, onednn = seconds(torch_upper), seconds(onednn_upper)
    H.zero_(), H2.zero_(), torch_upper(), onednn_upper()
    ref = X.double().T @ X.double()
    upper = torch.ones(d, d, dtype=torch.bool).triu()
    return (
        f"{f'Hessian upper blocks, [{m}x{d}]':<44} {flops / native / 1e9:13.1f} {flops / onednn / 1e9:14.1f} "
        f"{error(H[upper], ref[upper]):10.2e} {error(H2[upper], ref[upper]):10.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = next((line.split(":")[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")  # fmt: skip
    print(
        f"CPU {cpu}, {args.threads} thread(s), torch {torch.__version__}; seqcal uses oneDNN here: {use_onednn()}"
    )
    g = torch.Generator().manual_seed(0)
    m = args.tokens
    print(
        f"{'product':<44} {'torch GFLOP/s':>13} {'oneDNN GFLOP/s':>14} {'torch err':>10} {'oneDNN err':>10}"
    )
    shapes = {"q_proj / o_proj": (576, 576), "k_proj / v_proj": (576, 192), "gate_proj / up_proj": (576, 1536),
              "down_proj": (1536, 576)}  # fmt: skip
    for name, (n_in, n_out) in shapes.items():
        print(linear_row(name, n_in, n_out, m, g))
    for d in (576, 1536):
        print(hessian_row(d, m, g))
    q = torch.randn(1, 9, m, 64, generator=g)
    k, v = (torch.randn(1, 3, m, 64, generator=g) for _ in range(2))
    kw = {"is_causal": True, "enable_gqa": True}  # what transformers passes for SmolLM2's 9 heads over 3
    native = seconds(lambda: F.scaled_dot_product_attention(q, k, v, **kw))
    line = f"attention (causal, 9 heads over 3, {m} tokens): torch's kernel {native * 1e3:.2f} ms per call"
    out = attention(q, k, v, **kw)  # None where seqcal keeps torch's kernel (SEQCAL_CPU_MATMUL, the CPU)
    if out is not None:
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)
        err = (out.double() - ref).abs().max().item()
        ours = seconds(lambda: attention(q, k, v, **kw))
        line += f", seqcal's on oneDNN {ours * 1e3:.2f} ms (max difference vs float64 {err:.1e})"
    print(line)


if __name__ == "__main__":
    main()
