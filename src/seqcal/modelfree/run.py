"""The jobs run in worker processes (or in this one, for one worker), one source file each.

Workers are forked from a fork server that imported the worker's code once: not from this process, whose
OpenMP thread pool a fork would copy in a state the child deadlocks on at its first parallel operation (GNU
libgomp), and not spawned one by one, which imports torch and seqcal again in each (seconds of CPU each). Each
worker computes with ``threads // workers`` torch threads. Round to nearest does not depend on the thread count or
on which process quantizes a weight, so 1 or N workers write the same bytes; the results come back in the jobs'
order.

Example:
    >>> results = run_jobs(plan.jobs, "llama", "out", workers=4)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

import torch

from seqcal.modelfree.plan import Job
from seqcal.modelfree.worker import JobResult, run_job

logger = logging.getLogger("seqcal")


def run_jobs(jobs: Sequence[Job], source_dir: str, output_dir: str, *, workers: int = 1,
             device: str = "cpu") -> list[JobResult]:  # fmt: skip
    """Run ``jobs``; returns their results in the same order.

    Args:
        jobs: the files to write.
        source_dir: the source checkpoint.
        output_dir: the output directory.
        workers: processes; 1 runs the jobs here, one after the other.
        device: where weights are quantized.
    """
    start = time.perf_counter()
    if workers <= 1 or len(jobs) <= 1:
        results = []
        for i, job in enumerate(jobs):
            results.append(run_job(job, source_dir, output_dir, device))
            _log(i + 1, len(jobs), job.file, start)
        return results
    threads = max(1, torch.get_num_threads() // workers)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([run_job.__module__])  # (once started, the server keeps its first preload)
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker, initargs=(threads,)
    ) as pool:
        futures = [pool.submit(run_job, job, source_dir, output_dir, device) for job in jobs]
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in done:
                if future.exception() is not None:  # the others stop; their files stay .partial
                    for other in pending:
                        other.cancel()
                    raise future.exception()  # type: ignore[misc]
                _log(len(futures) - len(pending), len(jobs), future.result().file, start)
        return [f.result() for f in futures]


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def _log(done: int, total: int, file: str, start: float) -> None:
    logger.info(
        "seqcal: model-free: %d/%d %s written (%.1f s)", done, total, file, time.perf_counter() - start
    )
