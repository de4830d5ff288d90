"""One process x 2 threads vs 2 processes x 1 thread (torchrun, gloo) on SmolLM2-135M-Instruct, GPTQ W4A16 (group 64).

128 x 512-token windows of WikiText-2 valid (the embedded text when ../shared is absent), 8 virtual shards.
Prints wall time of each, whether the checkpoints are equal per tensor (only expected with equal threads
per process: see docs/distributed.md), and from rank 0's quantization_report.json the bytes each rank
sent to reduce statistics and broadcast weights, per subgraph, and its seconds in communication.

Usage (repo root): .venv/bin/python benchmarks/distributed/dist_smollm2.py [--samples 128] [--seq 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / ".work"
WIKI = next(
    (
        p / "shared" / "data" / "wiki.valid.raw"
        for p in (ROOT.parent, ROOT.parent.parent)
        if (p / "shared").is_dir()
    ),
    Path("-"),
)
sys.path.insert(0, str(ROOT / "tests"))


def _cmd(out: Path, args: argparse.Namespace) -> list[str]:
    data = str(WIKI) if WIKI.is_file() else "default"
    return ["-m", "seqcal.cli", "oneshot", "--model", "default", "--recipe", "recipes/gptq_w4a16_g64.yaml",
            "--dataset", data, "--concatenate", "--num-calibration-samples", str(args.samples),
            "--max-seq-length", str(args.seq), "--output-dir", str(out), "--overwrite", "-q", "--plot", "none"]  # fmt: skip


def _run(argv: list[str], threads: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from dist_helpers import tensor_hashes

    one, two = WORK / "dist-1x2", WORK / "dist-2x1"
    wall_one = _run([sys.executable, *_cmd(one, args)], threads=2)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    wall_two = _run([*torchrun, *_cmd(two, args)], threads=1)
    a, b = tensor_hashes(one), tensor_hashes(two)
    report = json.loads((two / "quantization_report.json").read_text())["distributed"]
    result = {"wall_1proc_2threads": wall_one, "wall_2procs_1thread": wall_two,
              "tensors_differing": sum(a[k] != b.get(k) for k in a), "tensors": len(a), "distributed": report}  # fmt: skip
    print(f"1 process x 2 threads: {wall_one:.1f} s; 2 processes x 1 thread: {wall_two:.1f} s; "
          f"tensors differing: {result['tensors_differing']} of {len(a)}")  # fmt: skip
    for rank in report["ranks"]:
        reduce = sum(s.get("reduce_bytes", 0) for s in rank["subgraphs"])
        bcast = sum(
            s.get("broadcast_bytes", 0)
            for s in rank["subgraphs"]
            if report["owners"][s["subgraph"]] == rank["rank"]
        )
        print(f"rank {rank['rank']}: sent {rank['bytes_sent'] / 1e6:.1f} MB ({reduce / 1e6:.1f} MB statistics, "
              f"{bcast / 1e6:.1f} MB weights as owner), {rank['comm_seconds']:.1f} s communicating")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
