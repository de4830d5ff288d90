"""AWQ vs round-to-nearest, seqcal vs llm-compressor 0.14.0.1, on SmolLM2-135M-Instruct: W4A16 asymmetric,
group 64 (SmolLM2's 576 inputs are not a multiple of 128).

Both tools calibrate on the same windows (the first ``--samples`` of gptq_smollm2.py's 128 x 512-token
WikiText-2 valid windows) with their default AWQ arguments (duo_scaling True, n_grid 20); reports wall
time, peak RSS of the quantizing process and WikiText-2 test perplexity (2048-token windows). The helpers
(timing under GNU time, perplexity in a subprocess) are gptq_smollm2.py's.

Usage (from the repo root; the peer venv comes from benchmarks/setup_peer.sh; SEQCAL_WIKI_DIR: where
wiki.{valid,test}.raw are when not in ../shared/data):
    .venv/bin/python benchmarks/peers/awq_smollm2.py [--runs seqcal-awq,llmc-awq,seqcal-rtn] [--samples 128]
        [--eval-windows N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
import harness  # noqa: E402
from harness import PEER, SEQCAL, WORK, calibration_tokens, perplexity, run_and_evaluate  # noqa: E402

RUNS = {
    "seqcal-rtn": [*SEQCAL, "--algo", "rtn"],
    "seqcal-awq": [*SEQCAL, "--algo", "awq"],
    "seqcal-awq-exhaustive": [
        *SEQCAL,
        "--algo",
        "awq",
        "--screen-keep",
        "none",
    ],  # every point on every batch
    "llmc-awq": [*PEER, "--algo", "awq"],
    "llmc-rtn": [*PEER, "--algo", "rtn"],
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default="seqcal-rtn,seqcal-awq,llmc-awq")
    parser.add_argument("--samples", type=int, default=128, help="the first N of the 128 x 512 windows")
    parser.add_argument("--eval-windows", type=int, default=None, help="default: the whole test set")
    parser.add_argument("--n-grid", type=int, default=20, help="AWQ's grid points (both tools)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unquantized model's perplexity")
    args = parser.parse_args()
    from seqcal.models import default_model_dir

    os.environ["SEQCAL_BENCH_SYMMETRIC"] = "0"  # both runners read the scheme from scheme.py
    # WikiText-2 is at ../shared/data from the repository root; SEQCAL_WIKI_DIR points elsewhere (a worktree)
    harness.WIKI = Path(os.environ.get("SEQCAL_WIKI_DIR", harness.WIKI))
    model = default_model_dir()
    tokens = calibration_tokens(model, 128, 512)
    results = {}
    if not args.no_baseline:
        results["fp32"] = {"ppl": round(perplexity(model, args.eval_windows), 2)}
        print(f"{'fp32':<12} ppl {results['fp32']['ppl']:7.2f}", flush=True)
    for name in args.runs.split(","):
        out = WORK / f"awq-{name}"
        cmd = [*RUNS[name], "--model", str(model), "--tokens", str(tokens), "--out", str(out),
               "--samples", str(args.samples), *(["--n-grid", str(args.n_grid)] if "awq" in name else [])]  # fmt: skip
        results[name] = run_and_evaluate(name, cmd, out, args.eval_windows, width=12)
    tag = "+".join(args.runs.split(","))
    (WORK / f"awq_results_{args.samples}x512_grid{args.n_grid}_{tag}.json").write_text(
        json.dumps(results, indent=1)
    )


if __name__ == "__main__":
    main()
