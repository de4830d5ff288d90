"""Bytes of the values alive while each one-pass subgraph runs, with every value kept and with each dropped after its
last read (``GraphRunner.run(..., release=())``, what the executor does). On a GPU these are device memory.

Random weights of the carried SmolLM2 config, resized to a shape of ``gpu_bench.SHAPES`` (default "1b": Llama 3.2
1B's layer), one layer, on the CPU. The peak of a subgraph is the largest set of distinct tensor storages held by
the run's values, the node's operands and its result, at any node.

    PYTHONPATH=src:benchmarks/_lib .venv/bin/python benchmarks/gpu/live_values.py [--shape 1b] [--tokens 2048] [--batch 1]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from gpu_bench import SHAPES
from transformers import AutoConfig, AutoModelForCausalLM

from seqcal.execution.pipeline import PipelineArgs, one_pass_subgraphs
from seqcal.recipe import parse_recipe
from seqcal.tracing.runner import GraphRunner

CONFIG = Path.home() / ".cache/seqcal/smollm2-135m-instruct"


def storage_bytes(values: Any) -> int:
    """Bytes of the distinct storages of the tensors in ``values`` (nested containers walked)."""
    seen: dict[int, int] = {}
    stack = [values]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        elif isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return sum(seen.values())


class PeakRunner(GraphRunner):
    """Notes the most bytes alive at any node of a run (``env`` is the run's dict)."""

    env: dict[str, Any]
    peak = 0

    def _call(self, node: Any, args: tuple, kwargs: dict) -> Any:
        out = super()._call(node, args, kwargs)
        self.peak = max(self.peak, storage_bytes([self.env, out, args, kwargs]))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--config", default=str(CONFIG))
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.config)
    for key, value in SHAPES[args.shape].items():
        setattr(config, key, value)
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.tokens))
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    recipe = parse_recipe({"GPTQModifier": {"targets": "Linear", "scheme": "W4A16", "ignore": ["lm_head"]}})
    recipe.validate(model)
    subgraphs = one_pass_subgraphs(model, sample, recipe.modifiers, PipelineArgs())
    print(
        f"{args.shape}, one layer, bf16, {args.batch} x {args.tokens} tokens, CPU; MiB alive at the peak node"
    )
    print(f"{'#':>3}  {'targets':<32} {'keep every value':>17} {'drop at last read':>18}")
    peaks: dict[str, list[float]] = {}
    for mode, release in (("keep", None), ("drop", ())):
        runner = PeakRunner(model)
        env = {subgraphs.placeholders[k]: v for k, v in sample.items() if k in subgraphs.placeholders}
        with torch.no_grad():
            for sg in subgraphs:
                if not sg.outputs:  # the executor never runs it (the head after the last solve)
                    continue
                runner.env, runner.peak = {n: env[n] for n in sg.inputs}, 0
                runner.run(sg, runner.env, release=release)
                peaks.setdefault(mode, []).append(runner.peak / 2**20)
                env.update({n: runner.env[n] for n in sg.outputs})
    rows = [sg for sg in subgraphs if sg.outputs]
    for sg, keep, drop in zip(rows, peaks["keep"], peaks["drop"]):
        target = ", ".join(t.rsplit(".", 1)[-1] for t in sg.targets) or "-"
        print(f"{sg.index:>3}  {target:<32} {keep:>17.1f} {drop:>18.1f}")


if __name__ == "__main__":
    main()
