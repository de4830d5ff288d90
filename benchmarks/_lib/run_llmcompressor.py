"""One llm-compressor 0.14 oneshot run on the shared calibration tokens (runs in .peer-venv)."""

from __future__ import annotations

import argparse
import time

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from safetensors.torch import load_file
from scheme import SCHEME  # benchmarks/_lib is on sys.path: the runners are run as scripts
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--algo", choices=["gptq", "rtn", "awq"], default="gptq")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--recipe", default=None, help="a recipe file (instead of --algo with the shared scheme)"
    )
    parser.add_argument("--samples", type=int, default=None, help="use only the first N samples")
    parser.add_argument("--n-grid", type=int, default=20, help="AWQ's grid points")
    args = parser.parse_args()
    tokens = load_file(args.tokens)["input_ids"][: args.samples]
    ds = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    cls = GPTQModifier if args.algo == "gptq" else QuantizationModifier
    recipe = args.recipe or [cls(config_groups=SCHEME, ignore=["lm_head"])]
    if (
        args.algo == "awq" and not args.recipe
    ):  # llm-compressor 0.14: AWQ scales, then the QuantizationModifier quantizes
        from llmcompressor.modifiers.transform import AWQModifier
        from llmcompressor.pipelines.cache import IntermediatesCache

        if not torch.cuda.is_available():  # 0.14's AWQ pins its cached inputs, which needs an accelerator
            IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
        recipe.insert(0, AWQModifier(n_grid=args.n_grid))
    start = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe,
            num_calibration_samples=len(tokens), max_seq_length=tokens.shape[1])  # fmt: skip
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    print(f"seconds {time.perf_counter() - start:.1f}")


if __name__ == "__main__":
    main()
