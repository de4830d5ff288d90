"""How many threads torch computes with, from the cores that are free when the run starts.

On a shared machine torch's default (one thread per core) oversubscribes the cores: the OpenMP threads of a
parallel region wait for each other at its end, and a thread the scheduler has parked holds up the rest.
Measured on 2 cores with about 19 busy threads from other processes (load average 19): a 128 x 576 by
576 x 576 matmul and SiLU took 2.3 ms with one thread and 22-55 ms with two; a 256 x 2048 by 2048 x 2048
matmul 65 ms with one and 102 ms with two; at a load average of 9-13, ``seqcal oneshot`` of SmolLM2 (GPTQ W4A16,
2 samples of 64 tokens) took 143 s with ``--threads 1`` and 523 s with ``--threads 2``. ``free_cores`` reads the load average against the cores this
process may run on. The thread count is never changed behind the user's back: checkpoint bytes depend on it
(a sum computed by other threads rounds differently), so a run resumed, or rerun, on a busier moment would
write other bytes. The command line's ``--threads N`` sets it (``choose_threads``); without it, ``choose_threads``
and ``oneshot`` only say in the log (``-v``) how many cores are free and how to set the threads.

Example:
    >>> free_cores(load=3.0, cores=8, machine=8)  # this process and two busy threads of others
    6
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("seqcal")

# The variables a user sets to choose the threads; any of them set means the choice is theirs.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def free_cores(load: float | None = None, cores: int | None = None, machine: int | None = None) -> int:
    """Cores this process may use that other processes do not keep busy, at least 1.

    Args:
        load: runnable threads on the machine (None: the 1-minute load average, ``os.getloadavg``).
        cores: cores this process may run on (None: ``os.sched_getaffinity``, else ``os.cpu_count``).
        machine: cores of the machine, over which the load average is counted (None: ``os.cpu_count``).

    Returns:
        ``min(cores, machine - (load - 1))`` rounded, within ``[1, cores]``: one runnable thread of the load is
        this process's own.
    """
    cores = cores or _cores()
    machine = machine or os.cpu_count() or cores
    if load is None:
        if not hasattr(os, "getloadavg"):  # Windows: no load average, nothing to go by
            return cores
        load = _load()
    others = max(0.0, load - 1.0)  # the load average counts this process too (importing torch: one core)
    return max(1, min(cores, round(machine - others)))


def choose_threads(requested: int | None = None) -> int:
    """Set torch's threads for this process to ``requested`` (``--threads``); without it, keep them and say with
    ``-v`` how many cores are free.

    For the command line's main only: a process-wide setting.

    Args:
        requested: an explicit count (``--threads``); None keeps torch's.

    Returns:
        The number of threads torch computes with now.
    """
    if requested is not None:
        torch.set_num_threads(max(1, requested))
        return torch.get_num_threads()
    if any(os.environ.get(v) for v in THREAD_VARIABLES):
        return torch.get_num_threads()  # the user's choice, already applied by OpenMP / torch
    hint_threads()
    return torch.get_num_threads()


def hint_threads() -> None:
    """Log how to set the threads when torch uses more than the free cores (``oneshot`` from Python)."""
    if any(os.environ.get(v) for v in THREAD_VARIABLES):
        return
    free, current = free_cores(), torch.get_num_threads()
    if free < current:
        logger.debug("seqcal: %d of %d cores free (load average %.1f) while torch computes with %d threads, which "
                     "then wait on each other (runs can be several times slower): --threads %d on the command line, "
                     "torch.set_num_threads(%d) before oneshot, or OMP_NUM_THREADS=%d", free, _cores(), _load(), current,
                     free, free, free)  # fmt: skip


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
