"""Mixed precision on SmolLM2-135M-Instruct (fp32, WikiText-2): seqcal against auto-round 0.16.1's AutoScheme, and
against uniform GPTQ at the same checkpoint size.

Runs (``--runs``, in the order given; each tool in a process of its own under GNU time: wall, CPU, peak RSS):
- ``seqcal-<bits>``: ``MixedPrecisionModifier`` (GPTQ) at ``average_bits: <bits>`` (seqcal's count: stored bits
  per weight, scales in the model's dtype, so fp32 here); ``seqcal-abs-<bits>``: the same with ``error: absolute``;
  ``seqcal-rtn-<bits>``: the same choice, round to nearest
  (``QuantizationModifier``'s ``mixed_precision``).
- ``autoscheme-<bits>``: auto-round's ``AutoScheme(avg_bits=<bits>)`` (its count: 16-bit scales, a zero point per
  group) then auto-round's quantization at ``--iters`` steps (0: its optimised round to nearest), q/k/v and
  gate/up tied (``benchmarks/_lib/run_autoscheme.py``, auto-round's venv); ``autoscheme-opt-<bits>``: the same with
  auto-round's optimised round to nearest (its default at 0 steps: ``disable_opt_rtn=False``).
- ``gptq-on-autoscheme-<bits>``: GPTQ (the uniform runs' observer) with the widths the ``autoscheme-<bits>`` run
  chose, one config group per width: the solver of the seqcal rows on AutoScheme's allocation.
- ``uniform-w3`` / ``uniform-w4``: GPTQ W3A16 / W4A16, groups of 64; ``mixed-as-w3`` / ``mixed-as-w4``: seqcal's
  mixed precision at exactly the stored bits of that uniform run's checkpoint; ``mixed-abs-as-w3``: the same with
  ``error: absolute``; ``mixed-fine-as-w3``: with the candidates ``FINE`` (no 2 bits, groups of 64 and 128);
  ``mixed-default-as-w3``: with no candidates given (seqcal's default set).
Every run gets the same calibration windows (the first ``--samples`` shuffled 512-token windows of WikiText-2 valid)
and the same candidates (``--candidates``, symmetric int weight-only; ``lm_head`` is not quantized by either tool).
Every checkpoint is evaluated by the same code (``harness.perplexity``: reloaded in fp32 by transformers, the first
``--eval-windows`` 2048-token windows of WikiText-2 test). The bits each run used are counted both ways from the
per-layer widths: ``bits_fp32`` as seqcal stores an fp32 model's weights (codes packed in int32 words, an fp32
scale per group), ``bits_ar`` as auto-round counts (a 16-bit scale and a zero point per group).

Usage (from the repo root; runs made one at a time are kept in .work/mixed_precision_results.json):
    .venv/bin/python benchmarks/peers/mixed_precision_smollm2.py --runs seqcal-3.0,autoscheme-3.0 \
        [--samples 8] [--eval-windows 8] [--iters 0] [--peer-python /work/peers/autoround/bin/python]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
from harness import SEQCAL, WORK, calibration_tokens, measure, perplexity  # noqa: E402

CANDIDATES = "W2A16:g64,W3A16:g64,W4A16:g64,W8A16:channel"
# ``mixed-fine-as-w3``: no 2-bit candidate, the 3- and 4-bit ones at groups of 64 and 128 (3.25 to 4.5 bits)
FINE = "W3A16:g128,W3A16:g64,W4A16:g128,W4A16:g64,W8A16:channel"
UNIFORM = {"uniform-w3": 3, "uniform-w4": 4}  # GPTQ, symmetric int, groups of 64
OBSERVER = (
    "imatrix_mse"  # the uniform runs' weight observer: the one mixed precision gives its preset candidates
)
RESULTS = WORK / "mixed_precision_results.json"


def recipe(name: str, candidates: list[str], results: dict) -> str:
    """The seqcal run's recipe (JSON, which YAML reads); ``mixed-as-*`` takes its uniform run's stored bits."""
    if name in UNIFORM:
        w = _weights(UNIFORM[name], 64)
        return json.dumps({"GPTQModifier": {"config_groups": {"g": {"targets": ["Linear"], "weights": w}},
                                            "ignore": ["lm_head"]}})  # fmt: skip
    if name.startswith("gptq-on-"):
        chosen = widths(WORK / f"mixed-{name.removeprefix('gptq-on-')}", [])
        groups: dict[tuple[int, int], list[str]] = {}
        for layer, width in chosen.items():
            groups.setdefault(width, []).append(layer)
        config = {
            f"w{b}g{g}": {"targets": names, "weights": _weights(b, g)} for (b, g), names in groups.items()
        }
        return json.dumps({"GPTQModifier": {"config_groups": config, "ignore": ["lm_head"]}})
    if name.startswith("mixed-"):  # mixed-as-w3, mixed-abs-as-w3, ...: the uniform run's stored bits
        bits = results["uniform-" + name.rsplit("-as-", 1)[1]]["bits_fp32"]
    else:
        bits = float(name.rsplit("-", 1)[1])
    error = {"error": "absolute"} if name.startswith(("seqcal-abs-", "mixed-abs-")) else {}
    if name.startswith("mixed-fine-"):
        candidates = FINE.split(",")
    # mixed-default-as-*: no candidates given, seqcal's default set
    mixed = {
        "average_bits": bits,
        **({} if name.startswith("mixed-default-") else {"candidates": candidates}),
        **error,
    }
    if name.startswith("seqcal-rtn-"):
        return json.dumps({"QuantizationModifier": {"mixed_precision": mixed, "ignore": ["lm_head"]}})
    return json.dumps({"MixedPrecisionModifier": {**mixed, "ignore": ["lm_head"]}})


def _weights(bits: int, group: int) -> dict:
    """Symmetric int weights of ``bits`` per group of ``group`` (-1: per channel), the runs' observer."""
    strategy = {"strategy": "channel"} if group == -1 else {"strategy": "group", "group_size": group}
    return {"num_bits": bits, "type": "int", "symmetric": True, **strategy, "observer": OBSERVER}


