"""Sizes of the values crossing subgraph boundaries, for the memory plan (``seqcal.plan``), measured without
reading a weight.

The subgraphs run on three tiny batches (4, 8 and 16 tokens per row) with stand-in weights (zero-stride
zeros: no memory, no weight read), and each value's bytes are extrapolated to ``seq_len`` with the quadratic
through the three sizes (exact for sizes linear in the tokens, like hidden states, or quadratic, like
attention masks).

Example:
    >>> values, widest = measure_values(trace_subgraphs(model, sample), 1, 2048)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import psutil
import torch

from seqcal.algorithms import gptq_quantize
from seqcal.algorithms.hessian import accumulate_hessian
from seqcal.execution.subgraphs import model_device
from seqcal.execution.weights import params_under
from seqcal.report.profile import tensor_bytes
from seqcal.tracing.partition import Subgraph
from seqcal.tracing.runner import GraphRunner

# Resident memory of the process before the first subgraph: Python, torch, transformers and seqcal imported,
# model skeleton on meta, trace and batches (measured on this machine: 0.34 GiB after the imports, 0.36 GiB
# at the first onload; benchmarks/RESULTS.md). A CUDA context adds its own host memory on top. The plan
# measures the process it runs in instead (``values.process_baseline``); this is where it cannot.
PROCESS_BASELINE = 370 * 1024**2
# MKL's work buffers and code for a Hessian update's products on the cpu: measured 3.5 MiB beside the batch's copies
# at 4096 inputs and 64 tokens (2 threads, 2-core x86)
GEMM_BUFFERS = 4 << 20
# Free pages glibc's heap keeps between two trims (backend.host.trim_host_memory, before each solve and after each
# subgraph), in every row's host: measured 7 MiB at a 4096-wide down_proj's calibration, 5 before its factor; and
# the spread of one run's peak between processes against the baseline each measures (the same run in three
# processes: 477.5 to 480.4 MiB for predictions of 479.3 to 483.4 MiB; tests/test_host_peak.py's model)
HEAP_SLACK = 14 << 20


PROBE_TOKENS = (4, 8, 16)  # tokens per row of the stand-in runs that measure the crossing values


@contextlib.contextmanager
def _stand_in_weights(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Parameters on meta become zero-stride zeros for the block: shapes without memory or weight reads."""
    swapped = []
    try:
        for module in model.modules():
            for leaf, p in list(module._parameters.items()):
                if p is not None and p.device.type == "meta":
                    zeros = torch.zeros((), dtype=p.dtype, device=device).expand(p.shape)
                    module._parameters[leaf] = torch.nn.Parameter(zeros, requires_grad=False)
                    swapped.append((module, leaf, p))
        yield
    finally:
        for module, leaf, p in swapped:
            module._parameters[leaf] = p


