"""The calibration stage of ``oneshot``: trace, partition, run the modifiers subgraph by subgraph.

How it runs is ``PipelineArgs`` (``seqcal.execution.pipeline_args``, imported here for its callers).
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from seqcal.backend import linears_on_onednn
from seqcal.backend.cuda_graphs import clear_graphs
from seqcal.checkpoint.preflight import DiskSpaceError
from seqcal.checkpoint.streaming import CHECKPOINT_BYTES, ResumeError, StreamingCheckpoint
from seqcal.data.autobatch import batch_summary, describe_batches
from seqcal.data.batches import DataArgs, load_calibration_batches
from seqcal.distributed.run import resume_point, start_sharded_run, traffic_report
from seqcal.execution.cache.store import STORE_DTYPES, ActivationCache
from seqcal.execution.cuts import (
    layerwise_fallback,
    log_cut,
    one_pass_subgraphs,
    onloaded_modules,
    reading_weights,
    verify_run,
)
from seqcal.execution.embedding_rows import mark_by_rows
from seqcal.execution.executor import calibrate_subgraphs
from seqcal.execution.pipeline_args import PipelineArgs
from seqcal.execution.reference import reference_cache
from seqcal.execution.store import WeightStore, restore_in_memory, stage_in_memory
from seqcal.execution.subgraphs import SubgraphList, model_device, trace_subgraphs
from seqcal.execution.transforms import prepare_modifiers
from seqcal.execution.verify import Divergence, refuse
from seqcal.execution.weights import SubgraphWeights, buffers_on, reports_device, safety_hooks
from seqcal.modifiers import RunState, contract
from seqcal.modifiers.activations import quantized_inputs
from seqcal.modifiers.contract import ModifierSet
from seqcal.modifiers.kv_cache import quantized_kv
from seqcal.modifiers.state import Batch, BatchCursor, RunConfig
from seqcal.report.profile import NullProfiler, Profiler
from seqcal.tracing import TracingError
from seqcal.tracing.partition import Subgraph

logger = logging.getLogger("seqcal")


@dataclass
class OutputPlan:
    """Where the checkpoint goes, and the streaming writer once the subgraphs are known."""

    args: Any  # entrypoint.OutputArgs
    recipe_yaml: str
    run_id: dict[str, str]  # checkpoint.identity.run_identity; the stream adds the data's hash
    stream: StreamingCheckpoint | None = None


def run_pipeline(
    model: torch.nn.Module,
    tokenizer: Any,
    modifiers: list[Any],
    data_args: DataArgs | None,
    args: PipelineArgs,
    output: OutputPlan | None = None,
    store: WeightStore | None = None,
    profiler: Profiler | None = None,
    batches: list[dict[str, Any]] | None = None,
) -> RunState:
    """Run the modifiers over the model (the calibration stage of ``oneshot``); returns the run's state.

    ``batches``: the calibration batches already built from ``data_args`` (``oneshot`` builds them first so
    that it need not hold the tokenizer during calibration); None builds them here with ``tokenizer``.
    """
    staged = store is None and args.pipeline == "sequential" and _stage(model, args)
    if staged:
        store = stage_in_memory(model)
    try:
        data = batches if batches is not None else data_args
        with reports_device(model, _execution_device(model, store) if store is not None else None):
            return _run(model, tokenizer, modifiers, data, args, output, store, profiler, staged)
    except OSError as exc:
        if exc.errno != errno.ENOSPC or output is None or output.args.output_dir is None:
            raise
        raise DiskSpaceError(
            f"the disk of {output.args.output_dir} filled up while the checkpoint was written ({exc}); free space "
            "there and run the same command again with --resume (resume=True): the subgraphs recorded as "
            "finished are not computed again"
        ) from exc
    finally:
        if staged:
            restore_in_memory(model, store)
        held = clear_graphs()  # GPTQ's cached column-loop graphs: their device buffers go with the run
        if held:
            logger.debug("GPTQ column-loop CUDA graphs held %.1f MiB of device memory", held / 2**20)


def _stage(model: torch.nn.Module, args: PipelineArgs) -> bool:
    if args.stage_weights is not None:
        return args.stage_weights
    return torch.cuda.is_available() and all(p.device.type == "cpu" for p in model.parameters())


def _run(
    model: torch.nn.Module, tokenizer: Any, modifiers: list[Any], data_args: DataArgs | list | None,
    args: PipelineArgs, output: OutputPlan | None, store: WeightStore | None, profiler: Profiler | None,
    staged: bool,
) -> RunState:  # fmt: skip
    start = time.perf_counter()
    modifiers = ModifierSet.of(modifiers)  # their declarations, read once: every stage below asks this
    profiler = profiler if profiler is not None else NullProfiler()
    device = _execution_device(model, store)
    config = RunConfig(
        device=device, compute_dtype=getattr(torch, args.compute_dtype) if args.compute_dtype else None,
        device_budget=args.max_device_memory, kv_cache_scheme=modifiers.kv_cache_scheme(),
        in_place_factor=args.in_place_factor,
    )  # fmt: skip
    state = RunState(config)
    for modifier in modifiers:
        modifier.initialize(model, state)
    if args.pipeline == "datafree" or data_args is None:
        if needing := [type(m).__name__ for m, n in zip(modifiers, modifiers.needs) if n.calibration]:
            raise ValueError(
                f"pipeline='datafree' cannot run modifiers that need calibration data ({', '.join(needing)}: "
                "GPTQ, or static input activations); give a dataset, or use a weight-only or dynamic scheme"
            )
        batches = []
    else:
        batches = data_args if isinstance(data_args, list) else load_calibration_batches(data_args, tokenizer)
    batching = batch_summary(batches)
    if batches:
        logger.info("seqcal: calibration batches: %s", describe_batches(batching))
    targets = args.sequential_targets or modifiers.sequential_targets()
    if not batches:
        rows = _whole_model(model, modifiers, state, [])
    elif args.pipeline == "basic":
        with linears_on_onednn(device):
            rows = _whole_model(model, modifiers, state, batches)
    else:
        batches = [{**batch, **_no_cache(model)} for batch in batches]
        with reading_weights(model, store):
            subgraphs = one_pass_subgraphs(model, batches[0], modifiers, args) if targets is None else None

        def differs(candidate: SubgraphList) -> Divergence | None:
            if not args.verify or not modifiers.calibrating:
                return None  # no forward pass will run through the partition
            mark_by_rows(model, candidate, modifiers)  # the embeddings read by rows, as the run reads them
            # the trace's sample (its stand-in cache); eager and partitioned both on the calibration's kernels
            with profiler.span("verify", "partition vs eager"), linears_on_onednn(device):
                return verify_run(candidate, getattr(candidate, "kv_sample", batches[0]), store, device)

        if subgraphs is not None and (diverged := differs(subgraphs)):
            logger.warning("seqcal: cutting at layers: the cut before each module group %s", diverged.what())
            subgraphs = None
        log_cut(subgraphs, targets, modifiers, args)
        try:
            if subgraphs is None:
                with reading_weights(model, store):
                    subgraphs = trace_subgraphs(
                        model, batches[0], targets, args.tracing_ignore, None, args.targets_per_subgraph,
                        trace_into=args.trace_into, verify=False,
                    )  # fmt: skip
                if diverged := differs(subgraphs):
                    raise refuse(diverged, model)
        except TracingError as err:
            with reading_weights(model, store), linears_on_onednn(device):
                subgraphs, batches = layerwise_fallback(model, batches, targets, err)
        prepare_modifiers(model, subgraphs, batches[0], modifiers, state)  # v2: graph, producers they edit
        mark_by_rows(model, subgraphs, modifiers)  # embeddings no modifier edits: read by the batches' rows

        def new_cache() -> ActivationCache:
            return ActivationCache(
                offload=args.offload, offload_dir=args.offload_dir, device=device, max_memory=args.cache_max_memory,
                store_dtype=STORE_DTYPES[args.cache_dtype] if args.cache_dtype else None,
            )  # fmt: skip

        if modifiers.float_inputs:
            logger.info("seqcal: a modifier reads full-precision inputs: a second activation cache holds the "
                        "full-precision stream, and every subgraph runs once more on it")  # fmt: skip
        with new_cache() as cache, reference_cache(modifiers.float_inputs, new_cache) as reference:
            weights = (
                SubgraphWeights(model, store, subgraphs, device, staged, onloaded_modules)
                if store is not None
                else None
            )
            sharding = start_sharded_run(model, modifiers, subgraphs, batches, args.num_shards, repr(args)
                                         + repr(output.run_id if output else None))  # fmt: skip
            tap = getattr(subgraphs, "kv_tap", None)  # the one-pass cut's stand-in cache: keys and values
            state = state.with_config(
                sharding=sharding, kv_in_graph=tap is not None
            )  # the loop's shards, cut
            writes = sharding.group.writes  # one process writes the checkpoint
            stream = _streaming(
                model, state, subgraphs, output if writes else None, weights, batches, modifiers, profiler,
                args.background_save,
            )  # fmt: skip
            schemes = modifiers.quantized()

            def done(sg: Any) -> int | None:
                if stream is not None:
                    with profiler.span("save", f"subgraph {sg.index}", subgraph=sg.index) as args:
                        waited = stream.done(sg)  # its files are written while the next subgraph runs
                        if waited:
                            args["waited_s"] = round(waited, 6)  # for the previous subgraph's files
                if weights is None:
                    return None
                changed = [n for n in state.changed_modules() if sg.holds(n)]
                return weights.release(sg, changed)  # bytes copied back to the host

            with contextlib.ExitStack() as stack:
                stack.enter_context(quantized_inputs(model, state, schemes))  # downstream sees runtime inputs
                # and an fp8 KV cache once calibrated (observed through the stand-in cache in the one-pass cut)
                cursor = BatchCursor()  # the batch being run, for the modifiers' hooks and the stand-in cache
                stack.enter_context(quantized_kv(model, modifiers, tap, cursor))
                if store is not None:  # weights off the model: onloaded per subgraph; its buffers go once
                    stack.enter_context(safety_hooks(model, store, device))
                    stack.enter_context(buffers_on(model, device))
                if stream is not None:  # its last files written before the run goes on; after a failure too
                    stack.push(_drain_on_exit(stream))
                rows = calibrate_subgraphs(
                    model, subgraphs, state.config.sharding.local_batches(batches), modifiers, cache,
                    subgraphs.placeholders, state, on_subgraph_done=done,
                    resume_from=resume_point(state.config.sharding, stream),
                    restore=(lambda sg: stream.restore(sg, schemes)) if stream else None,
                    on_subgraph_start=weights.onload if weights is not None else None,
                    profiler=profiler, progress=logger.getEffectiveLevel() < logging.ERROR,  # off for `-q`
                    reference=reference, cursor=cursor,
                )  # fmt: skip
    for modifier in modifiers:
        modifier.finalize(model, state)
    state.results.report = {
        "subgraphs": rows,
        "modules": state.results.module_errors,
        "log": state.results.log,
        "seconds": time.perf_counter() - start,
        "batches": batching,
        "distributed": traffic_report(state.config.sharding),  # bytes and seconds of communication per rank
    }
    for line in state.results.log:
        logger.warning(line)
    return state


def _execution_device(model: torch.nn.Module, store: WeightStore | None) -> torch.device:
    """Where subgraphs run: the model's device, or for offloaded weights cuda when present, else cpu."""
    if store is None:
        return model_device(model)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _streaming(
    model: torch.nn.Module, state: RunState, subgraphs: SubgraphList, output: OutputPlan | None, weights: Any,
    batches: list[dict[str, Any]], modifiers: Sequence[Any] = (), profiler: Any = None,
    background: bool | None = None,
) -> StreamingCheckpoint | None:  # fmt: skip
    if output is None or output.args.output_dir is None:
        return None
    output.stream = output.args.stream_class()(  # StreamingCheckpoint, or seqcal.gguf's GGUFStream
        model, state, output.args.output_dir, subgraphs, output.run_id, overwrite=output.args.overwrite,
        resume=output.args.resume, weights=weights, batches=batches, profiler=profiler,
        background=background,
    )  # fmt: skip
    stuck = [m for m in modifiers if m.name in ModifierSet.of(modifiers).not_resumable()]
    if output.stream.finished >= 0 and stuck:
        raise ResumeError(
            f"output_dir {output.args.output_dir} holds an interrupted run of {stuck[0].name}, which cannot be "
            f"resumed ({stuck[0].not_resumable_because}); start it again with overwrite=True (--overwrite)"
        )
    if output.stream.finished >= 0:
        logger.warning("seqcal: resuming after subgraph %d of %d", output.stream.finished, len(subgraphs))
    elif output.args.resume:
        logger.warning(
            "seqcal: resume: nothing to replay in %s (%s); starting from the first subgraph. Progress is recorded "
            "each time %d MiB of finished modules have been written, and at the end", output.args.output_dir,
            "an interrupted run stopped before its first progress record" if output.stream.resumed_empty
            else "no interrupted run there", CHECKPOINT_BYTES // 2**20,
        )  # fmt: skip
    return output.stream


