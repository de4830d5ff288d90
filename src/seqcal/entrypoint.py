"""``oneshot``: load -> trace -> partition -> calibrate -> save, as one readable pipeline."""

from __future__ import annotations

import difflib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from seqcal.cache import ActivationCache
from seqcal.data import DataArgs, load_calibration_batches
from seqcal.executor import calibrate_subgraphs
from seqcal.modifiers import RunState
from seqcal.recipe import parse_recipe
from seqcal.subgraphs import SubgraphList, trace_subgraphs
from seqcal.tracing import TracingError

logger = logging.getLogger("seqcal")

PIPELINES = ("sequential", "datafree", "basic")
DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelArgs:
    """Which model, in which dtype. ``model`` is a directory, 'default', or a loaded PreTrainedModel."""

    model: Any
    tokenizer: Any = None
    dtype: str = "auto"
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {sorted(DTYPES)}")
        if not isinstance(self.model, (str, Path, torch.nn.Module)):
            raise TypeError(
                f"model must be a directory, 'default' or a PreTrainedModel, got {type(self.model)}"
            )


@dataclass
class PipelineArgs:
    """How calibration runs."""

    pipeline: str = "sequential"
    sequential_targets: list[str] | None = None
    tracing_ignore: list[str] = field(default_factory=list)
    targets_per_subgraph: int = 1
    offload: str = "cpu"  # activation cache tier: "cpu" or "disk"
    offload_dir: str | None = None

    def __post_init__(self) -> None:
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline={self.pipeline!r} is not one of {PIPELINES}")
        if self.offload not in ("cpu", "disk"):
            raise ValueError(f"offload={self.offload!r} is not one of ('cpu', 'disk')")


@dataclass
class OutputArgs:
    """Where the checkpoint goes."""

    output_dir: str | None = None
    overwrite: bool = False


