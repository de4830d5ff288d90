"""seqcal vs llm-compressor 0.14.0.1 on SmolLM2-135M-Instruct: SparseGPT 2:4 (+ GPTQ W4A16 g64) recipes.

Both tools run the same recipe file on the same 128 x 512-token WikiText-2 valid windows (gptq_smollm2.py's
calibration set); reports wall time, CPU time, peak RSS of the calibrating process and WikiText-2 test
perplexity (2048-token windows) of each checkpoint, with gptq_smollm2.py's helpers.

Usage (from the repo root; the peer venv comes from benchmarks/setup_peer.sh):
    .venv/bin/python benchmarks/peers/sparse_smollm2.py [--runs seqcal-sgpt24-w4g64,llmc-sgpt24-w4g64] [--eval-windows N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
import harness  # noqa: E402
from harness import PEER, VENV, WORK, calibration_tokens, run_and_evaluate  # noqa: E402

RECIPES = {
    "sgpt24": "recipes/sparsegpt_2of4.yaml",
    "sgpt24-w4g64": "recipes/sparsegpt_2of4_w4a16_g64.yaml",
    "sgpt24-fp8": "recipes/sparsegpt_2of4_fp8_dynamic.yaml",
}
TOOLS = {"seqcal": [f"{VENV}/bin/python"], "llmc": [PEER[0]]}
RUNS = {f"{tool}-{name}": (tool, recipe) for name, recipe in RECIPES.items() for tool in TOOLS}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--eval-windows", type=int, default=None, help="default: the whole test set")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--wiki", default=str(harness.WIKI), help="folder with wiki.{valid,test}.raw")
    args = parser.parse_args()
    harness.WIKI = Path(args.wiki)  # calibration_tokens() and perplexity() read the test text from there
    from seqcal.models import default_model_dir

    model = default_model_dir()
    tokens = calibration_tokens(model, args.samples, args.seq)
    results = {}
    for name in args.runs.split(","):
        tool, recipe = RUNS[name]
        out = WORK / name
        cmd = [*TOOLS[tool], "benchmarks/_lib/run_recipe.py", "--tool", tool, "--recipe", recipe, "--model", str(model),
               "--tokens", str(tokens), "--out", str(out)]  # fmt: skip
        results[name] = run_and_evaluate(name, cmd, out, args.eval_windows, width=22)
        (WORK / "sparse_results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
