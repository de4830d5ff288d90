"""The ``seqcal`` command line: ``seqcal trace | oneshot | plan | eval``.

Every subcommand takes ``-v`` (debug lines; a traceback on errors) and ``-q`` (errors only). A user error
prints ``seqcal: error: <what, where, fix>`` and exits with 2; a bug says so in one line and exits with 3.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from seqcal.backend.host import limit_onednn_cache, map_large_allocations
from seqcal.backend.threads import choose_threads
from seqcal.cli.evaluate import EVAL_DEFAULT, cmd_eval_ppl, eval_text, ppl_of
from seqcal.cli.model_free import add_model_free
from seqcal.cli.trace import cmd_trace, export_path, format_of, levels, load_model_and_tokenizer
from seqcal.console import EXIT_INTERRUPTED, SeqcalParser, console_logging, report_error
from seqcal.data.autobatch import parse_batch_size
from seqcal.distributed import DEFAULT_SHARDS, writer_rank
from seqcal.errors import UsageError
from seqcal.evaluation.errors import ERRORS_PNG
from seqcal.report import FORMATS


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _plot_errors(report: dict[str, Any], output_dir: Path, plot: str | None) -> None:
    """The per-layer error PNG: next to the checkpoint by default (when matplotlib is installed)."""
    default = plot in (None, "auto")
    if plot == "none" or (default and not _has_matplotlib()):
        return
    from seqcal.report import plot_errors

    try:
        print(f"error plot: {plot_errors(report, output_dir / ERRORS_PNG if default else Path(plot))}")
    except ImportError as err:  # --plot PATH without matplotlib: the checkpoint is saved, say what is missing
        print(f"seqcal oneshot: no error plot: {err}", file=sys.stderr)


def _plot_timeline(trace: Path) -> None:
    """The profile's timeline PNG next to the trace (``run.trace.json`` -> ``run.timeline.png``)."""
    if not _has_matplotlib() or not trace.is_file():
        return
    from seqcal.report import plot_timeline

    stem = trace.name.removesuffix(".json").removesuffix(".trace")
    print(f"timeline: {plot_timeline(trace, trace.with_name(stem + '.timeline.png'))}")