def load_model(args: ModelArgs) -> tuple[torch.nn.Module, Any]:
    """The model (eval mode) and its tokenizer, from a directory, 'default' or an object."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seqcal.models import resolve_model

    if isinstance(args.model, torch.nn.Module):
        model, source = args.model, getattr(args.model, "name_or_path", None)
    else:
        source = str(resolve_model(args.model))
        dtype = DTYPES[args.dtype]
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, trust_remote_code=args.trust_remote_code
        )
    tokenizer = args.tokenizer
    if tokenizer is None and source:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    return model.eval(), tokenizer


def _model_device(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def oneshot(
    model: Any,
    dataset: Any = None,
    recipe: Any = None,
    output_dir: str | None = None,
    num_calibration_samples: int = 512,
    max_seq_length: int = 2048,
    batch_size: int = 1,
    shuffle_calibration_samples: bool = True,
    text_column: str = "text",
    splits: Any = None,
    seed: int = 42,
    sequential_targets: list[str] | None = None,
    tracing_ignore: list[str] | None = None,
    pipeline: str = "sequential",
    tokenizer: Any = None,
    dtype: str = "auto",
    offload: str = "cpu",
    offload_dir: str | None = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    **unknown: Any,
) -> torch.nn.Module:
    """Quantize ``model`` with ``recipe`` on ``dataset`` and save a compressed-tensors checkpoint.

    Keyword names follow llm-compressor's ``oneshot``, so scripts port by changing the import.

    Args:
        model: a model directory, 'default' (SmolLM2-135M-Instruct, offline) or a PreTrainedModel.
        dataset: calibration data (text/jsonl/json/csv/parquet file, list of strings, Dataset, ...).
        recipe: a YAML file or string, a Modifier, or a list of them.
        output_dir: where to write the checkpoint (None: keep in memory only).
        num_calibration_samples / max_seq_length / batch_size / shuffle_calibration_samples / text_column /
            splits / seed: how calibration batches are drawn (see seqcal.data.DataArgs).
        sequential_targets: layer classes calibrated one at a time (default: inferred).
        tracing_ignore: functions/methods always run opaquely while tracing.
        pipeline: "sequential" (default), "datafree" (no data, round-to-nearest only) or "basic".
        dtype: compute dtype when loading from a directory ("auto" keeps the checkpoint's).
        offload: activation cache tier ("cpu" or "disk").

    Returns:
        The quantized model (fake-quantized weights, no hooks left).

    Example:
        >>> oneshot(model="default", dataset="default", recipe="recipes/gptq_w4a16_g64.yaml",
        ...         output_dir="out", num_calibration_samples=64, max_seq_length=512)  # doctest: +SKIP
    """
    if unknown:
        valid = [p for p in oneshot.__code__.co_varnames[: oneshot.__code__.co_argcount]]
        hints = {k: difflib.get_close_matches(k, valid, n=1) for k in unknown}
        raise TypeError(
            "oneshot() got unknown argument(s): "
            + ", ".join(f"{k}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
            + f"; valid arguments: {', '.join(valid)}"
        )
    model_args = ModelArgs(model, tokenizer, dtype, trust_remote_code)
    pipe_args = PipelineArgs(
        pipeline, sequential_targets, list(tracing_ignore or []), 1, offload, offload_dir
    )
    out_args = OutputArgs(output_dir, overwrite)
    parsed = parse_recipe(recipe)
    _check_output(out_args)
    loaded, tok = load_model(model_args)
    for modifier in parsed.modifiers:
        modifier.validate(loaded)
    data_args = None
    if pipe_args.pipeline != "datafree":
        data_args = DataArgs(
            dataset if dataset is not None else "default", num_calibration_samples, max_seq_length, batch_size,
            shuffle_calibration_samples, text_column, splits, seed,
        )  # fmt: skip
    state = run_pipeline(loaded, tok, parsed.modifiers, data_args, pipe_args)
    if out_args.output_dir is not None:
        from seqcal.eval import write_error_report
        from seqcal.save import save_checkpoint

        save_checkpoint(loaded, state, out_args.output_dir, tokenizer=tok, recipe_yaml=parsed.to_yaml(),
                        overwrite=out_args.overwrite)  # fmt: skip
        write_error_report(state.report, out_args.output_dir)
    return loaded


def _check_output(args: OutputArgs) -> None:
    if args.output_dir is None:
        return
    path = Path(args.output_dir)
    if path.exists() and any(path.iterdir()) and not args.overwrite:
        raise FileExistsError(
            f"output_dir {path} exists and is not empty; choose another directory or pass overwrite=True"
        )


def run_pipeline(
    model: torch.nn.Module,
    tokenizer: Any,
    modifiers: list[Any],
    data_args: DataArgs | None,
    args: PipelineArgs,
) -> RunState:
    """Run the modifiers over the model (the calibration stage of ``oneshot``); returns the run's state."""
    start = time.perf_counter()
    state = RunState(device=_model_device(model))
    for modifier in modifiers:
        modifier.initialize(model, state)
    if args.pipeline == "datafree" or data_args is None:
        if any(m.needs_calibration for m in modifiers):
            raise ValueError(
                "pipeline='datafree' cannot run modifiers that need calibration data (GPTQModifier)"
            )
        batches = []
    else:
        batches = load_calibration_batches(data_args, tokenizer)
    targets = args.sequential_targets or next(
        (m.sequential_targets for m in modifiers if getattr(m, "sequential_targets", None)), None
    )
    if not batches:
        rows = _whole_model(model, modifiers, state, [])
    elif args.pipeline == "basic":
        rows = _whole_model(model, modifiers, state, batches)
    else:
        batches = [{**batch, "use_cache": False} for batch in batches]
        try:
            subgraphs = trace_subgraphs(
                model, batches[0], targets, args.tracing_ignore, None, args.targets_per_subgraph
            )
        except TracingError as err:
            subgraphs, batches = _layerwise_fallback(model, batches, targets, err)
        device = _model_device(model)
        with ActivationCache(offload=args.offload, offload_dir=args.offload_dir, device=device) as cache:
            rows = calibrate_subgraphs(
                model, subgraphs, batches, modifiers, cache, subgraphs.placeholders, state
            )
    for modifier in modifiers:
        modifier.finalize(model, state)
    state.report = {
        "subgraphs": rows,
        "modules": state.module_errors,
        "log": state.log,
        "seconds": time.perf_counter() - start,
    }
    for line in state.log:
        logger.warning(line)
    return state


def _layerwise_fallback(
    model: torch.nn.Module, batches: list[dict[str, Any]], targets: list[str] | None, err: TracingError
) -> tuple[SubgraphList, list[dict[str, Any]]]:
    """Tracing failed: calibrate layer by layer with hooks if the targets form a simple chain, else re-raise."""
    from seqcal.fallback import capture_first_inputs, chain_batches, chain_graph, check_chain
    from seqcal.partition import partition
    from seqcal.tracing.diagnostics import Problem
    from seqcal.tracing.targets import infer_candidates, match_targets

    found = match_targets(model, targets) if targets else infer_candidates(model)
    order = [name for name, _ in model.named_modules() if name in set(found.values())]
    reason = check_chain(model, order, batches[0]) if order else "no targets"
    if reason is not None:
        fix = "follow the tracing fixes above; the layer-by-layer fallback does not apply"
        raise TracingError([*err.problems, Problem("layer-by-layer fallback", reason, fix)]) from err
    logger.warning(
        "seqcal: tracing failed (%s); the %d targets form a simple chain, so calibrating layer by layer "
        "with hooks instead. Check the per-layer errors in the report.",
        err.problems[0].what,
        len(order),
    )
    traced = chain_graph(order, capture_first_inputs(model, order[0], batches[0]))
    names = {id(m): n for n, m in model.named_modules()}
    subgraphs = SubgraphList(model, traced, partition(traced.graph, traced.targets, 1, names))
    return subgraphs, chain_batches(model, order[0], batches)


def _whole_model(
    model: torch.nn.Module, modifiers: list[Any], state: RunState, batches: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """pipeline 'basic' (one pass of the whole model, no tracing) and 'datafree' (no pass at all)."""
    import contextlib

    from seqcal.partition import Subgraph

    every = Subgraph(index=0, nodes=[], modules=[n for n, _ in model.named_modules() if n])
    start = time.perf_counter()
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for modifier in modifiers:
            stack.enter_context(modifier.calibrate(every, model, state))
        for batch in batches:
            state.token_mask = batch["attention_mask"].bool() if "attention_mask" in batch else None
            model(**batch, use_cache=False)
        state.token_mask = None
    for modifier in modifiers:
        modifier.compress(every, model, state)
    return [
        {"index": 0, "targets": ["<whole model>"], "rel_error": None, "seconds": time.perf_counter() - start}
    ]
