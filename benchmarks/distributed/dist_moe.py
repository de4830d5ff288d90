"""A mixture-of-experts model on 2 processes: each layer's module groups solved by one process vs spread over both.

The layer cut makes an MoE layer one subgraph; its module groups (q/k/v, o, the experts' gate/up sharing one
Hessian, each expert's down) are spread over the processes by solve cost. This compares, on the same synthetic
Qwen3-MoE (random weights, GPTQ W4A16 group 64, one thread per process, gloo on this machine):

* 1 process,
* 2 processes, every layer solved by its owner alone (the split switched off in the ranks),
* 2 processes, the groups spread (the default),

and prints each run's wall time, every rank's seconds in communication (waiting included), and whether the
three checkpoints are equal tensor by tensor (they must be).

Usage (repo root): .venv/bin/python benchmarks/distributed/dist_moe.py [--samples 16] [--seq 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / ".work" / "dist_moe"
sys.path.insert(0, str(ROOT / "tests"))

RECIPE = "GPTQModifier: {scheme: W4A16, ignore: [lm_head, 're:.*mlp.gate$'], block_size: 128}"


def _model(layers: int) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = WORK / f"model-{layers}"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = Qwen3MoeConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
                                num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                num_experts=16, num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
        Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def _one_owner(rank: int) -> None:
    from seqcal.distributed.run import ShardedRun

    ShardedRun._assign_parts = lambda self, partial, modifiers: {}  # in the forked rank only


def main() -> None:
    from dist_helpers import data, run, tensor_hashes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    model = _model(args.layers)
    kwargs = {"model": str(model), "dataset": data(args.samples, args.seq), "recipe": RECIPE,
              "max_seq_length": args.seq, "overwrite": True}  # fmt: skip
    runs = {"1 process": (1, None), "2 processes, one owner per layer": (2, _one_owner),
            "2 processes, groups spread": (2, None)}  # fmt: skip
    hashes = {}
    for i, (label, (world, setup)) in enumerate(runs.items()):
        out = WORK / f"out{i}"
        start = time.perf_counter()
        run(world, WORK / f"err{i}", setup, output_dir=str(out), **kwargs)
        wall = time.perf_counter() - start
        hashes[label] = tensor_hashes(out)
        report = json.loads((out / "quantization_report.json").read_text()).get("distributed") or {}
        comm = [round(r["comm_seconds"], 1) for r in report.get("ranks", [])]
        solvers = {
            tuple(s["solvers"])
            for s in (report.get("ranks") or [{}])[0].get("subgraphs", [])
            if "solvers" in s
        }
        print(f"{label:<34} wall {wall:7.1f} s   communicating (per rank) {comm}   solvers {sorted(solvers)}")
    first = next(iter(hashes.values()))
    print(
        "checkpoints equal tensor by tensor:",
        all(h == first for h in hashes.values()),
        f"({len(first)} tensors)",
    )


if __name__ == "__main__":
    main()