def _drain_on_exit(stream: StreamingCheckpoint) -> Any:
    """An exit callback waiting for the stream's background writes: their error is raised after a success; after
    a failure it is only logged (the run's own error is the one to report, and never suppressed) and the worker
    thread stops, as no ``finish`` follows."""

    def drain(kind: type[BaseException] | None, *exc: object) -> bool:
        if kind is None:
            stream.drain()
        else:
            stream.close()
        return False

    return drain


def _whole_model(
    model: torch.nn.Module, modifiers: ModifierSet, state: RunState, batches: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """pipeline 'basic' (one pass of the whole model, no tracing) and 'datafree' (no pass at all)."""
    cursor = BatchCursor()
    every = Subgraph(index=0, nodes=[], modules=[n for n, _ in model.named_modules() if n])
    start = time.perf_counter()
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for modifier in modifiers:
            stack.enter_context(contract.calibrating(modifier, every, model, state, cursor))
        for batch in cursor.over(
            batches, lambda b: Batch(b["attention_mask"].bool() if "attention_mask" in b else None)
        ):
            model(**batch, **_no_cache(model))
    contract.finish_local(modifiers)
    for modifier in modifiers:
        modifier.compress(every, model, state)
    return [
        {"index": 0, "targets": ["<whole model>"], "rel_error": None, "seconds": time.perf_counter() - start}
    ]


def _no_cache(model: torch.nn.Module) -> dict[str, bool]:
    """``use_cache=False`` when the forward takes it: calibration never needs a KV cache."""
    params = inspect.signature(type(model).forward).parameters
    takes = "use_cache" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {"use_cache": False} if takes else {}
