"""Quantize from Python with a Modifier object instead of a YAML file.

``GPTQModifier`` takes llm-compressor's arguments (scheme, targets, ignore, block_size, dampening_frac,
actorder, ...); ``oneshot`` takes llm-compressor's keyword names, so scripts port by changing the import.
The recipe that ran is saved next to the weights as ``recipe.yaml``.

Run:
    python examples/quantize_from_python.py                  # SmolLM2-135M-Instruct, GPTQ W4A16 (group 128)
    python examples/quantize_from_python.py --model DIR --scheme W8A16 --output-dir out/w8a16
"""

from __future__ import annotations

import argparse
from pathlib import Path

from seqcal import oneshot
from seqcal.modifiers import GPTQModifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="default", help="model directory, or 'default' (SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--scheme", default="W4A16", help="compressed-tensors preset: W4A16, W8A16, W8A8, ..."
    )
    parser.add_argument(
        "--dataset", default="default", help="calibration data file, or 'default' (embedded text)"
    )
    parser.add_argument("--num-calibration-samples", type=int, default=64)
    parser.add_argument("--max-seq-length", type=int, default=256)
    parser.add_argument("--output-dir", default="out/examples/python")
    args = parser.parse_args()

    modifier = GPTQModifier(
        scheme=args.scheme,
        targets="Linear",  # every nn.Linear ...
        ignore=["lm_head"],  # ... except the output head, which stays in full precision
        dampening_frac=0.01,  # added to the Hessian's diagonal (fraction of its mean)
        actorder="static",  # solve columns in order of decreasing Hessian diagonal
    )
    oneshot(
        model=args.model,
        dataset=args.dataset,
        recipe=modifier,  # or a list of modifiers, or a YAML string
        num_calibration_samples=args.num_calibration_samples,
        max_seq_length=args.max_seq_length,
        output_dir=args.output_dir,
        overwrite=True,
    )
    out = Path(args.output_dir)
    print(f"\ncheckpoint in {out}; the recipe that ran ({out / 'recipe.yaml'}):")
    print((out / "recipe.yaml").read_text())


if __name__ == "__main__":
    main()
