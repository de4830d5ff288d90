"""One decoder layer's GPTQ time, seqcal against llm-compressor 0.14, in one dtype: where a whole run of either
tool is too long to repeat, one layer compares them without the fixed costs of a run.

Each tool quantizes truncated copies of SmolLM2-135M-Instruct (its first layer, then its first two layers; the
embeddings, final norm and tied head as they are) in the given dtype with the shared W4A16 g64 scheme, on the same
calibration windows. A layer's time is the difference of the two runs' own timers (``seconds`` of each runner:
the quantizing call and the save, without the imports), so the fixed costs cancel. Wall time and peak RSS of
the whole processes are printed beside it.

Usage (from the repository root, both venvs as for ``gptq_smollm2.py``; one run at a time on a quiet machine):
    PYTHONPATH=src:benchmarks/_lib HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false .venv/bin/python benchmarks/peers/per_layer.py \\
        --tokens benchmarks/.work/calib_128x512.safetensors --dtype bfloat16 [--tools seqcal,llmc]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
from harness import PEER, SEQCAL, WORK, measure  # noqa: E402
from safetensors import safe_open
from safetensors.torch import save_file

DEFAULT_MODEL = Path.home() / ".cache" / "seqcal" / "smollm2-135m-instruct"  # the converted embedded default


def truncated(model: Path, layers: int, dtype: torch.dtype, out: Path) -> Path:
    """A copy of the checkpoint at ``model`` with its first ``layers`` decoder layers, in ``dtype``."""
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    config.update(num_hidden_layers=layers, dtype=str(dtype).removeprefix("torch."))
    tensors = {}
    with safe_open(model / "model.safetensors", framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            parts = key.split(".")
            if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= layers:
                continue
            tensors[key] = f.get_tensor(key).to(dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (model / name).exists():
            shutil.copy(model / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=Path, required=True, help="input_ids safetensors (calib_tokens.py)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tools", default="seqcal,llmc")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    runners = {"seqcal": SEQCAL, "llmc": PEER}
    tools = args.tools.split(",")
    if unknown := [t for t in tools if t not in runners]:
        raise SystemExit(f"unknown tools {unknown}; choose from {', '.join(runners)}")
    print(f"{'tool':>7} {'dtype':>9} {'1 layer s':>10} {'2 layers s':>11} {'a layer s':>10} "
          f"{'wall 2L s':>10} {'RSS 2L GB':>10}", flush=True)  # fmt: skip
    for tool in tools:
        seconds, last = [], (0.0, 0.0)
        for layers in (1, 2):
            model = truncated(args.model, layers, dtype, WORK / f"{args.model.name}-{args.dtype}-{layers}L")
            out = WORK / f"per-layer-{tool}-{args.dtype}-{layers}L"
            cmd = [*runners[tool], "--model", str(model), "--tokens", str(args.tokens), "--out", str(out),
                   "--dtype", args.dtype]  # fmt: skip
            wall, _, rss, line = measure(cmd)
            if not line.startswith("seconds "):
                raise SystemExit(f"{tool}: no 'seconds' line in its output (last line: {line!r})")
            seconds.append(float(line.split()[1]))
            last = (wall, rss)
            shutil.rmtree(out, ignore_errors=True)
        print(f"{tool:>7} {args.dtype:>9} {seconds[0]:10.1f} {seconds[1]:11.1f} {seconds[1] - seconds[0]:10.1f} "
              f"{last[0]:10.1f} {last[1]:10.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
