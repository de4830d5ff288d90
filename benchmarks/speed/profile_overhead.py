"""Profiling overhead on the SmolLM2 GPTQ benchmark, measured two ways.

``--pairs N``: N runs with profiling off and on, alternating, each in its own process (wall seconds).
``--self-time``: one profiled run in this process with the profiler's bookkeeping (``Profiler._open``,
``_close``, ``close``, ``tensor_bytes``) timed by wrapping it: its share of the run, free of run-to-run noise.

Usage (from the repo root, on an otherwise idle machine; tokens from benchmarks/_lib/calib_tokens.py):
    .venv/bin/python benchmarks/speed/profile_overhead.py --pairs 3
    .venv/bin/python benchmarks/speed/profile_overhead.py --self-time
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / ".work"
TOKENS = WORK / "calib_128x512.safetensors"


def pairs(n: int, model: str) -> None:
    run = [sys.executable, "benchmarks/_lib/run_seqcal.py", "--algo", "gptq", "--dtype", "bfloat16", "--model", model,
           "--tokens", str(TOKENS), "--out", str(WORK / "overhead-out")]  # fmt: skip
    for i in range(n):
        walls = []
        for extra in ([], ["--profile", str(WORK / "overhead.trace.json")]):
            start = time.perf_counter()
            subprocess.run([*run, *extra], cwd=ROOT, check=True, capture_output=True)
            walls.append(time.perf_counter() - start)
        print(
            f"pair {i + 1}: off {walls[0]:.1f} s, on {walls[1]:.1f} s, on/off {walls[1] / walls[0]:.3f}",
            flush=True,
        )


def self_time(model: str) -> None:
    import seqcal.execution.executor as executor
    import seqcal.report.profile as profile

    spent = [0.0, 0]

    def timed(fn):  # noqa: ANN001, ANN202 - a wrapper for any of the bookkeeping functions
        def wrap(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
                spent[1] += 1

        return wrap

    for cls, name in ((profile.Profiler, "_open"), (profile.Profiler, "_close"), (profile.Profiler, "close")):
        setattr(cls, name, timed(getattr(cls, name)))
    executor.tensor_bytes = timed(executor.tensor_bytes)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # benchmarks/_lib
    from safetensors.torch import load_file
    from scheme import SCHEME

    from seqcal.entrypoint import oneshot
    from seqcal.modifiers import GPTQModifier

    tokens = load_file(str(TOKENS))["input_ids"]
    data = [{"input_ids": row.tolist()} for row in tokens]
    start = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=GPTQModifier(config_groups=SCHEME, ignore=["lm_head"]),
            output_dir=str(WORK / "overhead-out"), num_calibration_samples=len(data), max_seq_length=tokens.shape[1],
            dtype="bfloat16", shuffle_calibration_samples=False, overwrite=True,
            profile=str(WORK / "overhead.trace.json"))  # fmt: skip
    wall = time.perf_counter() - start
    print(f"wall {wall:.1f} s; profiler bookkeeping {spent[0]:.2f} s in {spent[1]} calls = "
          f"{100 * spent[0] / wall:.2f}% of the run")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=0, help="alternating off/on runs")
    parser.add_argument("--self-time", action="store_true", help="time the profiler's own bookkeeping")
    args = parser.parse_args()
    if not TOKENS.is_file():
        raise SystemExit(f"{TOKENS} is missing: make it with benchmarks/_lib/calib_tokens.py first")
    from seqcal.models import default_model_dir

    model = str(default_model_dir())
    if args.pairs:
        pairs(args.pairs, model)
    if args.self_time:
        self_time(model)
    if not (args.pairs or args.self_time):
        parser.error("give --pairs N and/or --self-time")


if __name__ == "__main__":
    main()
