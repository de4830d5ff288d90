"""NVFP4 (W4A4) on SmolLM2-135M-Instruct: seqcal vs llm-compressor 0.14, each recipe file run unchanged by both.

Recipes: llm-compressor's NVFP4 example (recipes/llmc_nvfp4.yaml: RTN fp4 weights, calibrated activation global
scale) and GPTQ NVFP4 (recipes/gptq_nvfp4.yaml). Both tools calibrate in float32 on the same N x 512-token
WikiText-2 valid windows (benchmarks/_lib/calib_tokens.py) through benchmarks/_lib/run_kv_recipe.py, one thread each
(OMP_NUM_THREADS=1): CPU seconds (user+sys), wall seconds and peak RSS are GNU time's for the whole quantizing
process (model load and save included); on a shared machine CPU seconds are the comparable number.
Every checkpoint, and the unquantized model, is evaluated by the same seqcal code in bfloat16 (compressed-tensors
0.20 runs fp4 activations only in bfloat16): WikiText-2 test perplexity on 2048-token windows.

Usage (from the repo root, PYTHONPATH=src; llm-compressor in /work/main/.peer-venv or --peer-python):
    python benchmarks/peers/nvfp4_smollm2.py [--runs seqcal-rtn,llmc-rtn,seqcal-gptq,llmc-gptq] [--eval-windows 8]
        [--samples 32] [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
from harness import measure  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / ".work"
WIKI = ROOT.parent / "shared" / "data"
PEER = Path("/work/main/.peer-venv/bin/python")
RUNS = {  # name -> (tool, recipe)
    "seqcal-rtn": ("seqcal", "recipes/llmc_nvfp4.yaml"),
    "llmc-rtn": ("llmc", "recipes/llmc_nvfp4.yaml"),
    "seqcal-gptq": ("seqcal", "recipes/gptq_nvfp4.yaml"),
    "llmc-gptq": ("llmc", "recipes/gptq_nvfp4.yaml"),
    "seqcal-fp8-block": ("seqcal", "recipes/rtn_fp8_block.yaml"),
    "llmc-fp8-block": ("llmc", "recipes/rtn_fp8_block.yaml"),
}
EVAL = """
import sys, torch
from transformers import AutoTokenizer
from seqcal.evaluation.loading import load_causal_lm
from seqcal.evaluation.perplexity import load_eval_text, perplexity
torch.set_num_threads(1)
path = sys.argv[1]
model = load_causal_lm(path, torch.bfloat16)
tok = AutoTokenizer.from_pretrained(path)
r = perplexity(model, tok, load_eval_text(sys.argv[2]), seq_len=2048, max_windows=int(sys.argv[3]), progress=False)
print(r.ppl, r.windows)
"""


def single_thread_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def evaluate(checkpoint: Path, windows: int, data: Path) -> tuple[float, int]:
    env = {**single_thread_env(), "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", EVAL, str(checkpoint), str(data / "wiki.test.raw"), str(windows)],
                          cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"evaluation of {checkpoint} failed:\n{proc.stderr[-3000:]}")
    ppl, n = proc.stdout.split()[-2:]
    return float(ppl), int(n)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default="seqcal-rtn,llmc-rtn,seqcal-gptq,llmc-gptq")
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--samples", type=int, default=32, help="calibration windows of 512 tokens")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--same-order", action="store_true",
                        help="llm-compressor unshuffled, seqcal in the same order (see run_kv_recipe.py)")  # fmt: skip
    parser.add_argument("--peer-python", type=Path, default=PEER)
    parser.add_argument(
        "--data", type=Path, default=WIKI, help="folder with wiki.valid.raw and wiki.test.raw"
    )
    args = parser.parse_args()
    os.environ.update(single_thread_env())  # GNU time's children inherit one thread each
    from seqcal.models import default_model_dir

    model = default_model_dir()
    WORK.mkdir(parents=True, exist_ok=True)
    tokens = WORK / f"calib_{args.samples}x512.safetensors"
    if not tokens.exists():
        subprocess.run([sys.executable, "benchmarks/_lib/calib_tokens.py", "--model", str(model), "--text",
                        str(args.data / "wiki.valid.raw"), "--samples", str(args.samples), "--out", str(tokens)],
                       cwd=ROOT, check=True)  # fmt: skip
    results_path = WORK / "nvfp4_results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if not args.no_baseline:
        ppl, n = evaluate(model, args.eval_windows, args.data)
        results["bf16 (unquantized)"] = {"ppl": round(ppl, 3), "windows": n}
        print(f"{'bf16 (unquantized)':<18} ppl {ppl:.3f} ({n} windows)", flush=True)
        results_path.write_text(json.dumps(results, indent=1))
    names = args.runs.split(",")
    for name in names:  # quantize every run first, then evaluate: timings survive a cut-short evaluation
        tool, recipe = RUNS[name]
        python = str(args.peer_python) if tool == "llmc" else sys.executable
        cmd = [python, "benchmarks/_lib/run_kv_recipe.py", "--tool", tool, "--recipe", recipe,
               "--model", str(model), "--tokens", str(tokens), "--out", str(WORK / f"nvfp4-{name}")]  # fmt: skip
        cmd += ["--same-order"] if args.same_order else []
        wall, cpu, rss, last = measure(cmd)
        results[name] = {"cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "peak_rss_gb": round(rss, 2),
                         "tool_reported": last}  # fmt: skip
        print(f"{name:<18} cpu {cpu:6.1f} s  wall {wall:6.1f} s  peak RSS {rss:5.2f} GB", flush=True)
        results_path.write_text(json.dumps(results, indent=1))
    for name in names:
        ppl, n = evaluate(WORK / f"nvfp4-{name}", args.eval_windows, args.data)
        results[name].update(ppl=round(ppl, 3), windows=n)
        print(f"{name:<18} ppl {ppl:.3f} ({n} windows)", flush=True)
        results_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