def _quadratic_at(xs: tuple[int, ...], ys: list[int], x: int) -> int:
    """The quadratic through three points, evaluated at ``x`` (Lagrange form), never below 0."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    value = (y0 * (x - x1) * (x - x2) / ((x0 - x1) * (x0 - x2)) + y1 * (x - x0) * (x - x2) / ((x1 - x0) * (x1 - x2))
             + y2 * (x - x0) * (x - x1) / ((x2 - x0) * (x2 - x1)))  # fmt: skip
    return max(int(round(value)), 0)


def measure_values(subgraphs: Any, batch_size: int, seq_len: int) -> tuple[dict[str, int], dict[int, int]]:
    """Bytes per batch of each value crossing a boundary, and of each subgraph's largest intermediate.

    Runs ``subgraphs`` (a SubgraphList) on ``PROBE_TOKENS``-long zero batches with stand-in weights and
    extrapolates every size to ``seq_len`` tokens per row (module docstring).

    Returns:
        (value name -> bytes, subgraph index -> bytes of its largest node output).

    Example:
        >>> values, widest = measure_values(trace_subgraphs(model, sample), 1, 2048)  # doctest: +SKIP
    """

    runner, device = GraphRunner(subgraphs.model), model_device(subgraphs.model)
    sizes: dict[str, list[int]] = {}
    widest: dict[int, list[int]] = {}
    for tokens in PROBE_TOKENS:
        ids = torch.zeros(batch_size, tokens, dtype=torch.long, device=device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        env = {node: inputs[key] for key, node in subgraphs.placeholders.items() if key in inputs}
        for node in env:
            sizes.setdefault(node, []).append(tensor_bytes(env[node]))
        with torch.no_grad(), _stand_in_weights(subgraphs.model, device):
            for sg in subgraphs:
                local = dict(env)
                runner.run(sg, local)
                produced = [tensor_bytes(local[n.name]) for n in sg.nodes if n.name in local]
                widest.setdefault(sg.index, []).append(max(produced, default=0))
                for name in sg.outputs:
                    env[name] = local[name]
                    sizes.setdefault(name, []).append(tensor_bytes(local[name]))
                for name in sg.frees:
                    env.pop(name, None)
    values = {n: _quadratic_at(PROBE_TOKENS, ys, seq_len) for n, ys in sizes.items() if len(ys) == 3}
    return values, {i: _quadratic_at(PROBE_TOKENS, ys, seq_len) for i, ys in widest.items()}


def owned_bytes(model: torch.nn.Module, subgraphs: list[Subgraph], quantized: set[str], dtype_bytes: int,
                 quant_bits: int) -> dict[int, int]:  # fmt: skip
    """Checkpoint bytes written after each subgraph (the modules it uses last), as stream.StreamingCheckpoint."""
    last: dict[str, int] = {}
    for sg in subgraphs:
        for name in params_under(model, sg.modules):
            last[name] = sg.index
    out: dict[int, int] = {}
    for name, index in last.items():
        numel = model.get_parameter(name).numel()
        module = name.rpartition(".")[0]
        packed = module in quantized and name.endswith(".weight")
        size = numel * quant_bits // 8 + numel * dtype_bytes // 32 if packed else numel * dtype_bytes
        out[index] = out.get(index, 0) + size
    return out


def process_baseline(resident: int, fallback: int) -> int:
    """The process's own resident memory, measured at the first plan the process makes: what every subgraph's
    host prediction starts from.

    Python, torch, transformers, seqcal and whatever the caller holds (a test runner, a notebook, the tokenizer)
    are what they are in this process, not a constant measured on another machine. Measured once, so that two
    plans of one process (each cut, a budget checked twice) compare.

    Args:
        resident: bytes of the model's weights held in RAM now (counted by the plan on their own, so taken out).
        fallback: returned where the resident size cannot be read.

    Returns:
        Bytes.
    """
    first = _first_rss()
    return max(first - resident, 0) if first is not None else fallback


@functools.cache
def _first_rss() -> int | None:
    """The process's RSS at the first call (a memo of a measurement, the same for every later plan), after the
    kernels a calibration runs have run once (:func:`_warm_kernels`)."""
    _warm_kernels()
    try:
        return psutil.Process().memory_info().rss
    except psutil.Error:
        return None


def _warm_kernels() -> None:
    """Runs a small GPTQ solve (Hessian, in-place and LAPACK factors, column loop) and a bfloat16 and float32
    matmul on the cpu, so that their code is resident when the baseline is measured.

    Why: libtorch's pages are read in as its code first runs. Measured before any solve, the baseline missed the
    ~18 MiB of libtorch's code a 8192-wide down_proj's solve brings in (55 MiB of libtorch_cpu resident at the
    plan, 73 at the solve), and a 950 MB budget was exceeded by as much. This touches 69 of them in ~0.1 s.
    """
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(512, 1024, generator=generator)
    H, _ = accumulate_hessian(None, X, 0)
    for in_place in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            W = torch.randn(256, 1024, generator=generator).to(dtype)
            gptq_quantize(
                W,
                H.clone(),
                group_size=128,
                actorder="static",
                in_place_factor=in_place,
                overwrite=True,
                row_chunks=in_place,
            )
            torch.nn.functional.linear(X[:64].to(dtype), W)
