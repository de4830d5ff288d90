"""Peak RSS per stage of a GPTQ run on a synthetic MoE checkpoint (from ``moe_membound.py``), per subgraph.

A 5 ms RSS sampler runs beside ``oneshot``; the stages are marked by wrapping the weight onload/release, the
calibration and propagation passes, GPTQ's compress and the streaming save. Prints each stage's peak RSS and
time, and where the overall peak happened. A 2-layer checkpoint shows the per-layer peak in minutes.

Usage: .venv/bin/python benchmarks/memory/_moe_rss_stages.py benchmarks/.work/synthetic-qwen3moe-2L-32E OUT [samples] [seq]
"""

from __future__ import annotations

import functools
import sys
import threading
import time

from _rss_stages import ORDER, PEAKS, STAGE, STOP, _sample  # the sampler; this folder is on sys.path

STAGE[0] = "imports"
TIMES: dict[str, float] = {}
SUBGRAPH = [0]


def _mark(owner: object, attr: str, label: str) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if attr == "onload":
            SUBGRAPH[0] = args[1].index
        name = f"sg{args[1].index} {args[-1]}" if attr == "_pass" else f"sg{SUBGRAPH[0]} {label}"
        STAGE[0] = name
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] = TIMES.get(name, 0.0) + time.perf_counter() - start
            STAGE[0] = f"sg{SUBGRAPH[0]} after {label}"

    setattr(owner, attr, wrapped)


def main() -> None:
    threading.Thread(target=_sample, args=(0.005,), daemon=True).start()
    import torch

    from seqcal.checkpoint.streaming import StreamingCheckpoint
    from seqcal.entrypoint import oneshot
    from seqcal.execution import executor
    from seqcal.execution.weights import SubgraphWeights
    from seqcal.modifiers.gptq import GPTQModifier

    for owner, attr, label in [(SubgraphWeights, "onload", "onload"), (SubgraphWeights, "release", "release"),
                               (executor, "_pass", "pass"), (GPTQModifier, "compress", "compress"),
                               (StreamingCheckpoint, "done", "save"), (StreamingCheckpoint, "finish", "finish")]:  # fmt: skip
        _mark(owner, attr, label)
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    seq = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 32000, (seq,), generator=g).tolist()} for _ in range(n)]
    STAGE[0] = "load, trace, verify"
    start = time.perf_counter()
    oneshot(model=sys.argv[1], dataset=data, recipe="GPTQModifier: {scheme: W4A16, ignore: [lm_head]}",
            output_dir=sys.argv[2], max_seq_length=seq, overwrite=True)  # fmt: skip
    total = time.perf_counter() - start
    STOP.set()
    time.sleep(0.02)
    peak = max(PEAKS.values())
    for stage in ORDER:
        flag = "  <- peak" if PEAKS[stage] == peak else ""
        print(f"{stage:<32}{PEAKS[stage] / 1e6:>10.1f} MB {TIMES.get(stage, 0.0):>8.1f} s{flag}")
    print(f"total {total:.1f} s, peak {peak / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
