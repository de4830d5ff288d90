"""The calibration stage of ``oneshot``: trace, partition, run the modifiers subgraph by subgraph."""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from seqcal.backend import linears_on_onednn
from seqcal.backend.cuda_graphs import clear_graphs
from seqcal.checkpoint.streaming import ResumeError, StreamingCheckpoint
from seqcal.data.autobatch import batch_summary, describe_batches
from seqcal.data.batches import DataArgs, load_calibration_batches
from seqcal.distributed.run import resume_point, start_sharded_run, traffic_report
from seqcal.distributed.shards import DEFAULT_SHARDS
from seqcal.execution.cache.store import STORE_DTYPES, ActivationCache, tier_device
from seqcal.execution.executor import calibrate_subgraphs
from seqcal.execution.subgraphs import SubgraphList, model_device, trace_subgraphs
from seqcal.execution.transforms import prepare_modifiers
from seqcal.execution.verify import Divergence, refuse, verify_partition
from seqcal.execution.weights import (
    SubgraphWeights,
    WeightStore,
    buffers_on,
    restore_in_memory,
    safety_hooks,
    stage_in_memory,
    targets_onloaded,
)
from seqcal.experts import routed_experts
from seqcal.modifiers import RunState
from seqcal.modifiers.activations import quantized_inputs
from seqcal.modifiers.kv_cache import quantized_kv
from seqcal.modifiers.kv_hooks import kv_tap, kv_update_sites
from seqcal.report.profile import NullProfiler, Profiler
from seqcal.tracing import TracingError
from seqcal.tracing.diagnostics import Problem
from seqcal.tracing.fallback import capture_first_inputs, chain_batches, chain_graph, check_chain
from seqcal.tracing.leaves import normalize_trace_into
from seqcal.tracing.partition import OnePassError, Subgraph, partition
from seqcal.tracing.targets import infer_candidates, match_targets

logger = logging.getLogger("seqcal")

PIPELINES = ("sequential", "datafree", "basic")