def cmd_oneshot(args: argparse.Namespace) -> int:
    from seqcal.checkpoint.preflight import check_output_dir
    from seqcal.entrypoint import ModelArgs, load_model, oneshot
    from seqcal.recipe.parse import parse_recipe

    if args.plot not in (None, "auto", "none") and not args.output_dir:
        raise UsageError("oneshot: --plot draws the saved quantization_report.json; add --output-dir")
    if not args.output_dir and not args.eval:
        raise UsageError(
            "oneshot: without --output-dir or --eval the quantized model would be lost (neither saved nor "
            "measured); add --output-dir DIR to save the checkpoint, or --eval to only measure it"
        )

    from_checkpoint = False  # activation quantization lives in the checkpoint (run by compressed-tensors)
    if args.eval:  # refused before --eval measures the model for minutes (oneshot checks them itself)
        from_checkpoint = _eval_from_checkpoint(parse_recipe(args.recipe), args)
        check_output_dir(args.output_dir, overwrite=args.overwrite, resume=args.resume)
    # Without --eval the directory is passed on, so oneshot keeps the weights offloaded (memory bound);
    # --eval needs the model in memory to measure it before and after.
    model, tokenizer = args.model, None
    if args.eval:
        model, tokenizer, _ = load_model(ModelArgs(args.model, dtype=args.dtype))
    text, text_name = eval_text(args.eval_dataset) if args.eval else ("", "")
    before = ppl_of(model, tokenizer, text, args) if args.eval else None
    start = time.perf_counter()
    oneshot(
        model=model, tokenizer=tokenizer, recipe=args.recipe, dataset=args.dataset, output_dir=args.output_dir,
        dtype=args.dtype,
        num_calibration_samples=args.num_calibration_samples, max_seq_length=args.max_seq_length,
        batch_size=args.batch_size, sequential_targets=args.sequential_targets, tracing_ignore=args.tracing_ignore,
        pipeline=args.pipeline, offload=args.offload, overwrite=args.overwrite, seed=args.seed, concatenate=args.concatenate,
        resume=args.resume, max_device_memory=args.max_device_memory, max_host_memory=args.max_host_memory,
        compute_dtype=args.compute_dtype,
        profile=args.profile, cache_max_memory=args.cache_max_memory, cache_dtype=args.cache_dtype,
        one_pass=not args.layer_cut, trace_into=args.trace_into, verify=not args.no_verify, text_column=args.text_column, splits=args.splits,
        dataset_config_name=args.dataset_config_name, shuffle_calibration_samples=args.shuffle,
        moe_calibrate_all_experts=args.moe_calibrate_all_experts, num_shards=args.num_shards,
        requantize=args.requantize, output_format=args.output_format,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    if args.output_dir and writer_rank():  # under torchrun the others neither wrote nor print the report
        import json
        from pathlib import Path

        from seqcal.evaluation.perplexity import format_error_table

        report_path = Path(args.output_dir) / "quantization_report.json"
        if report_path.is_file():
            report = json.loads(report_path.read_text())
            print(format_error_table(report))
            _plot_errors(report, Path(args.output_dir), args.plot)
            if args.profile:
                from seqcal.report import Profiler

                print(f"\nprofile ({args.profile}):\n" + Profiler.load(args.profile).summary(report))
    if args.profile:
        _plot_timeline(Path(args.profile))
    print(f"\noneshot took {elapsed:.1f} s" + (f"; checkpoint: {args.output_dir}" if args.output_dir else ""))
    if args.eval:
        # the checkpoint in the dtype the model was measured in before
        dtype = str(getattr(model, "dtype", torch.float32)).removeprefix("torch.")
        measured = load_model_and_tokenizer(args.output_dir, dtype)[0] if from_checkpoint else model
        after = ppl_of(measured, tokenizer, text, args)
        print(f"perplexity on {text_name} ({args.eval_windows or 'all'} windows of {args.eval_seq_length} tokens): "
              f"before {before:.2f} -> after {after:.2f}")  # fmt: skip
    return 0


def _eval_from_checkpoint(recipe: Any, args: argparse.Namespace) -> bool:
    """--eval of a recipe that quantizes activations measures the saved checkpoint (the returned model runs
    its inputs unquantized); without --output-dir there is none: refused before any work."""
    from seqcal.modifiers.activations import quantizes_activations

    if not quantizes_activations(recipe.modifiers):
        return False
    if not args.output_dir:
        raise UsageError(
            "oneshot: --eval of a recipe that quantizes activations measures the saved checkpoint (it runs "
            "the activation quantization); add --output-dir DIR"
        )
    return True


_NO_VERIFY = (
    "skip checking the partition against the model's own forward on a second, differently shaped batch "
    "(on by default: a partition that differs is refused)"
)
_BATCH_SIZE = (
    "samples per batch, or 'auto': samples grouped by length, as many per batch as memory allows "
    "(default: auto on a GPU, 1 on the CPU)"
)
_OFFLOAD = (
    "activation cache tier: cpu (RAM), disk (files), device (the execution device's memory: fastest on a GPU "
    "with room for every cached value) or an accelerator's name such as cuda:1"
)
_TRACE_INTO = "trace into these modules too ('all': full graph; torch.nn modules such as Linear stay nodes)"


def _add_oneshot(sub: Any) -> None:
    one = sub.add_parser("oneshot", help="quantize a model with a recipe and calibration data")
    one.add_argument("--model", required=True, help="directory, Hub id 'org/name' or 'default'")
    one.add_argument("--recipe", required=True, help="recipe YAML file (llm-compressor format accepted)")
    one.add_argument("--dataset", default="default", help="calibration data: file, HF name, or 'default' (JSON "
                     "lines rows may hold images or audio: chat messages or image/audio columns)")  # fmt: skip
    one.add_argument("--text-column", default="text", help="column with the text in JSON/CSV/Parquet/HF data")
    one.add_argument("--splits", default=None, help="HF split, e.g. train or 'train[:512]' (default: "
                     "calibration, then train, then the only split)")  # fmt: skip
    one.add_argument(
        "--dataset-config-name", default=None, help="HF dataset configuration, e.g. wikitext-2-raw-v1"
    )
    one.add_argument("--no-shuffle", dest="shuffle", action="store_false",
                     help="take the first --num-calibration-samples rows instead of a seeded shuffle")  # fmt: skip
    one.add_argument("--output-dir", default=None,
                     help="where to write the checkpoint (required unless --eval only measures the result)")  # fmt: skip
    one.add_argument("--num-calibration-samples", type=int, default=512)
    one.add_argument("--max-seq-length", type=int, default=2048)
    one.add_argument("--batch-size", type=parse_batch_size, default=None, help=_BATCH_SIZE)
    one.add_argument("--seed", type=int, default=42)
    one.add_argument("--concatenate", action="store_true",
                     help="join the texts and cut full windows of --max-seq-length tokens")  # fmt: skip
    one.add_argument("--sequential-targets", nargs="+", default=None)
    one.add_argument("--tracing-ignore", nargs="+", default=None)
    one.add_argument(
        "--trace-into", nargs="+", default=None, metavar="CLASS|re:PATTERN|all", help=_TRACE_INTO
    )
    one.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)
    one.add_argument("--pipeline", default="sequential", choices=["sequential", "basic", "datafree"])
    one.add_argument("--offload", default="cpu", help=_OFFLOAD)
    one.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    one.add_argument(
        "--compute-dtype",
        default=None,
        choices=["bfloat16", "float16"],
        help="autocast the forward passes (weights and Hessians stay in their dtype)",
    )
    one.add_argument("--layer-cut", action="store_true",
                     help="cut after each layer (a calibration and a propagation pass per layer) instead of "
                          "before each group of quantized modules (one pass)")  # fmt: skip
    one.add_argument("--moe-calibrate-all-experts", action=argparse.BooleanOptionalAction, default=True,
                     help="MoE models: every expert sees every token during calibration (routing still gives "
                          "the layer output); --no-moe-calibrate-all-experts: only the tokens routed to it")  # fmt: skip
    one.add_argument("--num-shards", type=int, default=DEFAULT_SHARDS,
                     help="virtual shards of the calibration batches (statistics are folded per shard, so the "
                          "checkpoint is the same for any number of processes under torchrun)")  # fmt: skip
    one.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    one.add_argument("--output-format", default="compressed-tensors", choices=["compressed-tensors", "gguf"],
                     help="gguf: --output-dir/model.gguf for llama.cpp, from GGUF schemes (Q4_K_M, Q4_0, ...)")  # fmt: skip
    one.add_argument("--requantize", action="store_true",
                     help="quantize an FP8/NVFP4/int4 checkpoint to as many bits as it has or more (the "
                          "roundings' errors compound)")  # fmt: skip
    one.add_argument("--profile", default=None, metavar="TRACE.json",
                     help="write a Chrome trace of time and memory per stage (open in ui.perfetto.dev)")  # fmt: skip
    one.add_argument("--plot", default="auto", metavar="ERRORS.png",
                     help=f"where to draw per-layer error and GPTQ loss per module (default: {ERRORS_PNG} in "
                          "--output-dir when matplotlib is installed; 'none': no plot)")  # fmt: skip
    one.add_argument("--resume", action="store_true", help="continue an interrupted run in --output-dir")
    one.add_argument("--max-device-memory", default=None, help="e.g. 8GB: finer targets, solve chunks")
    one.add_argument("--max-host-memory", default=None, help=_MAX_HOST)
    one.add_argument("--threads", type=int, default=None, metavar="N",
                     help="threads torch computes with (default: the cores the load average leaves free)")  # fmt: skip
    one.add_argument("--cache-max-memory", default=None,
                     help="e.g. 4GB: RAM budget of the activation cache; the rest spills to disk")  # fmt: skip
    one.add_argument("--cache-dtype", default=None, choices=["bfloat16", "float16"],
                     help="store fp32 activations in this dtype (half the cache, lossy)")  # fmt: skip
    one.add_argument("--eval", action="store_true", help="print perplexity before and after")
    one.add_argument(
        "--eval-dataset", default=None, help=f"raw text file for --eval (default: {EVAL_DEFAULT})"
    )
    one.add_argument("--eval-seq-length", type=int, default=2048)
    one.add_argument("--eval-windows", type=int, default=None, help="evaluate only the first N windows")
    one.set_defaults(func=cmd_oneshot)
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


