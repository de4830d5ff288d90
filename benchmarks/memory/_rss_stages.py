"""Peak RSS per stage of ``seqcal oneshot``: runs the CLI in-process with a 10 ms RSS sampler.

Stages are marked by wrapping a few functions (module import, tokenizer, data, the check of the partition, each
subgraph's onload, save, error table, plot); prints the peak RSS of each stage and where the overall peak
happened. Used to find what the command line path adds to the memory bound (benchmarks/RESULTS.md).

Usage: .venv/bin/python benchmarks/memory/_rss_stages.py oneshot --model DIR --recipe R.yaml ... (the CLI's args)
"""

from __future__ import annotations

import functools
import sys
import threading
import time

import psutil

PROC = psutil.Process()
STAGE = ["python + imports"]
PEAKS: dict[str, int] = {}
ORDER: list[str] = []
STOP = threading.Event()
CHECK = "check of the partition"  # seqcal.execution.cuts.verify_run: an eager and a partitioned forward


def _sample(interval: float = 0.01) -> None:
    """Record the peak RSS of the current STAGE every ``interval`` seconds until STOP (also used by
    _moe_rss_stages.py)."""
    while not STOP.is_set():
        rss, stage = PROC.memory_info().rss, STAGE[0]
        if stage not in PEAKS:
            ORDER.append(stage)
        PEAKS[stage] = max(PEAKS.get(stage, 0), rss)
        time.sleep(interval)


def _mark(owner: object, attr: str, label: str | None = None, arg: bool = False) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if arg and STAGE[0] == CHECK:  # the check's partitioned run onloads each subgraph too: its own stage
            return fn(*args, **kwargs)
        STAGE[0] = f"subgraph {args[1].index}" if arg else (label or attr)
        out = fn(*args, **kwargs)
        if not arg:
            STAGE[0] = f"after {label or attr}"
        return out

    setattr(owner, attr, wrapped)


def main() -> int:
    threading.Thread(target=_sample, daemon=True).start()
    from seqcal import cli, entrypoint
    from seqcal.checkpoint.streaming import StreamingCheckpoint
    from seqcal.execution import pipeline
    from seqcal.execution.weights import SubgraphWeights

    STAGE[0] = "cli started"
    _mark(entrypoint, "load_model", "load model + tokenizer")
    for module in (pipeline, entrypoint):  # wherever the batches are built
        if hasattr(module, "load_calibration_batches"):
            _mark(module, "load_calibration_batches", "tokenize calibration text")
    _mark(pipeline, "one_pass_subgraphs", "trace")
    _mark(pipeline, "verify_run", CHECK)
    _mark(SubgraphWeights, "onload", arg=True)
    _mark(StreamingCheckpoint, "finish", "save (finish)")
    _mark(cli, "_plot_errors", "plot")
    _mark(cli, "cmd_oneshot", "cmd_oneshot")
    try:
        rc = cli.main(sys.argv[1:])
    finally:
        time.sleep(0.05)
        STOP.set()
    peak = max(PEAKS.values())
    print(f"\n{'stage':<36}{'peak RSS MB':>12}", file=sys.stderr)
    for stage in ORDER:
        flag = "  <- peak" if PEAKS[stage] == peak else ""
        print(f"{stage:<36}{PEAKS[stage] / 1e6:>12.1f}{flag}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
