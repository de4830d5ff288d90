"""Memory bound for MoE: GPTQ W4A16 of a synthetic ~1.1B-parameter Qwen3-MoE read from disk.

Writes a random bf16 checkpoint shard by shard in transformers' own per-expert layout
(``mlp.experts.{i}.gate_proj.weight``, never the whole model in RAM), then runs ``oneshot`` on the directory
(weights offloaded, every expert calibrated on every token) under GNU time and reports peak RSS against
the size on disk (the bound for dense models: at most one third), and how many expert weights came out
quantized. With ``--max-host-memory B`` the run is given that budget (``oneshot(max_host_memory=B)``, as the
command's ``--max-host-memory``): the plan's decisions (the report's) are printed, then its predicted host peak against the
measured one (``host_memory`` of quantization_report.json) and GNU time's peak against B; exits 1 above B.

Usage: .venv/bin/python benchmarks/memory/moe_membound.py [--layers 10] [--experts 64] [--samples 4] [--seq 128]
           [--max-host-memory 900MB]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from big_offload import write_random_checkpoint
from safetensors import safe_open
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / ".work"
RUN = """
import sys, torch, time
from seqcal.entrypoint import oneshot
g = torch.Generator().manual_seed(0)
n, seq, budget = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] or None
data = [{"input_ids": torch.randint(0, 32000, (seq,), generator=g).tolist()} for _ in range(n)]
start = time.perf_counter()
oneshot(model=sys.argv[1], dataset=data, recipe="GPTQModifier: {scheme: W4A16, ignore: [lm_head]}",
        output_dir=sys.argv[2], max_seq_length=seq, num_calibration_samples=n, overwrite=True,
        max_host_memory=budget)
print(f"seconds {time.perf_counter() - start:.1f}")
"""


def write_checkpoint(path: Path, layers: int, experts: int) -> int:
    """A random bf16 Qwen3-MoE checkpoint, per-expert tensors, ~512 MB shards; returns its size in bytes."""
    config = Qwen3MoeConfig(hidden_size=1024, moe_intermediate_size=512, intermediate_size=2048, num_experts=experts,
                            num_experts_per_tok=4, num_hidden_layers=layers, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=128, vocab_size=32000, torch_dtype="bfloat16")  # fmt: skip
    with torch.device("meta"):
        skeleton = Qwen3MoeForCausalLM(config)
    from seqcal.experts import linearize_experts
    from seqcal.experts.store import checkpoint_keys

    linearize_experts(skeleton)  # per-expert parameters, under the names transformers' save gives them
    params = dict(skeleton.named_parameters())
    keys = checkpoint_keys(skeleton, list(params))
    return write_random_checkpoint(path, config, {keys[name]: p.shape for name, p in params.items()})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument(
        "--max-host-memory", default="", help="e.g. 900MB: the run's host budget (default: none)"
    )
    args = parser.parse_args()
    tag = f"{args.layers}L-{args.experts}E"
    model, out = WORK / f"synthetic-qwen3moe-{tag}", WORK / f"out-qwen3moe-{tag}"
    start = time.perf_counter()
    if (model / "model.safetensors.index.json").exists():
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    else:
        size = write_checkpoint(model, args.layers, args.experts)
    print(f"checkpoint: {size / 2 / 1e9:.2f}B params, {size / 1e9:.2f} GB bf16 on disk "
          f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
    cmd = [
        "/usr/bin/time",
        "-v",
        sys.executable,
        "-c",
        RUN,
        str(model),
        str(out),
        str(args.samples),
        str(args.seq),
        args.max_host_memory,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(proc.stderr[-4000:])
    stats = dict(line.strip().rsplit(": ", 1) for line in proc.stderr.splitlines() if ": " in line)
    rss = int(stats["Maximum resident set size (kbytes)"]) * 1024 / 1e9
    verdict = "within" if rss <= size / 3e9 else "ABOVE"
    print(f"offloaded: {proc.stdout.split()[-1]} s, peak RSS {rss:.3f} GB = {rss / (size / 1e9):.3f} x size on "
          f"disk ({verdict} the bound of one third: {size / 3e9:.3f} GB)")  # fmt: skip
    packed = []
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            packed += [k for k in f.keys() if ".experts." in k and k.endswith("weight_packed")]
    print(f"quantized expert weights: {len(packed)} of {args.layers * args.experts * 3}")
    if args.max_host_memory:
        if not budget_kept(out / "quantization_report.json", rss):
            raise SystemExit(1)


def budget_kept(report_path: Path, rss: float) -> bool:
    """Prints the plan's predicted host peak against the measured ones; returns whether GNU time's peak ``rss``
    (GB) is within the budget the report holds."""
    host = json.loads(report_path.read_text())["host_memory"]
    print("\n".join(host["decisions"]))
    budget, predicted, measured = (
        host[k] / 1e9 for k in ("max_host_memory", "predicted_peak", "measured_peak")
    )
    print(
        f"plan: predicted host peak {predicted:.3f} GB, measured {measured:.3f} GB (report) / {rss:.3f} GB "
        f"(GNU time): {(predicted / measured - 1) * 100:+.1f}% / {(predicted / rss - 1) * 100:+.1f}%; "
        f"budget {budget:.3f} GB: {'kept' if rss <= budget else 'EXCEEDED'}"
    )
    return rss <= budget


if __name__ == "__main__":
    main()