@dataclass
class PipelineArgs:
    """How calibration runs."""

    pipeline: str = "sequential"
    sequential_targets: list[str] | None = None
    tracing_ignore: list[str] = field(default_factory=list)
    targets_per_subgraph: int = 1
    offload: str = "cpu"  # activation cache tier: "cpu", "disk", "device" or an accelerator's name ("cuda:1")
    offload_dir: str | None = None
    compute_dtype: str | None = (
        None  # "bfloat16"/"float16": autocast forward passes; weights keep their dtype
    )
    # Cut subgraphs before the quantized modules when every modifier needs only their inputs (GPTQ, RTN):
    # each module calibrates on inputs computed with all earlier modules quantized, and every subgraph runs
    # once. False (or explicit sequential_targets): cut after each layer, a calibration and a propagation
    # pass per layer, as llm-compressor does.
    one_pass: bool = True
    # RAM budget (bytes) of the cpu activation cache; what does not fit goes to disk. Lossless, so it is left
    # out of repr(), which fingerprints a run: a resume after running out of memory may add or change it.
    cache_max_memory: int | None = field(default=None, repr=False)
    cache_dtype: str | None = None  # "bfloat16"/"float16": store fp32 activations narrower (lossy)
    # A model given in RAM on the cpu: stage its weights through the execution device one subgraph at a time,
    # as for a model read from disk. None: when CUDA is available (the model's weights stay in RAM, each
    # subgraph runs on the GPU). Same results either way, so it is left out of the run's fingerprint.
    stage_weights: bool | None = field(default=None, repr=False)
    # Modules to trace into ("all" or class names / re: patterns; see seqcal.tracing.trace). The same cuts and
    # results either way, so it is left out of the run's fingerprint.
    trace_into: str | list[str] | None = field(default=None, repr=False)
    # Check the partition against the model's own forward on a second, differently shaped batch before
    # calibrating (seqcal.execution.verify). A check, not a setting of the result: left out of the fingerprint.
    verify: bool = field(default=True, repr=False)
    # Device memory (bytes) the run may use; GPTQ sizes its stacked solves from it. The results do not depend
    # on it (solves are split by rows), so it is left out of the fingerprint.
    max_device_memory: int | None = field(default=None, repr=False)
    # Virtual shards of the calibration batches (seqcal.distributed): statistics are accumulated per shard
    # and folded in shard order, the same with one process or many. Part of the result, so fingerprinted.
    num_shards: int = DEFAULT_SHARDS

    def __post_init__(self) -> None:
        normalize_trace_into(self.trace_into)  # a ValueError that lists what is valid
        for name in ("one_pass", "verify"):  # a string such as "false" would be truthy and silently mean True
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline={self.pipeline!r} is not one of {PIPELINES}")
        if self.compute_dtype not in (None, "bfloat16", "float16"):
            raise ValueError(
                f"compute_dtype={self.compute_dtype!r} is not one of (None, 'bfloat16', 'float16')"
            )
        if isinstance(self.offload, torch.device):  # llm-compressor's sequential_offload_device takes one
            self.offload = str(self.offload)
        tier_device(self.offload, "cpu")  # raises for a name that is no tier
        if self.cache_dtype not in (None, *STORE_DTYPES):
            raise ValueError(
                f"cache_dtype={self.cache_dtype!r} is not one of {(None, *STORE_DTYPES)}; it stores the "
                "cached activations in that dtype (lossy), None stores them exactly"
            )
        budget = self.cache_max_memory
        if budget is not None and (self.offload != "cpu" or not isinstance(budget, int) or budget < 0):
            raise ValueError(
                f"cache_max_memory={budget!r} needs offload='cpu' (got {self.offload!r}) and an int number "
                "of bytes >= 0 (oneshot also takes '4GB'); offload='disk' keeps no activation in RAM already"
            )


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
        return _run(model, tokenizer, modifiers, data, args, output, store, profiler, staged)
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
    profiler = profiler if profiler is not None else NullProfiler()
    device = _execution_device(model, store)
    state = RunState(
        device=device, compute_dtype=getattr(torch, args.compute_dtype) if args.compute_dtype else None,
        device_budget=args.max_device_memory,
    )  # fmt: skip
    for modifier in modifiers:
        modifier.initialize(model, state)
    if args.pipeline == "datafree" or data_args is None:
        if needing := [type(m).__name__ for m in modifiers if m.needs_calibration]:
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
    targets = args.sequential_targets or next(
        (m.sequential_targets for m in modifiers if getattr(m, "sequential_targets", None)), None
    )
    if not batches:
        rows = _whole_model(model, modifiers, state, [])
    elif args.pipeline == "basic":
        with linears_on_onednn(device):
            rows = _whole_model(model, modifiers, state, batches)
    else:
        batches = [{**batch, **_no_cache(model)} for batch in batches]
        subgraphs = one_pass_subgraphs(model, batches[0], modifiers, args) if targets is None else None

        def differs(candidate: SubgraphList) -> Divergence | None:
            if not args.verify or not any(m.needs_calibration for m in modifiers):
                return None  # no forward pass will run through the partition
            # the trace's sample (its stand-in cache); eager and partitioned both on the calibration's kernels
            with profiler.span("verify", "partition vs eager"), linears_on_onednn(device):
                return verify_run(candidate, getattr(candidate, "kv_sample", batches[0]), store, device)

        if subgraphs is not None and (diverged := differs(subgraphs)):
            logger.warning("seqcal: cutting at layers: the cut before each module group %s", diverged.what())
            subgraphs = None
        _log_cut(subgraphs, targets, modifiers, args)
        try:
            if subgraphs is None:
                subgraphs = trace_subgraphs(
                    model, batches[0], targets, args.tracing_ignore, None, args.targets_per_subgraph,
                    trace_into=args.trace_into, verify=False,
                )  # fmt: skip
                if diverged := differs(subgraphs):
                    raise refuse(diverged, model)
        except TracingError as err:
            # the capture runs the model's own forward: weights on meta are onloaded per module for it
            cpu = torch.device("cpu")
            onloading = safety_hooks(model, store, cpu) if store is not None else contextlib.nullcontext()
            with onloading, linears_on_onednn(device):
                subgraphs, batches = _layerwise_fallback(model, batches, targets, err)
        prepare_modifiers(model, subgraphs, batches[0], modifiers, state)  # v2: graph, producers they edit
        with ActivationCache(
            offload=args.offload, offload_dir=args.offload_dir, device=device, max_memory=args.cache_max_memory,
            store_dtype=STORE_DTYPES[args.cache_dtype] if args.cache_dtype else None,
        ) as cache:  # fmt: skip
            weights = SubgraphWeights(model, store, subgraphs, device, staged) if store is not None else None
            state.sharding = start_sharded_run(model, modifiers, subgraphs, batches, args.num_shards, repr(args)
                                               + repr(output.run_id if output else None))  # fmt: skip
            writes = state.sharding.group.writes  # one process writes the checkpoint
            stream = _streaming(
                model, state, subgraphs, output if writes else None, weights, batches, modifiers, profiler
            )
            schemes = {n: sc for m in modifiers for n, sc in getattr(m, "modules", {}).items()}

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
                state.kv_tap = getattr(subgraphs, "kv_tap", None)  # and an fp8 KV cache once calibrated:
                stack.enter_context(quantized_kv(model, modifiers, state.kv_tap, state))
                if store is not None:  # weights off the model: onloaded per subgraph; its buffers go once
                    stack.enter_context(safety_hooks(model, store, device))
                    stack.enter_context(buffers_on(model, device))
                if stream is not None:  # its last files written before the run goes on; after a failure too
                    stack.push(_drain_on_exit(stream))
                rows = calibrate_subgraphs(
                    model, subgraphs, state.sharding.local_batches(batches), modifiers, cache,
                    subgraphs.placeholders, state, on_subgraph_done=done,
                    resume_from=resume_point(state.sharding, stream),
                    restore=(lambda sg: stream.restore(sg, schemes)) if stream else None,
                    on_subgraph_start=weights.onload if weights is not None else None,
                    profiler=profiler, progress=logger.getEffectiveLevel() < logging.ERROR,  # off for `-q`
                )  # fmt: skip
    for modifier in modifiers:
        modifier.finalize(model, state)
    state.report = {
        "subgraphs": rows,
        "modules": state.module_errors,
        "log": state.log,
        "seconds": time.perf_counter() - start,
        "batches": batching,
        "distributed": traffic_report(state.sharding),  # bytes and seconds of communication per rank
    }
    for line in state.log:
        logger.warning(line)
    return state


