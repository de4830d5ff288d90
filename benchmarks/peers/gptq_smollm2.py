"""seqcal vs llm-compressor 0.14.0.1 on SmolLM2-135M-Instruct: GPTQ and RTN W4A16 (group 64).

Same 128 x 512-token calibration windows from WikiText-2 valid for both tools; reports wall time,
peak RSS of the quantizing process, and WikiText-2 test perplexity (2048-token windows) of each checkpoint.

Usage (from the repo root; the peer venv comes from benchmarks/setup_peer.sh):
    .venv/bin/python benchmarks/peers/gptq_smollm2.py [--runs seqcal-gptq,llmc-gptq,...] [--eval-windows N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "_lib"))  # the shared helpers
from harness import PEER, SEQCAL, WORK, calibration_tokens, perplexity, run_and_evaluate  # noqa: E402

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
    tokens = calibration_tokens(model, args.samples, args.seq)
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
