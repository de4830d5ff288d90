"""Tracing with many targets: a 48-layer, 128-expert Qwen3-MoE (30.5B parameters) on the meta device.

Times each step that runs before calibration on a model of that size: building it on meta, taking its experts
apart into 18432 per-expert Linears, resolving a GPTQ recipe's targets, and tracing + partitioning with the
decoder layers and the experts modules (48; the tracer then goes through attention and router code) as
sequential targets, plus the one-pass attempt (declined at once for routed experts). No weight is read or allocated.

Usage: .venv/bin/python benchmarks/tracing/moe_trace.py [--layers 48] [--experts 128]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from seqcal.execution.pipeline import PipelineArgs, one_pass_subgraphs  # noqa: E402
from seqcal.execution.subgraphs import trace_subgraphs  # noqa: E402
from seqcal.experts import linearize_experts  # noqa: E402
from seqcal.modifiers import GPTQModifier  # noqa: E402


def timed(label: str, fn):  # noqa: ANN001, ANN201
    start = time.perf_counter()
    result = fn()
    print(f"{label:<52s} {time.perf_counter() - start:6.1f} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    config = Qwen3MoeConfig(num_hidden_layers=args.layers, num_experts=args.experts, num_experts_per_tok=8,
                            hidden_size=2048, moe_intermediate_size=768, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, vocab_size=151936)  # fmt: skip

    def build() -> torch.nn.Module:
        with init_empty_weights(include_buffers=False):
            return Qwen3MoeForCausalLM(config).eval()

    model = timed("build on meta", build)
    print(f"  {sum(p.numel() for p in model.parameters()) / 1e9:.1f}B parameters")
    handle = timed("linearize experts", lambda: linearize_experts(model))
    print(f"  {handle.count} expert Linears")
    gptq = GPTQModifier(scheme="W4A16", ignore=["lm_head"])
    timed("resolve targets (targets: [Linear])", lambda: gptq.validate(model))
    print(f"  {len(gptq.modules)} modules to quantize")
    sample = {"input_ids": torch.zeros(1, 16, dtype=torch.long), "use_cache": False}
    timed("one-pass attempt (declines for routed experts)",
          lambda: one_pass_subgraphs(model, sample, [gptq], PipelineArgs()))  # fmt: skip
    for label, targets in [("decoder layers", None), ("experts modules", ["LinearExperts"])]:
        subgraphs = timed(
            f"trace + partition, targets: {label}", lambda t=targets: trace_subgraphs(model, sample, t)
        )
        print(f"  {len(subgraphs)} subgraphs")


if __name__ == "__main__":
    main()
