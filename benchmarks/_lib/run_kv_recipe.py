"""One oneshot run of a YAML recipe on the shared calibration tokens, by seqcal or llm-compressor 0.14 (the
latter run with .peer-venv's python); run by kv_cache_smollm2.py in a subprocess under GNU time."""

from __future__ import annotations

import argparse
import time

import torch
import yaml
from safetensors.torch import load_file


def recipe_text(path: str, kv: bool) -> str:
    """The recipe, or without its kv_cache_scheme (the same weights and activations, KV cache unquantized)."""
    text = open(path, encoding="utf-8").read()
    if kv:
        return text
    recipe = yaml.safe_load(text)
    for stage in recipe.values():
        for group in stage.values():
            for args in group.values():
                args.pop("kv_cache_scheme", None)
    return yaml.safe_dump(recipe)


def llmc_unshuffled_order(tokens: torch.Tensor) -> list[int]:
    """The order llm-compressor 0.14 feeds unshuffled samples in (its LengthAwareSampler: an argsort of the
    lengths, descending; for windows of equal length, whatever order that argsort returns)."""
    lengths = torch.tensor([len(row) for row in tokens])
    return torch.argsort(lengths, descending=True).tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tool", choices=["seqcal", "llmc"], required=True)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--no-kv", action="store_true", help="drop the recipe's kv_cache_scheme")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--same-order", action="store_true",
                        help="both tools calibrate in llm-compressor's unshuffled order (its moving-average "
                             "observers weigh the first samples most)")  # fmt: skip
    args = parser.parse_args()
    tokens = load_file(args.tokens)["input_ids"]
    if args.same_order and args.tool == "seqcal":
        tokens = tokens[llmc_unshuffled_order(tokens)]
    recipe = recipe_text(args.recipe, not args.no_kv)
    start = time.perf_counter()
    if args.tool == "seqcal":
        from seqcal.entrypoint import oneshot

        oneshot(model=args.model, dataset=[{"input_ids": r.tolist()} for r in tokens], recipe=recipe,
                output_dir=args.out, num_calibration_samples=len(tokens), max_seq_length=tokens.shape[1],
                dtype="float32", shuffle_calibration_samples=False, overwrite=True)  # fmt: skip
    else:
        from datasets import Dataset
        from llmcompressor import oneshot
        from transformers import AutoModelForCausalLM, AutoTokenizer

        ds = Dataset.from_dict(
            {"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()}
        )
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        oneshot(model=model, dataset=ds, recipe=recipe, processor=tokenizer, num_calibration_samples=len(tokens),
                max_seq_length=tokens.shape[1], shuffle_calibration_samples=not args.same_order)  # fmt: skip
        model.save_pretrained(args.out, save_compressed=True)
        tokenizer.save_pretrained(args.out)
    print(f"seconds {time.perf_counter() - start:.1f}")


if __name__ == "__main__":
    main()