def one_pass_subgraphs(
    model: torch.nn.Module, sample: dict[str, Any], modifiers: list[Any], args: PipelineArgs
) -> SubgraphList | None:
    """Subgraphs cut before the modifiers' modules, or None when that mode does not apply to this run."""
    if not args.one_pass or args.targets_per_subgraph != 1:
        return None
    if not all(getattr(m, "input_only", False) for m in modifiers):
        return None
    wanted = {n for m in modifiers for n in (*getattr(m, "modules", {}), *getattr(m, "pruned", {}))}
    if not wanted:
        return None
    # Only modules inside the layer stacks that the layer cut would trace around (the text decoder's
    # layers): the code between them is what the zoo checks; a vision tower traced module by module is not.
    routed = routed_experts(model, sorted(wanted))  # called in a loop over the tokens each expert is routed
    if routed:
        logger.info("seqcal: cutting at layers, not before each module (MoE experts such as %s run in a "
                    "data-dependent loop; their layer is calibrated whole)", routed[0])  # fmt: skip
        return None
    layers = tuple(f"{layer}." for layer in infer_candidates(model).values())
    outside = sorted(n for n in wanted if not n.startswith(layers))
    if not layers or outside:
        logger.info("seqcal: cutting at layers, not before each module (%s outside the layers)", outside[:3])
        return None
    names = [n for n, _ in model.named_modules() if n in wanted]
    pattern = "re:^(" + "|".join(re.escape(n) for n in names) + ")$"
    attention = sorted({n for m in modifiers if getattr(m, "kv", None) is not None for n in m.kv.modules})
    tap = None
    if attention:  # kv_cache_scheme: the keys and values reach the graph through a stand-in cache
        tap, argument = kv_tap(model, attention), _cache_argument(model)
        if tap is None or argument is None:
            logger.info("seqcal: cutting at layers, not before each module (the attention modules' cache updates "
                        "cannot be told apart by layer_idx, or the model takes no cache argument)")  # fmt: skip
            return None
        sample = {**sample, argument: tap}
    try:
        subgraphs = trace_subgraphs(
            model, sample, [pattern], args.tracing_ignore, None, 1, cut="before", trace_into=args.trace_into,
            verify=False,
        )  # fmt: skip
    except (TracingError, OnePassError) as err:
        # Not an error: the layer-level cut below handles this model (it hooks modules inside layers).
        reason = err.problems[0].what if isinstance(err, TracingError) else str(err)
        log = logger.warning if args.trace_into else logger.info  # asked for a full graph: say it differs
        log("seqcal: cutting at layers, not before each module (%s)", reason)
        return None
    if tap is not None:
        sites = kv_update_sites(subgraphs, attention)
        if sites is None:
            logger.info("seqcal: cutting at layers, not before each module (not every attention module's cache "
                        "update runs in a subgraph of its own group)")  # fmt: skip
            return None
        for sg in subgraphs:
            sg.kv_updates = sites.get(sg.index, [])
        subgraphs.kv_tap, subgraphs.kv_sample = tap, sample
    return subgraphs


def _cache_argument(model: torch.nn.Module) -> str | None:
    """The model forward's cache argument (``cache`` since transformers 5.24, ``past_key_values`` before)."""
    params = inspect.signature(type(model).forward).parameters
    return next((a for a in ("cache", "past_key_values") if a in params), None)