def shapes(model: Path) -> dict[str, tuple[int, int]]:
    """``[out, in]`` of every Linear weight the tools quantize (every 2-D ``*_proj`` weight of the model)."""
    from safetensors import safe_open

    out = {}
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if key.endswith("_proj.weight"):
                    out[key.removesuffix(".weight")] = tuple(f.get_slice(key).get_shape())
    return out


def widths(out: Path, layers: list[str]) -> dict[str, tuple[int, int]]:
    """Each layer's (bits, group size; -1 per channel) in a checkpoint: auto-round's ``layer_schemes.json``, or the
    config groups of seqcal's ``quantization_config`` (a name target before a class target)."""
    if (out / "layer_schemes.json").exists():
        chosen = json.loads((out / "layer_schemes.json").read_text())
        return {n: (c["bits"], c["group_size"]) for n, c in chosen.items() if c["bits"] < 16}
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    found: dict[str, tuple[int, int]] = {}
    for by_name in (True, False):
        for group in groups.values():
            w = group["weights"]
            width = (w["num_bits"], w["group_size"] if w["strategy"] == "group" else -1)
            for target in group["targets"]:
                named = (
                    [n for n in layers if n == target] if by_name else layers if target == "Linear" else []
                )
                found.update({n: width for n in named if n not in found})
    return found


def bits_per_weight(
    chosen: dict[str, tuple[int, int]], shape: dict[str, tuple[int, int]]
) -> tuple[float, float]:
    """(seqcal's stored bits with fp32 scales, auto-round's count) per weight over the layers in ``chosen``."""
    from seqcal.modifiers.mixed_schemes import candidate_scheme, stored_bits

    fp32 = ar = 0.0
    for name, (bits, group) in chosen.items():
        out, n_in = shape[name]
        spec = f"W{bits}A16:" + ("channel" if group == -1 else f"g{group}")
        fp32 += stored_bits(candidate_scheme(spec, ["Linear"], "bench"), (out, n_in), 32)
        groups = out * (1 if group == -1 else math.ceil(n_in / group))
        ar += bits * out * n_in + groups * (16 + bits)  # auto_scheme.utils.compute_layer_bits
    params = sum(shape[n][0] * shape[n][1] for n in chosen)
    return fp32 / params, ar / params


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default="seqcal-3.0,autoscheme-3.0,seqcal-4.25,autoscheme-4.25")
    parser.add_argument("--candidates", default=CANDIDATES)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--iters", type=int, default=0, help="auto-round's steps after AutoScheme (0: RTN)")
    parser.add_argument("--eval-windows", type=int, default=8, help="2048-token windows of WikiText-2 test")
    parser.add_argument("--peer-python", default=os.environ.get("SEQCAL_BENCH_AUTOROUND_PYTHON",
                                                                "/work/peers/autoround/bin/python"))  # fmt: skip
    args = parser.parse_args()
    from seqcal.models import default_model_dir

    model = default_model_dir()
    tokens = calibration_tokens(model, args.samples, 512)
    shape = shapes(model)
    for name in args.runs.split(","):
        results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        out = WORK / f"mixed-{name}"
        if name.startswith("autoscheme-"):
            cmd = [args.peer_python, "benchmarks/_lib/run_autoscheme.py", "--avg-bits", name.split("-")[-1],
                   "--options", args.candidates, "--samples", str(args.samples), "--iters", str(args.iters)]  # fmt: skip
            cmd += ["--opt-rtn"] if name.startswith("autoscheme-opt-") else []
        else:
            path = WORK / f"mixed-{name}.yaml"
            path.write_text(recipe(name, args.candidates.split(","), results))
            cmd = [*SEQCAL, "--recipe", str(path), "--samples", str(args.samples)]
        cmd += ["--model", str(model), "--tokens", str(tokens), "--out", str(out)]
        print("$", " ".join(cmd), flush=True)
        load = os.getloadavg()[0]
        wall, cpu, rss, _ = measure(cmd, log=WORK / f"mixed-{name}.log")
        load_after = os.getloadavg()[0]
        ppl = perplexity(out, args.eval_windows)
        fp32, ar = bits_per_weight(widths(out, list(shape)), shape)
        row = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "peak_rss_gb": round(rss, 2), "ppl": round(ppl, 3),
               "bits_fp32": round(fp32, 4), "bits_ar": round(ar, 4), "load": [round(load, 1), round(load_after, 1)],
               "samples": args.samples, "eval_windows": args.eval_windows}  # fmt: skip
        if name.startswith("autoscheme-"):
            row["iters"] = args.iters
            row["opt_rtn"] = name.startswith("autoscheme-opt-")
        print(f"{name:<18} wall {wall:7.1f} s  cpu {cpu:7.1f} s  peak RSS {rss:5.2f} GB  ppl {ppl:7.3f}  bits "
              f"{fp32:.4f} (fp32 scales) {ar:.4f} (auto-round's count)  load {load:.1f} -> {load_after:.1f}",
              flush=True)  # fmt: skip
        results = (
            json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        )  # another driver may have written
        RESULTS.write_text(json.dumps({**results, name: row}, indent=1))


if __name__ == "__main__":
    main()
