"""seqcal's AutoRoundModifier vs auto-round 0.16.1 on SmolLM2-135M-Instruct (fp32): W4A16 symmetric, group 64.

Both tools learn the rounding on the same calibration windows (the first ``--samples`` of WikiText-2 valid cut into
512-token windows, ``calib_tokens.py``; auto-round gets them as token tensors, so it sees exactly these windows),
with the same steps, learning rate and batch size (default: auto-round's "light" setting, 50 steps, lr 5e-3, 8 rows),
on the CPU without torch.compile. Each run is timed under GNU time (wall, CPU, peak RSS); then ``seqcal eval ppl``
measures both checkpoints on the same WikiText-2 test windows (seqcal's compressed-tensors checkpoint; auto-round's
model saved with its weights quantized and dequantized).

auto-round lives in its own venv (it pins other versions of transformers and friends):
    python -m venv /tmp/ar; /tmp/ar/bin/pip install torch==2.13.0; /tmp/ar/bin/pip install auto-round==0.16.1

Usage (from the repo root):
    .venv/bin/python benchmarks/peers/autoround_smollm2.py [--runs seqcal,auto-round] [--iters 50] [--lr 5e-3]
        [--samples 32] [--eval-windows 8] [--bits 4] [--seed 42] [--peer-python /tmp/ar/bin/python]
    Runs made one at a time (--runs seqcal, then --runs auto-round) are kept in .work/autoround_results_<tag>.json
    and compared once both are there; each tool's whole output (auto-round's per-block losses) is kept in
    .work/autoround-<tool>-<tag>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
import harness  # noqa: E402
from harness import ROOT, VENV, WORK, calibration_tokens, measure  # noqa: E402

RECIPE = """quant_stage:
  quant_modifiers:
    AutoRoundModifier:
      iters: {iters}
      lr: {lr}
      batch_size: {batch}
      seed: {seed}
      ignore: ["lm_head"]
      config_groups:
        group_0:
          targets: ["Linear"]
          weights: {{num_bits: {bits}, type: int, symmetric: true, strategy: group, group_size: 64}}
"""


def seqcal_ppl(checkpoint: Path, windows: int) -> float:
    """``seqcal eval ppl`` of ``checkpoint`` on the first ``windows`` 2048-token windows of WikiText-2 test."""
    cmd = [f"{VENV}/bin/python", "-m", "seqcal.cli", "eval", "ppl", "--model", str(checkpoint), "--dataset",
           str(harness.WIKI / "wiki.test.raw"), "--eval-windows", str(windows)]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1].rsplit(":", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default="seqcal,auto-round")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--lr", type=float, default=5e-3, help="0: both tools' default, 1 / iters")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", default=None, help="a model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--bits", type=int, default=4, help="weight bits (symmetric int, group 64)")
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument(
        "--seed", type=int, default=42, help="of both tools' row batches (both default to 42)"
    )
    parser.add_argument(
        "--peer-python", default=os.environ.get("SEQCAL_BENCH_AUTOROUND_PYTHON", "/tmp/ar/bin/python")
    )
    args = parser.parse_args()
    from seqcal.models import default_model_dir

    model = Path(args.model) if args.model else default_model_dir()
    tokens = calibration_tokens(model, args.samples, 512)
    tag = f"{model.name}-w{args.bits}-{args.iters}it-lr{args.lr:g}" + (
        f"-seed{args.seed}" if args.seed != 42 else ""
    )
    recipe = WORK / f"autoround_{tag}.yaml"
    recipe.write_text(
        RECIPE.format(
            iters=args.iters, lr=args.lr or "null", batch=args.batch_size, bits=args.bits, seed=args.seed
        )
    )
    commands = {
        "seqcal": [f"{VENV}/bin/python", "benchmarks/_lib/run_seqcal.py", "--recipe", str(recipe)],
        "auto-round": [
            args.peer_python,
            "benchmarks/_lib/run_autoround.py",
            "--iters",
            str(args.iters),
            "--lr",
            str(args.lr),
            "--batch-size",
            str(args.batch_size),
            "--samples",
            str(args.samples),
            "--bits",
            str(args.bits),
            "--seed",
            str(args.seed),
        ],  # fmt: skip
    }
    saved = WORK / f"autoround_results_{tag}.json"  # runs made one at a time are compared too
    results = json.loads(saved.read_text()) if saved.exists() else {}
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    for name in args.runs.split(","):
        out = WORK / f"autoround-{name}-{tag}"
        cmd = [*commands[name], "--model", str(model), "--tokens", str(tokens), "--out", str(out)]
        print("$", " ".join(cmd), flush=True)
        wall, cpu, rss, _ = measure(cmd, log=WORK / f"autoround-{name}-{tag}.log")
        ppl = seqcal_ppl(out, args.eval_windows)
        results[name] = {
            "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1),
            "peak_rss_gb": round(rss, 2),
            "ppl": round(ppl, 2),
        }
        print(
            f"{name:<11} wall {wall:7.1f} s  cpu (user+sys) {cpu:7.1f} s  peak RSS {rss:5.2f} GB  ppl {ppl:7.2f}",
            flush=True,
        )
        results = {**(json.loads(saved.read_text()) if saved.exists() else {}), name: results[name]}
        saved.write_text(json.dumps(results, indent=1))  # read again: the other tool may run beside this one
    if {"seqcal", "auto-round"} <= results.keys():
        ours, theirs = results["seqcal"], results["auto-round"]
        print(f"seqcal / auto-round: ppl {ours['ppl'] / theirs['ppl']:.3f}x, cpu {ours['cpu_s'] / theirs['cpu_s']:.2f}x, "
              f"wall {ours['wall_s'] / theirs['wall_s']:.2f}x,"
              f" peak RSS {ours['peak_rss_gb'] / theirs['peak_rss_gb']:.2f}x; load average {os.getloadavg()[0]:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
