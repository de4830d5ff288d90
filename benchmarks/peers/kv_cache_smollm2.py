"""FP8 weights + static fp8 activations with and without an FP8 KV cache on SmolLM2-135M-Instruct: seqcal vs
llm-compressor 0.14 on llm-compressor's own KV-cache example recipe (recipes/llmc_fp8_kv_cache.yaml).

Both calibrate on the same 128 x 512-token WikiText-2 valid windows (benchmarks/_lib/calib_tokens.py), in float32;
wall time and peak RSS are GNU time's for the whole quantizing process (model load and save included).
Each checkpoint is reloaded with transformers + compressed-tensors (float32: fp8 weights and static fp8 input
activations as compressed-tensors runs them) and its keys and values are fake-quantized to fp8 with the
checkpoint's k_scale / v_scale (``seqcal.modifiers.kv_cache.fake_quantized_kv``: transformers 5.24 with
compressed-tensors 0.20 drops them as unexpected keys), then WikiText-2 test perplexity on 2048-token windows.

Usage (from the repo root, PYTHONPATH=src; llm-compressor in /work/main/.peer-venv or --peer-python):
    python benchmarks/peers/kv_cache_smollm2.py [--runs seqcal-fp8,seqcal-fp8-kv,llmc-fp8-kv] [--eval-windows 40]
        [--samples 128] [--data ../shared/data]
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
RECIPE = "recipes/llmc_fp8_kv_cache.yaml"
PEER = Path("/work/main/.peer-venv/bin/python")
RUNS = {  # name -> (tool, extra arguments)
    "seqcal-fp8": ("seqcal", ["--no-kv"]),
    "seqcal-fp8-kv": ("seqcal", []),
    "llmc-fp8-kv": ("llmc", []),
}
EVAL = """
import sys, torch
from transformers import AutoTokenizer
from seqcal.evaluation.loading import load_causal_lm
from seqcal.evaluation.perplexity import load_eval_text, perplexity
from seqcal.modifiers.kv_cache import checkpoint_kv_scales, fake_quantized_kv
from save_helpers import checkpoint_tensors
path = sys.argv[1]
model = load_causal_lm(path, torch.float32)
tok = AutoTokenizer.from_pretrained(path)
scales = checkpoint_kv_scales(checkpoint_tensors(__import__("pathlib").Path(path)))
with fake_quantized_kv(model, scales):
    r = perplexity(model, tok, load_eval_text(sys.argv[2]), seq_len=2048, max_windows=int(sys.argv[3]),
                   progress=False)
print(r.ppl, r.windows, len(scales))
"""


def evaluate(checkpoint: Path, windows: int, data: Path) -> tuple[float, int, int]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", EVAL, str(checkpoint), str(data / "wiki.test.raw"), str(windows)],
                          cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"evaluation of {checkpoint} failed:\n{proc.stderr[-3000:]}")
    ppl, n, kv = proc.stdout.split()[-3:]
    return float(ppl), int(n), int(kv)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument("--samples", type=int, default=128, help="calibration windows of 512 tokens")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--peer-python", type=Path, default=PEER)
    parser.add_argument(
        "--data", type=Path, default=WIKI, help="folder with wiki.valid.raw and wiki.test.raw"
    )
    args = parser.parse_args()
    from seqcal.models import default_model_dir

    model = default_model_dir()
    WORK.mkdir(parents=True, exist_ok=True)
    tokens = WORK / f"calib_{args.samples}x512.safetensors"  # the first N of the same shuffled windows
    if not tokens.exists():
        subprocess.run([sys.executable, "benchmarks/_lib/calib_tokens.py", "--model", str(model), "--text",
                        str(args.data / "wiki.valid.raw"), "--samples", str(args.samples), "--out", str(tokens)],
                       cwd=ROOT, check=True)  # fmt: skip
    results = {}
    if not args.no_baseline:
        ppl, n, _ = evaluate(model, args.eval_windows, args.data)
        results["fp32"] = {"ppl": round(ppl, 3), "windows": n}
        print(f"{'fp32 (unquantized)':<16} ppl {ppl:.3f} ({n} windows)", flush=True)
    for name in args.runs.split(","):
        tool, extra = RUNS[name]
        python = str(args.peer_python) if tool == "llmc" else sys.executable
        out = WORK / f"kv-{name}"
        cmd = [python, "benchmarks/_lib/run_kv_recipe.py", "--tool", tool, "--recipe", RECIPE, *extra,
               "--model", str(model), "--tokens", str(tokens), "--out", str(out)]  # fmt: skip
        wall, cpu, rss, last = measure(cmd)
        ppl, n, kv = evaluate(out, args.eval_windows, args.data)
        results[name] = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "peak_rss_gb": round(rss, 2),
                         "ppl": round(ppl, 3), "windows": n, "kv_scaled_layers": kv, "tool_reported": last}  # fmt: skip
        print(f"{name:<16} wall {wall:6.1f} s  cpu {cpu:6.1f} s  peak RSS {rss:5.2f} GB  ppl {ppl:.3f}  "
              f"({n} windows, {kv} layers with k/v scales)", flush=True)  # fmt: skip
    (WORK / "kv_cache_results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
