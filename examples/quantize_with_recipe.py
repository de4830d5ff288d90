"""Quantize a model directory with a YAML recipe and save a compressed-tensors checkpoint.

The recipe is a file from recipes/ (llm-compressor's format: stages, ``*_modifiers`` groups or a flat
``GPTQModifier: {...}``). With a directory as the model, no weight is loaded up front: each subgraph reads
its own weights from the safetensors files, is calibrated, and is written to the checkpoint.

Run:
    python examples/quantize_with_recipe.py                  # SmolLM2-135M-Instruct, GPTQ W4A16 g64
    python examples/quantize_with_recipe.py --model DIR --recipe recipes/rtn_w8a8.yaml \\
        --dataset data.jsonl --num-calibration-samples 512 --max-seq-length 2048

The same from a shell: ``seqcal oneshot --model DIR --recipe R.yaml --dataset D --output-dir OUT``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from seqcal import oneshot

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="default", help="model directory, or 'default' (SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--recipe", default=str(RECIPES / "gptq_w4a16_g64.yaml"), help="recipe YAML file")
    parser.add_argument("--dataset", default="default",
                        help="calibration data: a .txt/.jsonl/.json/.csv/.parquet file, or 'default' (embedded text)")  # fmt: skip
    parser.add_argument("--num-calibration-samples", type=int, default=64)
    parser.add_argument("--max-seq-length", type=int, default=256)
    parser.add_argument("--output-dir", default="out/examples/recipe")
    args = parser.parse_args()

    oneshot(
        model=args.model,
        recipe=args.recipe,
        dataset=args.dataset,
        num_calibration_samples=args.num_calibration_samples,
        max_seq_length=args.max_seq_length,
        output_dir=args.output_dir,
        overwrite=True,  # replace the checkpoint of an earlier run of this example
    )

    out = Path(args.output_dir)
    print(f"\ncheckpoint in {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    for name, group in config["config_groups"].items():
        w = group["weights"]
        print(f"{name}: {w['num_bits']}-bit {w['type']} weights, {w['strategy']} scales "
              f"(group size {w.get('group_size')}), format {config.get('format')}, targets {group['targets']}")  # fmt: skip

    # transformers reads the checkpoint (with compressed-tensors installed); so does vLLM.
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    print(f"reloaded {type(model).__name__}; greedy continuation: {tokenizer.decode(new)!r}")


if __name__ == "__main__":
    main()
