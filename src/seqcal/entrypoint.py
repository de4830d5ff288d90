"""``oneshot``: load -> trace -> partition -> calibrate -> save, as one readable pipeline."""

from __future__ import annotations

import contextlib
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
from seqcal.offload import SubgraphWeights, WeightStore, load_offloaded, safety_hooks
from seqcal.recipe import parse_recipe
from seqcal.save import PROGRESS_NAME
from seqcal.stream import StreamingCheckpoint, fingerprint
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
    resume: bool = False

    def __post_init__(self) -> None:
        if self.resume and self.output_dir is None:
            raise ValueError("resume=True needs the output_dir of the interrupted run")
        if self.resume and self.overwrite:
            raise ValueError(
                "resume=True continues the run in output_dir; it cannot be combined with overwrite"
            )


def load_model(
    args: ModelArgs, offload_weights: bool = False
) -> tuple[torch.nn.Module, Any, WeightStore | None]:
    """The model (eval mode), its tokenizer and, with ``offload_weights``, the store of its weights.

    With ``offload_weights`` (the default of the sequential pipeline for a directory) no weight is read
    here: parameters stay on meta and each subgraph reads its own from the safetensors files.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seqcal.models import resolve_model

    store = None
    if isinstance(args.model, torch.nn.Module):
        model, source = args.model, getattr(args.model, "name_or_path", None)
    else:
        source = str(resolve_model(args.model))
        dtype = DTYPES[args.dtype]
        if offload_weights:
            model, store = load_offloaded(source, None if dtype == "auto" else dtype, args.trust_remote_code)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype, trust_remote_code=args.trust_remote_code
            )
    tokenizer = args.tokenizer
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if tokenizer is None and source and any((Path(source) / f).is_file() for f in files):
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    return model.eval(), tokenizer, store


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
    resume: bool = False,
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
        overwrite: replace a non-empty output_dir.
        resume: continue an interrupted run in output_dir (same arguments); finished subgraphs are
            replayed from their saved weights, and the checkpoint equals an uninterrupted run's.

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
    out_args = OutputArgs(output_dir, overwrite, resume)
    parsed = parse_recipe(recipe)
    _check_output(out_args)
    loaded, tok, store = load_model(model_args, offload_weights=pipe_args.pipeline == "sequential")
    for modifier in parsed.modifiers:
        modifier.validate(loaded)
    data_args = None
    if pipe_args.pipeline != "datafree":
        data_args = DataArgs(
            dataset if dataset is not None else "default", num_calibration_samples, max_seq_length, batch_size,
            shuffle_calibration_samples, text_column, splits, seed,
        )  # fmt: skip
    recipe_yaml = parsed.to_yaml()
    output = _Output(out_args, recipe_yaml, fingerprint(recipe_yaml, repr(data_args), repr(pipe_args),
                                                         getattr(loaded, "name_or_path", ""), str(dtype)))  # fmt: skip
    state = run_pipeline(loaded, tok, parsed.modifiers, data_args, pipe_args, output, store)
    if out_args.output_dir is not None:
        from seqcal.eval import write_error_report
        from seqcal.save import save_checkpoint

        if output.stream is not None:
            output.stream.finish(tok, recipe_yaml)
        else:
            save_checkpoint(loaded, state, out_args.output_dir, tokenizer=tok, recipe_yaml=recipe_yaml,
                            overwrite=out_args.overwrite)  # fmt: skip
        write_error_report(state.report, out_args.output_dir)
    return loaded


@dataclass
class _Output:
    """Where the checkpoint goes, and the streaming writer once the subgraphs are known."""

    args: OutputArgs
    recipe_yaml: str
    run_id: str
    stream: StreamingCheckpoint | None = None


def _check_output(args: OutputArgs) -> None:
    if args.output_dir is None:
        return
    path = Path(args.output_dir)
    if (path / PROGRESS_NAME).is_file() and not (args.resume or args.overwrite):
        raise FileExistsError(
            f"output_dir {path} holds an interrupted run; continue it with resume=True (CLI: --resume) "
            "and the same arguments, or pass overwrite=True to start again"
        )
    if path.exists() and any(path.iterdir()) and not (args.overwrite or args.resume):
        raise FileExistsError(
            f"output_dir {path} exists and is not empty; choose another directory or pass overwrite=True"
        )


def run_pipeline(
    model: torch.nn.Module,
    tokenizer: Any,
    modifiers: list[Any],
    data_args: DataArgs | None,
    args: PipelineArgs,
    output: _Output | None = None,
    store: WeightStore | None = None,
) -> RunState:
    """Run the modifiers over the model (the calibration stage of ``oneshot``); returns the run's state."""
    start = time.perf_counter()
    device = _execution_device(model, store)
    state = RunState(device=device)
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
            weights = SubgraphWeights(model, store, subgraphs, device) if store is not None else None
            stream = _streaming(model, state, subgraphs, output, weights)
            schemes = {n: sc for m in modifiers for n, sc in getattr(m, "modules", {}).items()}

            def done(sg: Any) -> None:
                if stream is not None:
                    stream.done(sg)
                if weights is not None:
                    weights.release(
                        sg, [n for n in state.quantized if any(n.startswith(m) for m in sg.modules)]
                    )

            with safety_hooks(model, store, device) if store is not None else contextlib.nullcontext():
                rows = calibrate_subgraphs(
                    model, subgraphs, batches, modifiers, cache, subgraphs.placeholders, state,
                    on_subgraph_done=done, resume_from=stream.finished + 1 if stream else 0,
                    restore=(lambda sg: stream.restore(sg, schemes)) if stream else None,
                    on_subgraph_start=weights.onload if weights is not None else None,
                )  # fmt: skip
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


def _execution_device(model: torch.nn.Module, store: WeightStore | None) -> torch.device:
    """Where subgraphs run: the model's device, or for offloaded weights cuda when present, else cpu."""
    if store is None:
        return _model_device(model)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _streaming(
    model: torch.nn.Module, state: RunState, subgraphs: SubgraphList, output: _Output | None, weights: Any
) -> StreamingCheckpoint | None:
    if output is None or output.args.output_dir is None:
        return None
    output.stream = StreamingCheckpoint(
        model, state, output.args.output_dir, subgraphs, output.run_id,
        overwrite=output.args.overwrite, resume=output.args.resume, weights=weights,
    )  # fmt: skip
    if output.stream.finished >= 0:
        logger.warning("seqcal: resuming after subgraph %d of %d", output.stream.finished, len(subgraphs))
    return output.stream


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
