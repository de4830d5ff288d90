"""auto-round's own run on the shared calibration windows (run in auto-round's venv: benchmarks/peers/autoround_smollm2.py).

Quantizes with ``AutoRound(...).quantize()`` on the CPU (torch.compile off), the windows passed as token tensors
(each [1, seq], so auto-round sees exactly the windows seqcal sees), then saves the model with its weights
quantized and dequantized (fp32, a plain transformers checkpoint) for ``seqcal eval ppl``. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from safetensors.torch import load_file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True, help="safetensors with input_ids [N, seq]")
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--lr", type=float, default=5e-3, help="0: auto-round's default (1 / iters)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42, help="auto-round's seed (its default: 42)")
    args = parser.parse_args()
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    windows = load_file(args.tokens)["input_ids"][: args.samples]  # [N, seq]
    data = [w.unsqueeze(0) for w in windows]
    ar = AutoRound(model, tokenizer=tokenizer, scheme="W4A16", bits=args.bits, group_size=args.group_size,
                   sym=True, iters=args.iters, lr=args.lr or None, batch_size=args.batch_size, nsamples=len(data),
                   seqlen=windows.shape[1], dataset=data, device_map="cpu", enable_torch_compile=False,
                   seed=args.seed)  # fmt: skip
    model, _ = ar.quantize()
    tuned = time.perf_counter() - start
    w = model.model.layers[0].mlp.down_proj.weight.detach()
    levels = max(len(torch.unique(g)) for g in w.reshape(-1, args.group_size)[:256])
    assert levels <= 2**args.bits, f"weights are not quantized in place ({levels} levels in a group)"
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(json.dumps({"tool": "auto-round", "tune_s": round(tuned, 1), "levels_per_group": levels}))


if __name__ == "__main__":
    main()
