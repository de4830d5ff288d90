"""Time the two GPTQ kernels that dominate a GPU run at 1B parameters, old way and new way, on one device.

1. A down_proj Hessian (8192 inputs, 16 batches of 2048 bf16 tokens): float32 CUDA cores (the activations cast
   to float32, as before) vs the half-precision tensor cores with float32 accumulation (the default now).
2. GPTQ solves of a 1B Llama layer's shapes (q/k/v stacked, gate/up stacked, down): the column loop eager vs
   replayed as one CUDA graph per block (the first graphed solve of a shape captures it, the second replays the
   cached graph); peak device memory of each solve.

Usage: python benchmarks/gpu/gpu_solve.py [--device cuda]   (on a CPU it runs, but both rows time the CPU paths)
On a GPU machine: ``bash benchmarks/gpu/gpu_1b.sh seqcal --solve`` runs it with the carried wheels first.
"""

from __future__ import annotations

import argparse
import time

import torch

import seqcal.backend.cuda_graphs as cuda_graphs
from seqcal.algorithms.gptq import gptq_quantize
from seqcal.algorithms.hessian import accumulate_hessian

SHAPES = {
    "q/k/v [3072, 2048]": (3072, 2048),
    "gate/up [16384, 2048]": (16384, 2048),
    "down [2048, 8192]": (2048, 8192),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_hessian(device: torch.device, batches: int, tokens: int, width: int) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn(tokens, width, device=device, generator=g).bfloat16() for _ in range(batches)]
    rows = {}
    for name, cast in (("float32 cores (before)", True), ("bf16 tensor cores, fp32 accumulation", False)):
        H, n = None, 0
        accumulate_hessian(None, xs[0].float() if cast else xs[0], 0)  # warm-up (cuBLAS handles, kernels)
        sync(device)
        start = time.perf_counter()
        for x in xs:
            H, n = accumulate_hessian(H, x.float() if cast else x, n)
        sync(device)
        rows[name] = (time.perf_counter() - start, H)
    (t0, H0), (t1, H1) = rows.values()
    diff = ((H1 - H0).abs().max() / H0.abs().max()).item()
    print(f"hessian {batches} x {tokens} tokens, width {width}: {t0:.3f} s -> {t1:.3f} s "
          f"({t0 / t1:.1f}x), max relative difference {diff:.1e}")  # fmt: skip


def time_solves(device: torch.device) -> None:
    default = cuda_graphs.CUDA_GRAPHS
    g = torch.Generator(device=device).manual_seed(1)
    for label, (out, width) in SHAPES.items():
        X = torch.randn(4096, width, device=device, generator=g)
        H, _ = accumulate_hessian(None, X, 0)
        W = torch.randn(out, width, device=device, generator=g).bfloat16()
        del X
        times, peaks, results = {}, {}, {}
        cuda_graphs.clear_graphs()
        # the second graphed solve replays the graphs the first one captured
        for mode in ("eager", "graph captured", "graph cached"):
            cuda_graphs.CUDA_GRAPHS = mode != "eager"
            if mode == "eager":
                gptq_quantize(W[:256], H, group_size=128)  # warm-up (kernels, cuBLAS, cuSOLVER)
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            start = time.perf_counter()
            results[mode] = gptq_quantize(W, H, group_size=128)
            sync(device)
            times[mode] = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            peaks[mode] = (peak - base) / 2**20
        same = all(torch.equal(results["eager"].q.float(), results[m].q.float()) for m in results)
        print(f"solve {label}: eager {times['eager']:.3f} s, graph captured {times['graph captured']:.3f} s, "
              f"cached {times['graph cached']:.3f} s ({times['eager'] / times['graph cached']:.1f}x), codes equal "
              f"{same}, solve peak MiB {peaks['eager']:.0f} / {peaks['graph cached']:.0f}")  # fmt: skip
    cuda_graphs.CUDA_GRAPHS = default


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, default=16)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(
        "device",
        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch",
        torch.__version__,
    )
    time_hessian(device, args.batches, 2048, 8192)
    time_solves(device)


if __name__ == "__main__":
    main()
