"""seqcal eval ppl: perplexity of a model or checkpoint on a raw text (WikiText-2 test when it is there)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from seqcal.cli.trace import load_model_and_tokenizer
from seqcal.errors import UsageError

# WikiText-2 is not shipped (CC BY-SA); without it the perplexity is measured on the embedded text.
EMBEDDED_EVAL_TEXT = (
    "the embedded calibration text (no ../shared/data/wiki.test.raw found; not WikiText-2, and the same text "
    "'--dataset default' calibrates on, so the quantization loss looks smaller than on held-out text)"
)


EVAL_DEFAULT = (
    "../shared/data/wiki.test.raw, relative to the working directory, when it exists; else the calibration "
    "text embedded in seqcal, which is also the default calibration data: fine to compare models, "
    "but it understates the quantization loss and is not comparable with published WikiText-2 numbers"
)


def eval_text(path: str | None) -> tuple[str, str]:
    """The evaluation text and its name: a file, else WikiText-2 test next to the repo, else the embedded text."""

    from seqcal.evaluation.perplexity import load_eval_text

    candidates = [path] if path else [str(Path.cwd().parent / "shared" / "data" / "wiki.test.raw")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return load_eval_text(candidate), candidate
    if path:
        raise UsageError(f"evaluation file {path} does not exist; pass an existing raw text file")
    from seqcal.data.batches import default_calibration_text

    return default_calibration_text(), EMBEDDED_EVAL_TEXT


def ppl_of(model: torch.nn.Module, tokenizer: Any, text: str, args: argparse.Namespace) -> float:
    from seqcal.evaluation.perplexity import perplexity

    result = perplexity(model, tokenizer, text, seq_len=args.eval_seq_length, max_windows=args.eval_windows,
                        progress=not args.quiet)  # fmt: skip
    return result.ppl


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype)
    text, text_name = eval_text(args.dataset)
    print(f"perplexity on {text_name}: {ppl_of(model, tokenizer, text, args):.3f}")
    return 0


def add_eval(sub: Any) -> None:
    """Register ``seqcal eval ppl`` on the subcommand parsers ``sub``."""
    evaluate = sub.add_parser("eval", help="measure a model: eval ppl, perplexity on raw text")
    ev = evaluate.add_subparsers(dest="metric", required=True)
    ppl = ev.add_parser("ppl", help="WikiText-2-style perplexity (non-overlapping windows)")
    ppl.add_argument("--model", required=True)
    ppl.add_argument(
        "--dataset",
        default=None,
        help=f"raw text file, e.g. WikiText-2's wiki.test.raw (default: {EVAL_DEFAULT})",
    )
    ppl.add_argument("--eval-seq-length", "--seq-len", dest="eval_seq_length", type=int, default=2048)
    ppl.add_argument("--eval-windows", type=int, default=None)
    ppl.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ppl.set_defaults(func=cmd_eval_ppl)
