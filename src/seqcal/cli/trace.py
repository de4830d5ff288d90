"""seqcal trace: the subgraphs of a model, checked against its forward, and the graph exported."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import torch

from seqcal.cli.options import NO_VERIFY, TRACE_INTO
from seqcal.errors import ModelLoadError, UsageError
from seqcal.report import FORMATS

logger = logging.getLogger("seqcal")

_SAMPLE_TEXTS = (
    "The history of the city begins with a small settlement on the river, where traders met to exchange "
    "grain, salt and timber. Over the centuries the town grew into a regional centre.",
    "Photosynthesis converts light energy into chemical energy.",
)


def load_model_and_tokenizer(model_arg: str, dtype: str) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoConfig, AutoTokenizer

    from seqcal.evaluation.loading import load_causal_lm
    from seqcal.models import resolve_model
    from seqcal.multimodal.classes import from_pretrained, model_task

    path = resolve_model(model_arg)
    try:
        config = AutoConfig.from_pretrained(path)
        task = model_task(config)
        if task == "speech-to-text":
            raise UsageError(
                f"{model_arg} is a speech model ({type(config).__name__}): its forward needs audio, so its graph "
                "is traced on audio rows; pass --dataset rows.jsonl (rows with an 'audio' file and a 'text')"
            )
        if task == "causal-lm":
            model = load_causal_lm(path, getattr(torch, dtype))
        else:  # a vision-language model, traced on text alone (its language model's graph)
            model = from_pretrained(path, getattr(torch, dtype)).eval()  # its class, its forward's fixes
            logger.warning("seqcal: %s traced on text alone: the vision tower does not run; pass --dataset "
                           "rows.jsonl (rows with images) to trace it with images", type(model).__name__)  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(path)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure inside transformers is about this checkpoint
        raise ModelLoadError.wrap(path, exc) from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _texts(dataset: str | None) -> list[str]:
    if dataset is None:
        return list(_SAMPLE_TEXTS)
    if not Path(dataset).is_file():
        raise UsageError(
            f"--dataset {dataset}: no such file; pass a text file (paragraphs split by blank lines)"
        )
    with open(dataset, encoding="utf-8") as f:
        paragraphs = [p.strip() for p in f.read().split("\n\n") if len(p.strip()) > 200]
    if len(paragraphs) < 2:
        raise UsageError(f"--dataset {dataset} has fewer than 2 paragraphs of text; pass a larger text file")
    return paragraphs[:2]


def format_table(rows: list[dict[str, Any]]) -> str:
    """Subgraph table: index, target, parameters, inputs -> outputs."""
    lines = [f"{'#':>3}  {'target':<34} {'params':>12}  {'nodes':>5}  inputs -> outputs"]
    for row in rows:
        target = ", ".join(row["targets"]) or "-"
        ins = ", ".join(row["inputs"]) or "-"
        outs = ", ".join(row["outputs"]) or "-"
        lines.append(
            f"{row['index']:>3}  {target:<34} {row['params']:>12,}  {row['nodes']:>5}  {ins} -> {outs}"
        )
    return "\n".join(lines)


def _max_diff(got: Any, want: Any) -> float:
    a = got.logits if hasattr(got, "logits") else got[0]
    b = want.logits if hasattr(want, "logits") else want[0]
    return (a.float() - b.float()).abs().max().item()


def format_of(path: str) -> str:
    """The graph format a file name asks for: its suffix ("graph.SVG" -> "svg")."""
    return Path(path).suffix.lstrip(".").lower()


def export_path(path: str) -> str:
    if format_of(path) not in FORMATS:
        raise argparse.ArgumentTypeError(
            f"{path}: the suffix picks the format: .json, .dot, .svg, .html or .onnx"
        )
    return path


def levels(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of module levels >= 1")
    return int(text)


def cmd_trace(args: argparse.Namespace) -> int:
    from seqcal import trace_subgraphs
    from seqcal.report import export_graph, trace_report

    if args.trace_depth is not None and not args.trace_into:
        raise UsageError("--trace-depth limits --trace-into; add --trace-into all (or module classes)")
    from seqcal.multimodal.run import trace_inputs

    model, sample, check = trace_inputs(args.dataset, args.model, args.dtype, args.max_seq_length)
    if model is None:  # text: the model's tokenizer on the sample texts
        model, tokenizer = load_model_and_tokenizer(args.model, args.dtype)
        texts = _texts(args.dataset)
        tokenizer.padding_side = "left"
        sample = tokenizer(texts[:1], return_tensors="pt", truncation=True, max_length=args.max_seq_length)
        # Another batch than the trace sample: two rows of different length, left-padded.
        check = tokenizer(
            texts, return_tensors="pt", padding=True, truncation=True, max_length=args.max_seq_length
        )
    start = time.perf_counter()
    subgraphs = trace_subgraphs(
        model, dict(sample), sequential_targets=args.targets, ignore=args.ignore, leaf_modules=args.leaf,
        trace_into=args.trace_into, trace_depth=args.trace_depth, verify=not args.no_verify,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    print(f"traced in {elapsed:.2f} s")
    print(trace_report(subgraphs))
    for problem in subgraphs.traced.not_traced_into:  # asked for by --trace-into, kept one node
        print(f"not traced into (kept one node):\n{problem}")
    exports = [(format_of(p), p) for p in args.export or []]
    if args.output:
        exports.append((args.format or format_of(args.output), args.output))
    for fmt, path in exports:
        export_graph(subgraphs, fmt, path, sample=dict(sample))
        print(f"wrote {path}")
    if not args.check:
        return 0
    with torch.no_grad():
        want = model(**check)
    got = subgraphs.run(**check, progress=not args.quiet)
    diff = _max_diff(got, want)
    scale = max(1.0, (want.logits if hasattr(want, "logits") else want[0]).abs().max().item())
    ok = diff <= 1e-5 * scale
    print(f"\ncheck on a padded batch of {tuple(check['input_ids'].shape)} (not the trace sample): "
          f"max |partitioned - eager| = {diff:.3g} ({'OK' if ok else 'MISMATCH'}, tolerance {1e-5 * scale:.3g})")  # fmt: skip
    return 0 if ok else 1


def add_trace(sub: Any) -> None:
    """Register ``seqcal trace`` on the subcommand parsers ``sub``."""
    trace = sub.add_parser("trace", help="trace a model and print its subgraphs")
    trace.add_argument("--model", required=True, help="directory, Hub id 'org/name' or 'default'")
    trace.add_argument("--targets", nargs="+", default=None, help="sequential target classes or re: patterns")
    trace.add_argument("--ignore", nargs="+", default=None, help="functions/methods to keep opaque")
    trace.add_argument(
        "--leaf", nargs="+", default=None, help="module classes or re: patterns kept as one node"
    )
    trace.add_argument(
        "--trace-into", nargs="+", default=None, metavar="CLASS|re:PATTERN|all", help=TRACE_INTO
    )
    trace.add_argument("--trace-depth", type=levels, default=None, metavar="N",
                       help="with --trace-into: open modules at most N levels below the traced layers")  # fmt: skip
    trace.add_argument("--check", action="store_true", help="run partitioned vs eager on a padded batch")
    trace.add_argument("--no-verify", action="store_true", help=NO_VERIFY)
    trace.add_argument(
        "--export", nargs="+", default=None, type=export_path, metavar="PATH",
        help="write the graph: .json (every node, with shapes), .dot, .svg, .html (one offline page) or .onnx (Netron)",
    )  # fmt: skip
    trace.add_argument(
        "--output", default=None, metavar="FILE", help="write the graph to FILE (see --format)"
    )
    trace.add_argument("--format", default=None, choices=sorted(FORMATS),
                       help="format of --output (default: from its suffix)")  # fmt: skip
    trace.add_argument("--dataset", default=None, help="text file to take the sample and check batch from, or "
                       "a JSON lines file of image or audio rows (as for oneshot)")  # fmt: skip
    trace.add_argument("--max-seq-length", type=int, default=128)
    trace.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    trace.set_defaults(func=cmd_trace)
