"""Tracing speed on large architectures built on the meta device (no weights are ever materialised).

Usage: .venv/bin/python benchmarks/tracing/trace_speed.py
Prints, per configuration: layers, parameters (on meta), trace+partition wall time, subgraph count.
"""

from __future__ import annotations

import time

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from seqcal import trace_subgraphs

CONFIGS = {
    "llama-70b-like (80 layers)": (
        LlamaForCausalLM,
        LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                    num_key_value_heads=8, vocab_size=128256),
    ),
    "qwen3-32b-like (64 layers)": (
        Qwen3ForCausalLM,
        Qwen3Config(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                    num_key_value_heads=8, vocab_size=151936, head_dim=128),
    ),
    "mixtral-8x7b-like (32 layers)": (
        MixtralForCausalLM,
        MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, num_local_experts=8, vocab_size=32000),
    ),
}  # fmt: skip


def main() -> None:
    print(f"{'model':<32} {'params':>8} {'trace s':>8} {'subgraphs':>9}")
    for name, (cls, config) in CONFIGS.items():
        with torch.device("meta"):
            model = cls(config).eval()
        params = sum(p.numel() for p in model.parameters()) / 1e9
        ids = torch.randint(0, 1000, (1, 16))
        start = time.perf_counter()
        subgraphs = trace_subgraphs(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        elapsed = time.perf_counter() - start
        print(f"{name:<32} {params:>7.1f}B {elapsed:>8.2f} {len(subgraphs):>9}")


if __name__ == "__main__":
    main()
