"""seqcal vs llm-compressor 0.14.0.1 on SmolLM2-135M-Instruct: GPTQ and RTN W4A16 (group 64).

Same 128 x 512-token calibration windows from WikiText-2 valid for both tools; reports wall time,
peak RSS of the quantizing process, and WikiText-2 test perplexity (2048-token windows) of each checkpoint.

Usage (from the repo root; the peer venv comes from benchmarks/setup_peer.sh):
    .venv/bin/python benchmarks/gptq_smollm2.py [--runs seqcal-gptq,llmc-gptq,...] [--eval-windows N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "benchmarks" / ".work"
WIKI = Path(os.environ.get("SEQCAL_BENCH_DATA", ROOT.parent / "shared" / "data"))  # WikiText-2 raw text
# the two venvs (relative to the repository root unless absolute): SEQCAL_BENCH_VENV / SEQCAL_BENCH_PEER_VENV
VENV = os.environ.get("SEQCAL_BENCH_VENV", ".venv")
SEQCAL = [f"{VENV}/bin/python", "benchmarks/_run_seqcal.py"]
PEER = [
    f"{os.environ.get('SEQCAL_BENCH_PEER_VENV', '.peer-venv')}/bin/python",
    "benchmarks/_run_llmcompressor.py",
]
BF16 = [*SEQCAL, "--algo", "gptq", "--dtype", "bfloat16"]
RUNS = {
    "seqcal-gptq-bf16-h16": [*BF16, "--hessian-products", "bfloat16"],
    "seqcal-gptq-autocast": [*SEQCAL, "--algo", "gptq", "--dtype", "float32", "--compute-dtype", "bfloat16"],
    "seqcal-gptq-bf16": BF16,
    "seqcal-gptq-bf16-layers": [*BF16, "--layer-cut"],
    "seqcal-gptq-bf16-profile": [*BF16, "--profile", "benchmarks/.work/smollm2-gptq.trace.json"],
    "seqcal-gptq-fp32": [*SEQCAL, "--algo", "gptq", "--dtype", "float32"],
    "seqcal-rtn": [*SEQCAL, "--algo", "rtn", "--dtype", "float32"],
    "llmc-gptq-fp32": [*PEER, "--algo", "gptq"],
    "llmc-gptq-bf16": [*PEER, "--algo", "gptq", "--dtype", "bfloat16"],
    "llmc-rtn": [*PEER, "--algo", "rtn"],
}


def measure(cmd: list[str], log: Path | None = None) -> tuple[float, float, float, str]:
    """Run ``cmd`` under GNU time; returns (wall s, cpu s, peak RSS in GB, the tool's last output line).

    Args:
        log: a file for the tool's whole output (its per-layer losses, warnings), stdout then stderr.
    """
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{' '.join(cmd)} failed with {proc.returncode}")
    stats = dict(line.strip().rsplit(": ", 1) for line in proc.stderr.splitlines() if ": " in line)
    cpu = float(stats["User time (seconds)"]) + float(stats["System time (seconds)"])
    rss_gb = int(stats["Maximum resident set size (kbytes)"]) * 1024 / 1e9
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return wall, cpu, rss_gb, last


def perplexity(checkpoint: Path, windows: int | None) -> float:
    code = (
        "import sys, torch; from transformers import AutoTokenizer;"
        "from seqcal.evaluation.loading import load_causal_lm;"
        "from seqcal.evaluation.perplexity import perplexity, load_eval_text;"
        f"m = load_causal_lm({str(checkpoint)!r}, torch.float32);"
        f"t = AutoTokenizer.from_pretrained({str(checkpoint)!r});"
        f"r = perplexity(m, t, load_eval_text({str(WIKI / 'wiki.test.raw')!r}), seq_len=2048, "
        f"max_windows={windows!r}, progress=False); print(r.ppl, r.windows)"
    )
    out = subprocess.run(
        [f"{VENV}/bin/python", "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return float(out.stdout.split()[-2])


def run_and_evaluate(name: str, cmd: list[str], out: Path, eval_windows: int | None, evaluate: bool = True,
                     width: int = 18) -> dict:  # fmt: skip
    """Run one tool's command under ``measure``, evaluate the checkpoint it wrote to ``out``, print one row.

    Returns:
        ``{wall_s, cpu_s, peak_rss_gb, ppl, tool_reported}`` (ppl NaN when ``evaluate`` is False).
    """
    wall, cpu, rss, last = measure(cmd)
    ppl = perplexity(out, eval_windows) if evaluate else float("nan")
    print(
        f"{name:<{width}} wall {wall:7.1f} s  cpu {cpu:7.1f} s  peak RSS {rss:5.2f} GB  ppl {ppl:7.2f}",
        flush=True,
    )
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "peak_rss_gb": round(rss, 2), "ppl": round(ppl, 2),
            "tool_reported": last}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--eval-windows", type=int, default=None, help="default: the whole test set")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--no-baseline", action="store_true", help="skip the unquantized model's perplexity")
    parser.add_argument("--skip-eval", default="", help="runs (comma-separated) timed but not evaluated")
    args = parser.parse_args()
    from seqcal.models import default_model_dir

    model = default_model_dir()
    WORK.mkdir(parents=True, exist_ok=True)
    tokens = WORK / f"calib_{args.samples}x{args.seq}.safetensors"
    if not tokens.exists():
        subprocess.run([f"{VENV}/bin/python", "benchmarks/_calib_tokens.py", "--model", str(model), "--text",
                        str(WIKI / "wiki.valid.raw"), "--samples", str(args.samples), "--seq", str(args.seq),
                        "--out", str(tokens)], cwd=ROOT, check=True)  # fmt: skip
    results = {}
    if not args.no_baseline:
        results["fp32 (unquantized)"] = {"ppl": round(perplexity(model, args.eval_windows), 2)}
        print(f"{'fp32 (unquantized)':<18} ppl {results['fp32 (unquantized)']['ppl']:7.2f}", flush=True)
    for name in args.runs.split(","):
        out = WORK / name
        cmd = [*RUNS[name], "--model", str(model), "--tokens", str(tokens), "--out", str(out)]
        evaluate = name not in args.skip_eval.split(",")
        results[name] = run_and_evaluate(name, cmd, out, args.eval_windows, evaluate)
    (WORK / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
