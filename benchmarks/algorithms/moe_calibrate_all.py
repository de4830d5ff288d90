"""All experts vs routed tokens only: GPTQ W8A16 of the tiny Qwen3-MoE of ``tests/test_moe.py``.

Prints the relative logits error of the quantized model against full precision on held-out tokens, with
``moe_calibrate_all_experts`` on and off, and how many expert projections fell back to round to nearest
(no token routed to them).

Usage: PYTHONPATH=src:tests .venv/bin/python benchmarks/algorithms/moe_calibrate_all.py
"""

from __future__ import annotations

import logging

import torch

from test_moe import _calibrate, data, tiny_qwen3_moe


def main() -> None:
    logging.disable(logging.WARNING)
    reference = tiny_qwen3_moe()
    held_out = torch.tensor([row["input_ids"] for row in data(4, 32)[2:]])
    for samples, length in [(2, 16), (8, 64)]:
        errors, fallbacks = {}, {}
        for mode in (True, False):
            model, state = _calibrate(mode, data(samples, length))
            with torch.no_grad():
                got, want = model(input_ids=held_out).logits, reference(input_ids=held_out).logits
            errors[mode] = ((got - want).norm() / want.norm()).item()
            fallbacks[mode] = sum("never called" in line for line in state.results.log)
        print(f"{samples} x {length} tokens: all experts {errors[True]:.5f} (RTN fallbacks {fallbacks[True]}), "
              f"routed only {errors[False]:.5f} (RTN fallbacks {fallbacks[False]})")  # fmt: skip


if __name__ == "__main__":
    main()
