"""Mixed precision against uniform GPTQ at the same checkpoint size on SmolLM2-135M-Instruct (fp32, WikiText-2).

Each run is GPTQ (seqcal, ``ignore: [lm_head]``) on the same calibration windows from WikiText-2 valid; the
mixed runs choose every module's integer weight-only scheme under an average of 3.0 or 4.25 stored bits per
weight (scales counted: fp32 scales, so W4A16 with groups of 64 is 4.5 bits), or at exactly the stored bits of
a uniform run (W3A16 per channel: 3.06 bits; W4A16 g64: 4.5 bits). Prints wall time, the stored bits
per weight of the quantized Linears as the checkpoint's files hold them, and WikiText-2 test perplexity.

Usage (from the repo root):
    .venv/bin/python benchmarks/peers/mixed_precision_smollm2.py [--runs uniform-w4,mixed-4.25,...]
        [--samples 32] [--eval-windows 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "_lib"))  # the shared helpers
from harness import SEQCAL, VENV, WORK, calibration_tokens, run_and_evaluate  # noqa: E402

# integer weight-only candidates, 2.5 to 8.06 stored bits per weight (SmolLM2's 576 inputs take no group of 128)
CANDIDATES = ["W2A16:g64", "W2A16:g32", "W3A16:channel", "W3A16:g64", "W3A16:g32", "W4A16:channel", "W4A16:g64",
              "W4A16:g32", "W8A16:channel"]  # fmt: skip
UNIFORM = {
    "uniform-w3": {"num_bits": 3, "strategy": "channel"},
    "uniform-w4": {"num_bits": 4, "group_size": 64},
}
# name -> (average bits, or the uniform run whose stored bits it takes; what the allocation minimises)
MIXED = {"mixed-3.0": (3.0, "relative"), "mixed-4.25": (4.25, "relative"), "mixed-as-w3": ("uniform-w3", "relative"),
         "mixed-as-w4": ("uniform-w4", "relative"), "mixed-as-w4-abs": ("uniform-w4", "absolute")}  # fmt: skip


def recipe(name: str, results: dict) -> str:
    """The run's recipe (YAML); a mixed run at a uniform run's size reads its stored bits from ``results``."""
    if name in UNIFORM:
        w = {"type": "int", "symmetric": True, "strategy": "group", **UNIFORM[name]}
        group = {"targets": ["Linear"], "weights": w}
        return json.dumps({"GPTQModifier": {"config_groups": {"group_0": group}, "ignore": ["lm_head"]}})
    bits, error = MIXED[name]
    bits = results[bits]["bits"] if isinstance(bits, str) else bits
    args = {"average_bits": bits, "candidates": CANDIDATES, "error": error, "ignore": ["lm_head"]}
    return json.dumps({"MixedPrecisionModifier": args})


def stored_bits(out: Path) -> float:
    """Bits per weight the checkpoint stores for its quantized Linears (codes, scales, zero points, shapes)."""
    code = (
        "import json, sys, glob; from safetensors import safe_open;"
        f"c = json.load(open({str(out / 'config.json')!r}))['quantization_config'];"
        "t = {}; [t.update({k: f.get_tensor(k) for k in f.keys()}) for p in sorted(glob.glob("
        f"{str(out / '*.safetensors')!r})) for f in [safe_open(p, 'pt')]];"
        "mods = {k.rsplit('.', 1)[0] for k in t if k.endswith('.weight_packed') or k.endswith('.weight_scale')};"
        "bits = sum(v.numel() * v.element_size() * 8 for k, v in t.items() if k.rsplit('.', 1)[0] in mods);"
        "n = sum(int(t[m + '.weight_shape'].prod()) for m in mods); print(bits / n)"
    )
    done = subprocess.run(
        [f"{VENV}/bin/python", "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--runs", default="uniform-w4,mixed-as-w4,uniform-w3,mixed-as-w3,mixed-4.25,mixed-3.0"
    )
    parser.add_argument("--eval-windows", type=int, default=20, help="2048-token windows of WikiText-2 test")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    from seqcal.models import default_model_dir

    model = default_model_dir()
    tokens = calibration_tokens(model, args.samples, args.seq)
    results = {}
    for name in args.runs.split(","):
        out, path = WORK / f"mixed-{name}", WORK / f"mixed-{name}.yaml"
        path.write_text(recipe(name, results))
        cmd = [
            *SEQCAL,
            "--recipe",
            str(path),
            "--model",
            str(model),
            "--tokens",
            str(tokens),
            "--out",
            str(out),
        ]
        results[name] = run_and_evaluate(name, cmd, out, args.eval_windows)
        results[name]["bits"] = round(stored_bits(out), 4)
        print(f"{name:<18} stored bits per weight {results[name]['bits']:.4f}", flush=True)
    (WORK / "mixed_precision_results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