_MAX_HOST = ("e.g. 12GB: resident memory to stay under; the plan picks the cache's RAM (the rest spilled to disk) "
             "and the cut, or refuses before any weight is read")  # fmt: skip


def cmd_plan(args: argparse.Namespace) -> int:
    from seqcal.entrypoint import oneshot
    from seqcal.multimodal.run import media_lengths

    samples, seq = args.num_calibration_samples, args.max_seq_length
    lengths = media_lengths(args.dataset, args.model, samples, seq)
    if lengths is not None:  # image or audio rows: planned at their longest row, its media's tokens included
        samples, seq = len(lengths), max(lengths)
        print(f"{args.dataset}: {samples} image or audio rows, {min(lengths)}-{seq} tokens each with their "
              f"media's tokens; planned at {samples} x {seq}\n")  # fmt: skip
    plan = oneshot(
        model=args.model, recipe=args.recipe, num_calibration_samples=samples,
        max_seq_length=seq, batch_size=args.batch_size, offload=args.offload,
        sequential_targets=args.sequential_targets, dry_run=True, max_device_memory=args.max_device_memory,
        max_host_memory=args.max_host_memory, dataset=[],
    )  # fmt: skip
    print(plan.table())
    if args.world_size > 1:
        from seqcal.distributed.plan import plan_world

        batches = -(-samples // plan.batch_size)  # the plan's (also when chosen)
        print("\n" + plan_world(plan, args.world_size, args.num_shards, batches, plan.dtype_bytes))
    return 0


def _add_plan(sub: Any) -> None:
    plan = sub.add_parser("plan", help="predict device/host/disk memory per subgraph (reads no weights)")
    plan.add_argument("--model", required=True)
    plan.add_argument("--recipe", required=True)
    plan.add_argument("--dataset", default=None,
                      help="a JSON lines file of image or audio rows: the plan takes their lengths (text: ignored)")  # fmt: skip
    plan.add_argument("--num-calibration-samples", type=int, default=512)
    plan.add_argument("--max-seq-length", type=int, default=2048)
    plan.add_argument("--batch-size", type=parse_batch_size, default=None, help=_BATCH_SIZE)
    plan.add_argument("--offload", default="cpu", help=_OFFLOAD)
    plan.add_argument("--sequential-targets", nargs="+", default=None)
    plan.add_argument("--max-device-memory", default=None, help="e.g. 8GB: finer targets, solve chunks")
    plan.add_argument("--max-host-memory", default=None, help=_MAX_HOST)
    plan.add_argument("--world-size", type=int, default=1,
                      help="processes (torchrun): per-rank memory and bytes reduced/broadcast per subgraph")  # fmt: skip
    plan.add_argument("--num-shards", type=int, default=DEFAULT_SHARDS, help="virtual shards of the batches")
    plan.set_defaults(func=cmd_plan)


_DESCRIPTION = """Quantize a Hugging Face model after training, one subgraph at a time (llm-compressor's recipes).

Every command takes -v (debug lines; a traceback on errors) and -q (errors only). A user error prints
`seqcal: error: <what, where, fix>` and exits with 2; a bug says so in one line and exits with 3."""
_EPILOG = """`seqcal COMMAND --help` lists a command's options. For example:
  seqcal oneshot --model default --recipe recipes/gptq_w4a16.yaml --output-dir out
  seqcal eval ppl --model out"""


def build_parser() -> argparse.ArgumentParser:
    parser = SeqcalParser(
        prog="seqcal",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(verbose=0, quiet=False)
    # not required: `seqcal` alone prints this help (main), not argparse's "arguments are required: command"
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    trace = sub.add_parser("trace", help="trace a model and print its subgraphs")
    trace.add_argument("--model", required=True, help="directory, Hub id 'org/name' or 'default'")
    trace.add_argument("--targets", nargs="+", default=None, help="sequential target classes or re: patterns")
    trace.add_argument("--ignore", nargs="+", default=None, help="functions/methods to keep opaque")
    trace.add_argument(
        "--leaf", nargs="+", default=None, help="module classes or re: patterns kept as one node"
    )
    trace.add_argument(
        "--trace-into", nargs="+", default=None, metavar="CLASS|re:PATTERN|all", help=_TRACE_INTO
    )
    trace.add_argument("--trace-depth", type=levels, default=None, metavar="N",
                       help="with --trace-into: open modules at most N levels below the traced layers")  # fmt: skip
    trace.add_argument("--check", action="store_true", help="run partitioned vs eager on a padded batch")
    trace.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)
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
    _add_oneshot(sub)
    _add_plan(sub)
    add_model_free(sub)
    return parser


def _user_modifier_logger(name: str) -> bool:
    """``recipe.imports.user_modifier_logger``, imported when the first record is logged, not at start-up (the
    command's help and usage errors import no torch)."""
    from seqcal.recipe.imports import user_modifier_logger

    return user_modifier_logger(name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``seqcal`` command."""
    limit_onednn_cache()  # first: oneDNN reads the setting when it creates its first primitive
    map_large_allocations()  # before the run allocates: the threshold applies to blocks allocated after it
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `seqcal` alone: what it can do, on stderr, with argparse's usage-error status
        parser.print_help(sys.stderr)
        return 2
    if args.command == "trace" and (args.format or args.output):
        if not args.output:
            parser.error("trace: --format needs --output FILE")
        if not args.format and format_of(args.output) not in FORMATS:
            parser.error(
                f"trace: give --format {{{','.join(sorted(FORMATS))}}} or an --output with that suffix"
            )
    try:
        with console_logging(args.verbose, args.quiet, shown=_user_modifier_logger):
            choose_threads(getattr(args, "threads", None))  # process-wide: the cores others leave free
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("seqcal: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every failure ends as one line (a traceback with -v)
        return report_error(exc, args.verbose)
