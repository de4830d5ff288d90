"""GPTAQ beside GPTQ on SmolLM2-135M-Instruct (fp32): WikiText-2 perplexity, wall time and peak RSS.

Both through the command line with the same calibration windows (WikiText-2 valid, concatenated, N x L
tokens) and the same evaluation (`seqcal eval ppl`, 2048-token windows of WikiText-2 test), symmetric int
weights in groups of 64 (SmolLM2's 576 inputs take no group of 128), at 4 and 3 bits.

Usage (repository root):
    .venv/bin/python benchmarks/algorithms/gptaq_smollm2.py [--samples 32] [--seq-len 512] [--eval-windows 8]
        [--bits 4 3] [--algos GPTQModifier GPTAQModifier]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / ".work" / "gptaq"
WIKI = Path(os.environ.get("SEQCAL_BENCH_DATA", ROOT.parent / "shared" / "data"))
SEQCAL = [sys.executable, "-m", "seqcal.cli"]


def recipe(algo: str, bits: int) -> str:
    weights = f"{{num_bits: {bits}, type: int, symmetric: true, strategy: group, group_size: 64}}"
    return f"{algo}: {{ignore: [lm_head], config_groups: {{g: {{targets: [Linear], weights: {weights}}}}}}}\n"


def timed(cmd: list[str]) -> tuple[float, float, float, str]:
    """Wall seconds, CPU seconds (user + system), peak RSS (GB) of the command's process, and its output."""
    log = WORK / "last.log"
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
        _, status, usage = os.wait4(proc.pid, 0)
    seconds, text = time.perf_counter() - start, log.read_text()
    if status:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{text[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    return seconds, cpu, usage.ru_maxrss / 2**20, text  # ru_maxrss: KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    parser.add_argument("--algos", nargs="+", default=["GPTQModifier", "GPTAQModifier"])
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    calib, test = WIKI / "wiki.valid.raw", WIKI / "wiki.test.raw"
    print("| scheme | algorithm | ppl (fp32) | wall s | CPU s | peak RSS (GB) |")
    print("|---|---|---|---|---|---|")
    for bits in args.bits:
        for algo in args.algos:
            path = WORK / f"{algo}-w{bits}.yaml"
            path.write_text(recipe(algo, bits))
            out = WORK / f"{algo}-w{bits}"
            seconds, cpu, rss, _ = timed([*SEQCAL, "oneshot", "--model", "default", "--recipe", str(path), "--dataset",
                                          str(calib), "--concatenate", "--num-calibration-samples", str(args.samples),
                                          "--max-seq-length", str(args.seq_len), "--output-dir", str(out),
                                          "--overwrite", "-q"])  # fmt: skip
            *_, text = timed([*SEQCAL, "eval", "ppl", "--model", str(out), "--dataset", str(test),
                              "--eval-windows", str(args.eval_windows)])  # fmt: skip
            ppl = re.findall(r"perplexity[^0-9]*([0-9.]+)", text)
            print(f"| W{bits}A16 g64 | {algo} | {ppl[-1] if ppl else text.strip()[-80:]} | {seconds:.0f} | {cpu:.0f} | {rss:.2f} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
