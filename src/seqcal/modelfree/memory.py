"""How many worker processes fit ``max_host_memory``: each holds the interpreter and torch, and, while it
quantizes a weight, the weight and the quantizer's temporaries; the main process waits meanwhile.

The temporaries grow with the element count of what is rounded at once by a factor per format, measured on an
8192 x 8192 bfloat16 weight (peak resident memory above the weight, per float32 byte of it; the factors keep a
margin): int codes 0.56 (W4A16, W8A16), fp8 2.0 (FP8_DYNAMIC), fp8 blocks 3.0, MX 3.6, NVFP4 5.1. A weight whose
scales are per row is rounded a chunk of rows at a time (``seqcal.modelfree.rows``): its temporaries are a
chunk's, beside its codes (a byte per element, twice while the chunks' are stacked). Tensors copied as they are
stream from file to file through a buffer (``COPY_BUFFER``) and add nothing.

Example:
    >>> workers_for(budget=16 << 30, wanted=16, peaks=[job_peak([(128 << 20, 64 << 20, 5.5, 16 << 20)])],
    ...             main=600 << 20)
    12
"""

from __future__ import annotations

from collections.abc import Sequence

from compressed_tensors.quantization import QuantizationScheme

from seqcal.modifiers.formats import weight_format

# Resident memory of a worker before it reads any weight: Python, torch and seqcal imported (measured 347 MiB)
WORKER_BASE = 400 << 20
# Peak temporaries of quantizing a weight, per float32 byte of it (module docstring), by format
FACTORS = {"int": 0.75, "fp8": 2.5, "block": 3.5, "mx": 4.0, "nvfp4": 5.5}
# Bytes of a tensor copied at once from the source file to the output (``Stored.copy``)
COPY_BUFFER = 64 << 20


class HostMemoryError(ValueError):
    """``max_host_memory`` is below what one worker needs; the message gives the smallest budget that works."""


def working_factor(scheme: QuantizationScheme) -> float:
    """The format's temporaries per float32 byte of a weight (``FACTORS``)."""
    fmt = weight_format(scheme)
    if fmt is None:
        return (
            FACTORS["int"]
            if str(getattr(scheme.weights.type, "value", scheme.weights.type)) == "int"
            else FACTORS["fp8"]
        )
    if fmt.strategy == "tensor_group":
        return FACTORS["nvfp4"]
    if fmt.strategy == "block":
        return FACTORS["block"]
    return FACTORS["mx"]


def job_peak(weights: Sequence[tuple[int, int, float, int]]) -> int:
    """Bytes a worker holds at its peak for one job: its base and a copy buffer, plus the largest of (the weight
    read, its fused partners read for a shared scale, its codes and the temporaries of a chunk) over the job's
    weights.

    Args:
        weights: per quantized weight (its stored bytes, its element count, its format's factor, the elements
            rounded at once: ``rows.rows_per_chunk`` times its columns).
    """
    return (
        WORKER_BASE
        + COPY_BUFFER
        + max(
            (
                int(2 * nbytes + 2 * numel + 4 * min(numel, chunk) * factor)
                for nbytes, numel, factor, chunk in weights
            ),
            default=0,
        )
    )


def workers_for(budget: int | None, wanted: int, peaks: Sequence[int], main: int) -> int:
    """The number of worker processes that keeps the sum of resident memory under ``budget``.

    Args:
        budget: bytes (None: no limit, ``wanted``).
        wanted: the most workers asked for.
        peaks: per job, its peak (``job_peak``); every worker is counted at the largest.
        main: the main process's resident memory.

    Raises:
        HostMemoryError: not even one worker fits; names the smallest budget that does.
    """
    worst = max(peaks, default=WORKER_BASE)
    if budget is None:
        return max(1, wanted)
    alone = main + worst - WORKER_BASE  # one worker: the main process runs the jobs itself
    if budget < alone:
        raise HostMemoryError(
            f"model-free: max_host_memory={budget / 2**30:.2f} GiB is below what the largest weight needs "
            f"({alone / 2**30:.2f} GiB with one process); give at least that, or ignore the largest modules"
        )
    if wanted <= 1:
        return 1
    # several: the main process waits, the fork server the workers come from holds its imports
    return max(1, min(wanted, (budget - main - WORKER_BASE) // worst))