def _log_cut(
    one_pass: SubgraphList | None, targets: list[str] | None, modifiers: list[Any], args: PipelineArgs
) -> None:
    """One INFO line on how the graph is cut and why (``one_pass_subgraphs`` says itself why it declined)."""
    layer_cut = "a calibration and a propagation pass per layer"
    if one_pass is not None:
        logger.info(
            "seqcal: one pass: cut before each group of quantized modules, %d subgraphs", len(one_pass)
        )
    elif targets is not None:
        logger.info("seqcal: cutting after each of the sequential targets %s: %s", targets, layer_cut)
    elif not args.one_pass or args.targets_per_subgraph != 1:
        logger.info("seqcal: cutting after each layer (one_pass=False, CLI --layer-cut): %s", layer_cut)
    elif not all(getattr(m, "input_only", False) for m in modifiers):
        needs = [type(m).__name__ for m in modifiers if not getattr(m, "input_only", False)]
        logger.info(
            "seqcal: cutting after each layer (%s needs more than its modules' inputs): %s", needs, layer_cut
        )


def verify_run(
    subgraphs: SubgraphList, batch: dict[str, Any], store: WeightStore | None, device: torch.device
) -> Divergence | None:
    """Check ``subgraphs`` against the model's forward on a batch shaped unlike ``batch`` (see
    ``seqcal.execution.verify``); offloaded weights are read per module for the eager run and per subgraph for
    the partitioned one, so the check stays within the run's memory bound."""
    start = time.perf_counter()
    if store is None:
        diverged = verify_partition(subgraphs, batch, device)
    else:
        weights = SubgraphWeights(subgraphs.model, store, subgraphs, device)

        @contextlib.contextmanager
        def onloading() -> Any:
            with safety_hooks(subgraphs.model, store, device), buffers_on(subgraphs.model, device), \
                    targets_onloaded(subgraphs.model, store, subgraphs.targets, device):  # fmt: skip
                yield

        @contextlib.contextmanager
        def onloaded(sg: Any) -> Any:
            weights.onload(sg)
            try:
                yield
            finally:
                weights.release(sg)

        diverged = verify_partition(subgraphs, batch, device, onloading, onloaded)
    if diverged is None:
        logger.info(
            "seqcal: the partition matches the model's forward on a second batch (checked in %.2f s)",
            time.perf_counter() - start,
        )
    return diverged


def _execution_device(model: torch.nn.Module, store: WeightStore | None) -> torch.device:
    """Where subgraphs run: the model's device, or for offloaded weights cuda when present, else cpu."""
    if store is None:
        return model_device(model)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _streaming(
    model: torch.nn.Module, state: RunState, subgraphs: SubgraphList, output: OutputPlan | None, weights: Any,
    batches: list[dict[str, Any]], modifiers: Sequence[Any] = (), profiler: Any = None,
) -> StreamingCheckpoint | None:  # fmt: skip
    if output is None or output.args.output_dir is None:
        return None
    output.stream = StreamingCheckpoint(
        model, state, output.args.output_dir, subgraphs, output.run_id, overwrite=output.args.overwrite,
        resume=output.args.resume, weights=weights, batches=batches, profiler=profiler,
    )  # fmt: skip
    stuck = [m.name for m in modifiers if not getattr(m, "resumable", True)]
    if output.stream.finished >= 0 and stuck:
        raise ResumeError(
            f"output_dir {output.args.output_dir} holds an interrupted run of {stuck[0]}, which cannot be resumed "
            "(replayed layers would lack the weights it changed besides the quantized ones); start it again with "
            "overwrite=True (--overwrite)"
        )
    if output.stream.finished >= 0:
        logger.warning("seqcal: resuming after subgraph %d of %d", output.stream.finished, len(subgraphs))
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


def _layerwise_fallback(
    model: torch.nn.Module, batches: list[dict[str, Any]], targets: list[str] | None, err: TracingError
) -> tuple[SubgraphList, list[dict[str, Any]]]:
    """Tracing failed: calibrate layer by layer with hooks if the targets form a simple chain, else re-raise."""

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

    every = Subgraph(index=0, nodes=[], modules=[n for n, _ in model.named_modules() if n])
    start = time.perf_counter()
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for modifier in modifiers:
            stack.enter_context(modifier.calibrate(every, model, state))
        for batch in batches:
            state.token_mask = batch["attention_mask"].bool() if "attention_mask" in batch else None
            model(**batch, **_no_cache(model))
        state.token_mask = None
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
