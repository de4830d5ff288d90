"""Weight observers on SmolLM2-135M-Instruct, W4A16 group 64: RTN / GPTQ with minmax, mse and imatrix_mse,
seqcal and llm-compressor 0.14.0.1 side by side.

The same calibration windows, timing and perplexity protocol as ``gptq_smollm2.py`` (its helpers); the weight
observer is set for both runners through ``SEQCAL_BENCH_OBSERVER`` (``scheme.py``). All runs are fp32. The
results are written to ``benchmarks/.work/imatrix_results.json`` after every run.

Usage (from the repo root):
    .venv/bin/python benchmarks/peers/imatrix_smollm2.py [--runs seqcal-gptq-imatrix,llmc-gptq-imatrix,...]
        [--eval-windows N] [--samples N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
from harness import PEER, SEQCAL, WORK, calibration_tokens, run_and_evaluate  # noqa: E402

# run name -> (command, weight observer); the observer None is the scheme's default (minmax)
RUNS: dict[str, tuple[list[str], str | None]] = {
    "seqcal-rtn": ([*SEQCAL, "--algo", "rtn"], None),
    "seqcal-rtn-mse": ([*SEQCAL, "--algo", "rtn"], "mse"),
    "seqcal-rtn-imatrix": ([*SEQCAL, "--algo", "rtn"], "imatrix_mse"),
    "seqcal-gptq": ([*SEQCAL, "--algo", "gptq"], None),
    "seqcal-gptq-mse": ([*SEQCAL, "--algo", "gptq"], "mse"),
    "seqcal-gptq-imatrix": ([*SEQCAL, "--algo", "gptq"], "imatrix_mse"),
    "llmc-rtn-imatrix": ([*PEER, "--algo", "rtn"], "imatrix_mse"),
    "llmc-gptq": ([*PEER, "--algo", "gptq"], None),
    "llmc-gptq-imatrix": ([*PEER, "--algo", "gptq"], "imatrix_mse"),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument("--samples", type=int, default=128, help="calibration windows of 512 tokens")
    args = parser.parse_args()
    from seqcal.models import default_model_dir

    model = default_model_dir()
    tokens = calibration_tokens(model, args.samples, 512)
    path = WORK / "imatrix_results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for name in args.runs.split(","):
        cmd, observer = RUNS[name]
        os.environ.pop("SEQCAL_BENCH_OBSERVER", None)
        if observer:
            os.environ["SEQCAL_BENCH_OBSERVER"] = observer
        out = WORK / f"{name}-{args.samples}"
        cmd = [*cmd, "--model", str(model), "--tokens", str(tokens), "--out", str(out)]
        row = run_and_evaluate(name, cmd, out, args.eval_windows, width=20)
        results[f"{name} ({args.samples} x 512)"] = {"observer": observer or "minmax", **row}
        path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
