"""Memory bound: GPTQ W4A16 of a synthetic 1.57B-parameter Llama (3.1 GB bf16 safetensors) on this CPU.

Writes the random checkpoint shard by shard (never the whole model in RAM), then runs ``seqcal oneshot`` on
the directory under GNU time and reports peak RSS against the size on disk (target: at most one third).
With ``--layers 4`` it also checks that the offloaded run's checkpoint equals, bit for bit, the one made with
the whole model in RAM.

Usage: .venv/bin/python benchmarks/memory/big_offload.py [--layers 32] [--samples 16] [--seq 256] [--compare]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / ".work"
RUN = """
import sys, torch, time
from transformers import AutoModelForCausalLM
from seqcal.entrypoint import oneshot
g = torch.Generator().manual_seed(0)
n, seq, mode = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
data = [{"input_ids": torch.randint(0, 32000, (seq,), generator=g).tolist()} for _ in range(n)]
model = sys.argv[1] if mode == "offload" else AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
start = time.perf_counter()
oneshot(model=model, dataset=data, recipe="GPTQModifier: {scheme: W4A16, ignore: [lm_head]}", output_dir=sys.argv[2],
        max_seq_length=seq, overwrite=True)
print(f"seconds {time.perf_counter() - start:.1f}")
"""


def write_checkpoint(path: Path, layers: int, vocab_size: int = 32000, intermediate: int = 5632) -> int:
    """A random bf16 Llama checkpoint in ~512 MB shards; returns its size in bytes."""
    config = LlamaConfig(hidden_size=2048, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=vocab_size, torch_dtype="bfloat16")  # fmt: skip
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    return write_random_checkpoint(path, config, {n: p.shape for n, p in skeleton.named_parameters()})


def write_random_checkpoint(path: Path, config: Any, shapes: dict[str, torch.Size]) -> int:
    """``config`` and random bf16 tensors of ``shapes`` (norms 1, the rest N(0, 0.02)) in ~512 MB safetensors
    shards with their index, under the checkpoint names ``shapes`` gives; returns the bytes written."""
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map, shards, size, total = {}, 0, 0, 0
    for i, (name, shape) in enumerate(shapes.items()):
        value = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02
        shard[name] = value.to(torch.bfloat16)
        size += shard[name].numel() * 2
        if size > 512 * 1024**2 or i == len(shapes) - 1:
            file = f"model-{shards:05d}.safetensors"
            save_file(shard, str(path / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shards, total, shard, size = shards + 1, total + size, {}, 0
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def run(model: Path, out: Path, samples: int, seq: int, mode: str) -> tuple[float, float]:
    cmd = [
        "/usr/bin/time",
        "-v",
        sys.executable,
        "-c",
        RUN,
        str(model),
        str(out),
        str(samples),
        str(seq),
        mode,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(proc.stderr[-4000:])
    stats = dict(line.strip().rsplit(": ", 1) for line in proc.stderr.splitlines() if ": " in line)
    seconds = float(proc.stdout.split()[-1])
    return seconds, int(stats["Maximum resident set size (kbytes)"]) * 1024 / 1e9


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--compare", action="store_true", help="also run in RAM and compare bit for bit")
    args = parser.parse_args()
    model = WORK / f"synthetic-llama-{args.layers}L"
    start = time.perf_counter()
    size = write_checkpoint(model, args.layers) if not (model / "config.json").exists() or not any(
        model.glob("*.safetensors")) else sum(f.stat().st_size for f in model.glob("*.safetensors"))  # fmt: skip
    params = size / 2 / 1e9
    print(
        f"checkpoint: {params:.2f}B params, {size / 1e9:.2f} GB bf16 on disk ({time.perf_counter() - start:.0f} s)"
    )
    seconds, rss = run(model, WORK / f"out-{args.layers}L-offload", args.samples, args.seq, "offload")
    verdict = "within" if rss <= size / 3e9 else "ABOVE"
    print(f"offloaded: {seconds:.0f} s, peak RSS {rss:.3f} GB = {rss / (size / 1e9):.3f} x size on disk "
          f"({verdict} the bound of one third: {size / 3e9:.3f} GB)")  # fmt: skip
    if args.compare:
        seconds_ram, rss_ram = run(model, WORK / f"out-{args.layers}L-ram", args.samples, args.seq, "ram")
        print(f"in RAM:    {seconds_ram:.0f} s, peak RSS {rss_ram:.3f} GB")
        a, b = tensors(WORK / f"out-{args.layers}L-offload"), tensors(WORK / f"out-{args.layers}L-ram")
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        print(f"checkpoints bit-identical: {same} ({len(a)} tensors)")


if __name__ == "__main__":
    main()
