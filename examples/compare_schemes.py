"""Quantize one model with two schemes and compare their perplexity.

By default: W4A16 (group size 128) with plain round-to-nearest against GPTQ, which uses calibration data
to correct each column's rounding error in the columns not yet quantized. ``--schemes`` picks others,
e.g. ``--schemes rtn:W8A16 rtn:W4A16``.

Perplexity uses seqcal.evaluation.perplexity (non-overlapping windows, the GPTQ WikiText-2 protocol). Pass
``--eval-dataset wiki.test.raw`` for numbers comparable with published ones; without it the text embedded in
seqcal is used, which is also the default calibration text: fine to rank schemes, but it understates the
loss from quantization.

Run:
    python examples/compare_schemes.py                       # SmolLM2-135M-Instruct
    python examples/compare_schemes.py --model DIR --eval-dataset wiki.test.raw --eval-windows 40
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from seqcal import oneshot
from seqcal.data.sources import default_calibration_text
from seqcal.evaluation.perplexity import load_eval_text, perplexity
from seqcal.models import resolve_model
from seqcal.modifiers import GPTQModifier, QuantizationModifier

ALGORITHMS = {"rtn": QuantizationModifier, "gptq": GPTQModifier}  # name -> modifier class


def parse_scheme(text: str) -> tuple[str, str]:
    """'gptq:W4A16' -> ('gptq', 'W4A16'); the algorithm is one of ALGORITHMS."""
    algo, _, preset = text.partition(":")
    if algo not in ALGORITHMS or not preset:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write ALGORITHM:PRESET with ALGORITHM in {sorted(ALGORITHMS)}"
        )
    return algo, preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="default", help="model directory, or 'default' (SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--schemes", nargs=2, type=parse_scheme, default=[("rtn", "W4A16"), ("gptq", "W4A16")],
                        metavar="ALGO:PRESET", help="two schemes (default: rtn:W4A16 gptq:W4A16)")  # fmt: skip
    parser.add_argument(
        "--dataset", default="default", help="calibration data file, or 'default' (embedded text)"
    )
    parser.add_argument("--num-calibration-samples", type=int, default=64)
    parser.add_argument("--max-seq-length", type=int, default=256)
    parser.add_argument(
        "--eval-dataset", default=None, help="raw text file (WikiText-2 test); default: embedded text"
    )
    parser.add_argument("--eval-seq-length", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the perplexities to this JSON file")
    args = parser.parse_args()

    path = resolve_model(args.model)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = load_eval_text(args.eval_dataset) if args.eval_dataset else default_calibration_text()

    def ppl(model: torch.nn.Module) -> float:
        result = perplexity(model, tokenizer, text, seq_len=args.eval_seq_length, max_windows=args.eval_windows,
                            progress=False)  # fmt: skip
        return result.ppl

    results = {"full precision": ppl(reference)}
    for algo, preset in args.schemes:
        # A model object (not a directory) comes back with its fake-quantized weights in place, ready to
        # evaluate; pass output_dir= as well to save it.
        model = copy.deepcopy(reference)
        oneshot(model=model, tokenizer=tokenizer, dataset=args.dataset,
                recipe=ALGORITHMS[algo](scheme=preset, ignore=["lm_head"]),
                num_calibration_samples=args.num_calibration_samples, max_seq_length=args.max_seq_length)  # fmt: skip
        results[f"{algo} {preset}"] = ppl(model)

    source = args.eval_dataset or "the embedded calibration text"
    print(f"\nperplexity on {source} ({args.eval_windows} windows of {args.eval_seq_length} tokens):")
    for name, value in results.items():
        print(f"  {name:<16} {value:10.3f}" + ("" if math.isfinite(value) else "  (not finite)"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
