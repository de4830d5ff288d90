"""Make the shared calibration set: N windows of L tokens from WikiText-2 valid, saved with safetensors."""

from __future__ import annotations

import argparse
import random

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--text", required=True)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    text = "\n\n".join(open(args.text, encoding="utf-8").read().splitlines())
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    windows = [ids[i : i + args.seq] for i in range(0, len(ids) - args.seq + 1, args.seq)]
    random.Random(0).shuffle(windows)
    tokens = torch.stack(windows[: args.samples])  # [N, L]
    save_file({"input_ids": tokens}, args.out)
    print(f"{tokens.shape[0]} windows x {tokens.shape[1]} tokens -> {args.out}")


if __name__ == "__main__":
    main()
