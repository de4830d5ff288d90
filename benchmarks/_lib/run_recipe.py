"""One oneshot run of a recipe file on the shared calibration tokens, with seqcal or llm-compressor 0.14.

Run by sparse_smollm2.py in a subprocess: ``--tool seqcal`` in seqcal's venv, ``--tool llmc`` in the peer venv
(the same recipe file for both: llm-compressor's recipes run unchanged in seqcal).
"""

from __future__ import annotations

import argparse
import time

import torch
from safetensors.torch import load_file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tool", choices=["seqcal", "llmc"], required=True)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    tokens = load_file(args.tokens)["input_ids"]
    start = time.perf_counter()
    if args.tool == "seqcal":
        from seqcal.entrypoint import oneshot

        data = [{"input_ids": row.tolist()} for row in tokens]
        oneshot(model=args.model, dataset=data, recipe=args.recipe, output_dir=args.out, dtype=args.dtype,
                num_calibration_samples=len(data), max_seq_length=tokens.shape[1],
                shuffle_calibration_samples=False, overwrite=True)  # fmt: skip
    else:
        from datasets import Dataset
        from llmcompressor import oneshot
        from transformers import AutoModelForCausalLM, AutoTokenizer

        ds = Dataset.from_dict(
            {"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()}
        )
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
        oneshot(model=model, dataset=ds, recipe=args.recipe, num_calibration_samples=len(tokens),
                max_seq_length=tokens.shape[1])  # fmt: skip
        model.save_pretrained(args.out, save_compressed=True)
        AutoTokenizer.from_pretrained(args.model).save_pretrained(args.out)
    print(f"seconds {time.perf_counter() - start:.1f}")


if __name__ == "__main__":
    main()
