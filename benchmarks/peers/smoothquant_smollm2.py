"""seqcal vs llm-compressor 0.14.0.1 on SmolLM2-135M-Instruct: SmoothQuant + GPTQ W8A8 (static and dynamic).

The same recipe files run in both tools on the same calibration windows (default 128 x 512 tokens of
WikiText-2 valid); reports wall time, peak RSS of the quantizing process and WikiText-2 test perplexity of
each checkpoint, reloaded with transformers + compressed-tensors (which runs the activation quantization).

Usage (from the repo root; the peer venv comes from benchmarks/setup_peer.sh):
    .venv/bin/python benchmarks/peers/smoothquant_smollm2.py [--runs seqcal-sq-static,llmc-sq-static] [--eval-windows N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
from harness import PEER, ROOT, SEQCAL, WORK, calibration_tokens, perplexity, run_and_evaluate  # noqa: E402

RECIPES = ROOT / "recipes"
RUNS = {
    "seqcal-static": [*SEQCAL, "--recipe", str(RECIPES / "gptq_w8a8_static.yaml")],
    "seqcal-sq-static": [*SEQCAL, "--recipe", str(RECIPES / "smoothquant_gptq_w8a8_static.yaml")],
    "seqcal-sq-dynamic": [*SEQCAL, "--recipe", str(RECIPES / "smoothquant_gptq_w8a8.yaml")],
    "llmc-sq-static": [*PEER, "--recipe", str(RECIPES / "smoothquant_gptq_w8a8_static.yaml")],
    "llmc-sq-dynamic": [*PEER, "--recipe", str(RECIPES / "smoothquant_gptq_w8a8.yaml")],
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
        results[name] = run_and_evaluate(name, cmd, out, args.eval_windows)
    (WORK / "smoothquant_results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
