"""Temporaries of GPTQ's blocked inverse factor (``products.inverse_cholesky_factor_``), counted from torch's CPU
allocations: the peak of what the factor holds besides its input, in quarter blocks ((n/2)^2 floats) and MB;
with ``--gptq``, of GPTQ's whole inverse factor (``gptq._inverse_hessian_factor`` inside ``gptq._factor_scratch``:
the Hessian's kept values, the factor's temporaries, the Hessian restored) besides the Hessian, in [n, n] matrices;
with ``--solve ROWS``, of a whole GPTQ solve as the modifier runs it (``gptq_quantize`` W4A16 group 128 with
act-order on a bfloat16 weight of ROWS rows, then ``relative_output_error``), besides the Hessian and the weight:
public functions only, so the same command measures any version of the code.

Each op's own allocations and frees (``self_cpu_memory_usage`` of torch's profiler) are summed in the order the
ops started; the factor runs on oneDNN whatever this machine's CPU (``SEQCAL_CPU_MATMUL=onednn``). Compare two
versions of the code by running this file with each on ``PYTHONPATH``.

Usage: PYTHONPATH=src .venv/bin/python benchmarks/memory/factor_memory.py [--sizes 896,1536,5632] [--gptq | --solve 2048]
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def factor_peak(n: int, whole: bool, rows: int = 0) -> tuple[float, float]:
    """Peak bytes allocated by the factor at ``n`` inputs (``whole``: GPTQ's; ``rows``: a whole solve of a weight
    of that many rows) and its seconds (profiled)."""
    from seqcal.algorithms import gptq, gptq_quantize, products, relative_output_error

    X = torch.randn(2 * n, n)
    A = X.T @ X / n + 0.01 * torch.eye(n)  # positive definite, a GPTQ Hessian's scale
    A = A.triu() + A.triu(1).T  # exactly symmetric, as the modifiers make their Hessians
    del X
    W = torch.randn(rows, n).bfloat16() if rows else None
    with torch.profiler.profile(
        profile_memory=True, activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        start = time.perf_counter()
        if rows:
            result = gptq_quantize(W, A, num_bits=4, group_size=128, actorder="static")
            relative_output_error(W, result.Q, A)
            del result
        elif whole:
            with gptq._factor_scratch(A, A) as kept:
                gptq._inverse_hessian_factor(A, kept, None, torch.zeros(n, dtype=torch.bool), 0.01, 0, 10.0)
        elif products.inverse_cholesky_factor_(A) is None:
            raise SystemExit(f"factor_memory: the {n}-wide test matrix was not positive definite")
        seconds = time.perf_counter() - start
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak, seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="896,1536,5632", help="input widths, comma-separated")
    parser.add_argument("--gptq", action="store_true", help="GPTQ's whole inverse factor, in [n, n] matrices")
    parser.add_argument("--solve", type=int, default=0, metavar="ROWS",
                        help="a whole GPTQ solve of a weight of ROWS rows, in [n, n] matrices")  # fmt: skip
    args = parser.parse_args()
    os.environ["SEQCAL_CPU_MATMUL"] = "onednn"
    whole = args.gptq or args.solve > 0
    unit = "[n, n] matrices" if whole else "quarter blocks"
    print(f"{'inputs':>7}{'peak MB':>10}{unit:>16}{'s (profiled)':>14}")
    for n in (int(size) for size in args.sizes.split(",")):
        peak, seconds = factor_peak(n, args.gptq, args.solve)
        block = n * n * 4 if whole else (n // 2) ** 2 * 4
        print(f"{n:>7}{peak / 1e6:>10.1f}{peak / block:>16.2f}{seconds:>14.2f}")


if __name__ == "__main__":
    main()
