"""Perplexity of SmolLM2-135M-Instruct in the formats vLLM serves (NVFP4A16, NVFP4, block FP8), RTN and GPTQ.

Calibrates on the same 128 x 512-token WikiText-2 valid windows as gptq_smollm2.py, saves each checkpoint,
reloads it with transformers + compressed-tensors (float32) and measures WikiText-2 test perplexity on the
first ``--eval-windows`` windows of 2048 tokens. FP8_BLOCK's 128 x 128 blocks do not fit SmolLM2 (hidden
size 576 is not a multiple of 128: its activation groups of 128 do not divide it), so the block run uses
64 x 64 blocks with dynamic fp8 activation groups of 64. NVFP4 (W4A4: fp4 activations too, under a calibrated
input global scale) is evaluated in bfloat16, the only dtype compressed-tensors 0.20 runs fp4 activations in
(``load_causal_lm`` loads it so).

Usage (from the repo root, PYTHONPATH=src):
    python benchmarks/formats/formats_smollm2.py [--runs nvfp4a16-rtn,...] [--eval-windows 20] [--data ../shared/data]
    (a smoke run: --runs nvfp4-gptq --calib-samples 4 --eval-windows 1 --no-baseline)
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
WIKI = ROOT.parent / "shared" / "data"
FP8_BLOCK64 = {"group_0": {"targets": ["Linear"],
               "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                           "block_structure": [64, 64]},
               "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                                     "group_size": 64, "dynamic": True}}}  # fmt: skip
RUNS = {  # name -> (algorithm, scheme keyword arguments)
    "nvfp4a16-rtn": ("rtn", {"scheme": "NVFP4A16"}),
    "nvfp4a16-gptq": ("gptq", {"scheme": "NVFP4A16"}),
    "nvfp4-rtn": ("rtn", {"scheme": "NVFP4"}),
    "nvfp4-gptq": ("gptq", {"scheme": "NVFP4"}),
    "fp8block64-rtn": ("rtn", {"config_groups": FP8_BLOCK64}),
    "fp8block64-gptq": ("gptq", {"config_groups": FP8_BLOCK64}),
}
QUANTIZE = """
import sys, json, time
from safetensors.torch import load_file
from seqcal.entrypoint import oneshot
from seqcal.modifiers import GPTQModifier, QuantizationModifier
algo, kw, tokens, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = load_file(tokens)["input_ids"][: int(sys.argv[6])]
cls = GPTQModifier if algo == "gptq" else QuantizationModifier
start = time.perf_counter()
oneshot(model=sys.argv[5], dataset=[{"input_ids": r.tolist()} for r in rows], recipe=cls(ignore=["lm_head"], **kw),
        output_dir=out, num_calibration_samples=len(rows), max_seq_length=rows.shape[1], dtype="float32",
        shuffle_calibration_samples=False, overwrite=True)
print(f"seconds {time.perf_counter() - start:.1f}")
"""
EVAL = """
import sys, torch
from transformers import AutoTokenizer
from seqcal.evaluation.loading import load_causal_lm
from seqcal.evaluation.perplexity import load_eval_text, perplexity
model = load_causal_lm(sys.argv[1], torch.float32)
tok = AutoTokenizer.from_pretrained(sys.argv[1])
r = perplexity(model, tok, load_eval_text(sys.argv[2]), seq_len=2048, max_windows=int(sys.argv[3]), progress=False)
print(r.ppl, r.windows)
"""


def _python(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(f"failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--eval-windows", type=int, default=20)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--calib-samples", type=int, default=128, help="first N of the 128 calibration windows"
    )
    parser.add_argument(
        "--data", type=Path, default=WIKI, help="folder with wiki.valid.raw and wiki.test.raw"
    )
    args = parser.parse_args()
    from seqcal.models import default_model_dir

    model = default_model_dir()
    WORK.mkdir(parents=True, exist_ok=True)
    tokens = WORK / "calib_128x512.safetensors"
    if not tokens.exists():
        subprocess.run([sys.executable, "benchmarks/_lib/calib_tokens.py", "--model", str(model), "--text",
                        str(args.data / "wiki.valid.raw"), "--out", str(tokens)], cwd=ROOT, check=True)  # fmt: skip
    test = str(args.data / "wiki.test.raw")
    results = {}
    if not args.no_baseline:
        results["fp32"] = {"ppl": float(_python(EVAL, str(model), test, str(args.eval_windows)).split()[0])}
        print(f"{'fp32 (unquantized)':<18} ppl {results['fp32']['ppl']:.2f}", flush=True)
    for name in args.runs.split(","):
        algo, kw = RUNS[name]
        out = WORK / f"formats-{name}"
        start = time.perf_counter()
        _python(QUANTIZE, algo, json.dumps(kw), str(tokens), str(out), str(model), str(args.calib_samples))
        wall = time.perf_counter() - start
        ppl = float(_python(EVAL, str(out), test, str(args.eval_windows)).split()[0])
        results[name] = {"wall_s": round(wall, 1), "ppl": round(ppl, 2)}
        print(f"{name:<18} wall {wall:7.1f} s  ppl {ppl:.2f}", flush=True)
    (WORK / "formats_results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
