"""seqcal oneshot: quantize a model with a recipe and calibration data; the report, its plots and, with
``--eval``, the perplexity before and after."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from seqcal.cli.evaluate import EVAL_DEFAULT, eval_text, ppl_of
from seqcal.cli.options import BATCH_SIZE, MAX_HOST, NO_VERIFY, OFFLOAD, TRACE_INTO
from seqcal.cli.trace import load_model_and_tokenizer
from seqcal.data.autobatch import parse_batch_size
from seqcal.distributed import DEFAULT_SHARDS, writer_rank
from seqcal.errors import UsageError
from seqcal.evaluation.errors import ERRORS_PNG


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
        requantize=args.requantize, keep_source_format=args.keep_source_format,
        output_format=args.output_format,
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


def add_oneshot(sub: Any) -> None:
    """Register ``seqcal oneshot`` on the subcommand parsers ``sub``."""
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
    one.add_argument("--batch-size", type=parse_batch_size, default=None, help=BATCH_SIZE)
    one.add_argument("--seed", type=int, default=42)
    one.add_argument("--concatenate", action="store_true",
                     help="join the texts and cut full windows of --max-seq-length tokens")  # fmt: skip
    one.add_argument("--sequential-targets", nargs="+", default=None)
    one.add_argument("--tracing-ignore", nargs="+", default=None)
    one.add_argument("--trace-into", nargs="+", default=None, metavar="CLASS|re:PATTERN|all", help=TRACE_INTO)
    one.add_argument("--no-verify", action="store_true", help=NO_VERIFY)
    one.add_argument("--pipeline", default="sequential", choices=["sequential", "basic", "datafree"])
    one.add_argument("--offload", default="cpu", help=OFFLOAD)
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
    one.add_argument("--keep-source-format", action="store_true",
                     help="an FP8 checkpoint's Linears the recipe leaves alone stay FP8 in the output (its weights "
                          "and scales as stored) instead of dequantized")  # fmt: skip
    one.add_argument("--profile", default=None, metavar="TRACE.json",
                     help="write a Chrome trace of time and memory per stage (open in ui.perfetto.dev)")  # fmt: skip
    one.add_argument("--plot", default="auto", metavar="ERRORS.png",
                     help=f"where to draw per-layer error and GPTQ loss per module (default: {ERRORS_PNG} in "
                          "--output-dir when matplotlib is installed; 'none': no plot)")  # fmt: skip
    one.add_argument("--resume", action="store_true", help="continue an interrupted run in --output-dir")
    one.add_argument("--max-device-memory", default=None, help="e.g. 8GB: finer targets, solve chunks")
    one.add_argument("--max-host-memory", default=None, help=MAX_HOST)
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
