"""Run subgraphs one by one over batches, keeping crossing values in an ActivationCache."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from seqcal.backend.host import trim_host_memory
from seqcal.distributed.reduce import named_from_bytes, named_to_bytes
from seqcal.execution.cache.store import ActivationCache
from seqcal.execution.transforms import (
    divide_inputs,
    split_transforms,
    transform_from_inputs,
    transform_with_hooks,
)
from seqcal.modifiers.kv_hooks import cache_update
from seqcal.records import Fold, fold_records, folds_from
from seqcal.report.profile import NullProfiler, Profiler, tensor_bytes
from seqcal.tracing.partition import Subgraph, target_ends
from seqcal.tracing.runner import GraphRunner as GraphRunner  # re-exported: moved beside the graph
from seqcal.tracing.runner import SubgraphExecutionError as SubgraphExecutionError

SubgraphCallback = Callable[[Subgraph, int], None]


def _put_inputs(
    subgraphs: Sequence[Subgraph],
    batches: Sequence[Mapping[str, Any]],
    cache: ActivationCache,
    placeholders: Mapping[str, str],
) -> None:
    """Store each batch's model inputs that some subgraph reads (no subgraph produces them)."""
    needed = {name for sg in subgraphs for name in sg.inputs}
    for b, batch in enumerate(batches):
        for key, node_name in placeholders.items():
            if node_name in needed:
                cache.put(b, node_name, batch[key])


def run_subgraphs(
    model: torch.nn.Module,
    subgraphs: Sequence[Subgraph],
    batches: Sequence[Mapping[str, Any]],
    cache: ActivationCache,
    placeholders: Mapping[str, str],
    keep_output: bool = True,
    progress: bool = True,
) -> list[Any]:
    """Run every subgraph over every batch, subgraph-major, freeing values at their last use.

    Args:
        model: the traced model (modules are looked up by name at run time).
        subgraphs: from ``partition``.
        batches: one dict of tensor inputs per batch (keys: the trace's input names).
        cache: holds values crossing subgraph boundaries; owned by the caller (closed by it).
        placeholders: input name -> placeholder node name.
        keep_output: return the graph output of each batch (False during calibration).
        progress: show a tqdm bar over subgraphs x batches.

    Returns:
        The graph output per batch (empty when ``keep_output`` is False).
    """
    runner = GraphRunner(model)  # torch's own kernels: SubgraphList.run() returns what model(**inputs) does
    _put_inputs(subgraphs, batches, cache, placeholders)
    outputs: list[Any] = []
    bar = tqdm(total=len(subgraphs) * len(batches), desc="subgraphs", disable=not progress, leave=False)
    try:
        for sg in subgraphs:
            for b in range(len(batches)):
                env = {name: cache.fetch(b, name) for name in sg.inputs}
                if b + 1 < len(batches):
                    cache.prefetch(b + 1, sg.inputs)  # copied beside this batch's compute (CUDA)
                result = runner.run(sg, env, release=())
                for name in sg.outputs:
                    cache.put(b, name, env[name])
                if sg.returns and keep_output:
                    outputs.append(result)
                bar.update()
            cache.settle()
            for name in sg.frees:
                cache.drop_name(name)
    finally:
        bar.close()
    return outputs


# Samples whose subgraph outputs are kept in full precision to measure the quantization error per subgraph
# (the first ones; counted in samples, not batches, so that batch_size="auto" keeps as little as batch 1).
ERROR_SAMPLE_ROWS = 4


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    if isinstance(value, dict):
        return next((t for t in map(_first_tensor, value.values()) if t is not None), None)
    return None


def _relative_error(got: Any, want: Any) -> float | None:
    a, b = _first_tensor(got), _first_tensor(want)
    if a is None or b is None or a.shape != b.shape:
        return None
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _error_sample(value: Any, mask: torch.Tensor | None, rows: int) -> tuple[Any, int]:
    """The first ``rows`` samples of a target's output, their real tokens only, and the samples it covers.

    Outputs at padding positions are no quantization error (nothing reads them); a value not shaped like the
    token mask is kept whole.
    """
    t = _first_tensor(value)
    if t is None or mask is None or tuple(t.shape[:2]) != tuple(mask.shape):
        return value, mask.shape[0] if mask is not None else 1
    n = min(rows, t.shape[0])
    return t[:n][mask[:n].to(t.device)], n  # [tokens, ...]: a copy, the batch's output is not held


def _token_mask(batch: Mapping[str, Any]) -> torch.Tensor | None:
    mask = batch.get("attention_mask")
    return mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


def calibrate_subgraphs(
    model: torch.nn.Module,
    subgraphs: Sequence[Subgraph],
    batches: Sequence[Mapping[str, Any]],
    modifiers: Sequence[Any],
    cache: ActivationCache,
    placeholders: Mapping[str, str],
    state: Any,
    on_subgraph_done: Callable[[Subgraph], int | None] | None = None,
    progress: bool = True,
    resume_from: int = 0,
    restore: Callable[[Subgraph], None] | None = None,
    on_subgraph_start: Callable[[Subgraph], int | None] | None = None,
    profiler: Profiler | None = None,
) -> list[dict[str, Any]]:
    """The sequential calibration loop (DESIGN data flow), one subgraph at a time.

    For each subgraph: modifiers attach hooks -> calibration pass over all batches -> modifiers compress ->
    propagation pass (hooks removed) when weights changed -> outputs stay in the cache -> values past their
    last use are freed. Subgraphs cut before their targets (``Subgraph.target_inputs``) calibrate from the
    cached inputs instead and run once (``_run_from_inputs``). Data-free modifiers only compress: with no
    modifier that needs data, no pass runs at all. Subgraphs whose outputs nobody reads and that hold nothing
    to compress (the head after the last layer) are skipped.

    Subgraphs before ``resume_from`` were finished by an interrupted run: ``restore`` puts their saved
    quantized weights back and they only run the propagation pass.

    Returns:
        One dict per subgraph: index, targets, seconds, rel_error (quantized vs full precision output).
    """
    runner = GraphRunner(model, state.device)
    prof = profiler if profiler is not None else NullProfiler()
    _put_inputs(subgraphs, batches, cache, placeholders)
    calibrating = any(m.needs_calibration for m in modifiers)
    rows = []
    bar = tqdm(total=len(subgraphs), desc="calibrating", unit="subgraph", disable=not progress)
    try:
        for sg in subgraphs:
            start = time.perf_counter()
            owned = any(m.modules_in(sg) for m in modifiers if hasattr(m, "modules_in"))
            row: dict[str, Any] = {"index": sg.index, "targets": sg.targets, "rel_error": None}
            replay = sg.index < resume_from
            label = f"subgraph {sg.index}"
            if on_subgraph_start is not None:
                with prof.span("onload", label, subgraph=sg.index) as args:
                    moved = on_subgraph_start(sg)  # e.g. onload its weights
                    if isinstance(moved, int):
                        args["bytes"] = moved
            if replay:
                with prof.span("onload", f"{label} (restore)", subgraph=sg.index):
                    _restore(sg, restore, runner.model, state)
                for fold in _replayed_folds(sg, state):  # the divisions the interrupted run made here
                    divide_inputs(cache, sg, fold, len(batches))
                for m in modifiers:  # their records of what the interrupted run did to it
                    if hasattr(m, "replayed"):
                        m.replayed(sg, runner.model, state)
                if sg.outputs and calibrating:
                    with torch.no_grad():
                        _pass(runner, sg, batches, cache, state, None, prof, "propagation")
                row["replayed"] = True
            elif sg.outputs or owned:
                row["rel_error"] = _run_one(
                    runner, sg, batches, modifiers, cache, state, calibrating, owned, prof
                )
            with prof.span("cache", "drop", subgraph=sg.index, names=len(sg.frees)):
                for name in sg.frees:
                    cache.drop_name(name)
            if on_subgraph_done is not None and not replay:
                with prof.span("offload", label, subgraph=sg.index) as args:
                    moved = on_subgraph_done(sg)  # e.g. save it, release its weights
                    if isinstance(moved, int):
                        args["bytes"] = moved
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            bar.update()
    finally:
        bar.close()
    return rows


def _restore(
    sg: Subgraph, restore: Callable[[Subgraph], None] | None, model: torch.nn.Module, state: Any
) -> None:
    """Put a finished subgraph's saved weights back; with several processes the one that writes the checkpoint
    reads them and sends them to the others: every module a modifier changed (quantized, pruned, folded into,
    calibrated buffers), or the others would replay a different model than the one the checkpoint holds."""
    if restore is not None:
        restore(sg)
    if state.sharding is not None:
        restored = [n for n in sorted(state.changed_modules()) if sg.holds(n)]
        state.sharding.share(sg.index, 0, restored, model, state)


def _replayed_folds(sg: Subgraph, state: Any) -> list[Fold]:
    """The folds whose scales divided ``sg``'s cached inputs in the interrupted run (read by the process that
    writes the checkpoint, ``StreamingCheckpoint.restore``, and sent to the others)."""
    folds, state.replay_folds = state.replay_folds, []
    if state.sharding is None or state.sharding.group.world_size == 1 or not sg.target_inputs:
        return folds

    data = None
    if state.sharding.group.writes:
        data = named_to_bytes({str(i): f.scales for i, f in enumerate(folds)}, {"folds": fold_records(folds)})
    tensors, meta = named_from_bytes(
        state.sharding.group.broadcast(data, 0, f"replaying subgraph {sg.index}")
    )
    return folds_from(meta["folds"], [tensors[str(i)] for i in range(len(tensors))])


def _shards(state: Any, num_batches: int) -> list[range]:
    """This process's virtual shards as ranges of its batches (all batches at once without sharding)."""
    return list(state.sharding.local_shards()) if state.sharding is not None else [range(num_batches)]


def _compress(
    runner: GraphRunner, sg: Subgraph, modifiers: Sequence[Any], state: Any, prof: Profiler
) -> bool:
    """Statistics of every shard folded on the processes that solve the subgraph (its owner, or one per module
    group), which compress their part; the weights go to every process. Returns whether weights changed."""
    label, sharding = f"subgraph {sg.index}", state.sharding
    if sharding is None:
        with prof.span("compress", label, subgraph=sg.index):
            return any([m.compress(sg, runner.model, state) for m in modifiers])
    with prof.span("communication", f"reduce {label}", subgraph=sg.index):
        sharding.reduce(sg.index, modifiers, state.device)
    before, changed = {*state.quantized, *state.sparsity}, False
    part = sharding.part(sg)  # what this process solves; a modifier that compresses everywhere (AWQ) does all
    todo = [(m, sg if getattr(m, "compresses_everywhere", False) else part) for m in modifiers]
    todo = [(m, view) for m, view in todo if view is not None]
    if todo:
        with prof.span("compress", label, subgraph=sg.index):
            changed = any([m.compress(view, runner.model, state) for m, view in todo])
    names = [n for n in {**state.quantized, **state.sparsity} if n not in before]  # quantized or pruned
    owner = sharding.owners[sg.index]
    with prof.span("communication", f"share {label}", subgraph=sg.index):
        for src in sharding.solvers(sg.index):  # each solver's modules, in rank order; the owner's results
            mine = [n for n in names if sharding.parts.get(n, owner) == src]
            got = sharding.share(sg.index, src, mine, runner.model, state, modifiers if src == owner else (),
                                 sg if src == owner else None)  # fmt: skip
            changed = got or changed
    return changed


def _autocast(state: Any) -> contextlib.AbstractContextManager:
    """Mixed precision as on GPUs: matmuls in the compute dtype, weights and norms in their own dtype.

    One autocast region per pass, so each weight is cast once per pass, not once per batch.
    """
    compute = getattr(state, "compute_dtype", None)
    return torch.autocast(state.device.type, dtype=compute) if compute else contextlib.nullcontext()


def _pass(runner: GraphRunner, sg: Subgraph, batches: Sequence[Mapping[str, Any]], cache: ActivationCache,
          state: Any, keep: dict[int, Any] | None, prof: Profiler, track: str,
          indices: Sequence[int] | None = None, until: str | None = None, store: bool = True) -> None:  # fmt: skip
    """Run ``sg`` over every batch (or those at ``indices``), storing its outputs (none when each run stops after
    the node named ``until``, or with ``store`` False: a later pass stores them); ``keep`` collects target
    outputs of a few batches.

    The propagation pass is the subgraph's last read of its inputs: the values past their last use
    (``sg.frees``) are dropped batch by batch as it goes, so each batch's inputs are freed before the next
    batch's outputs are allocated and reuse their memory. Dropped at the end of the subgraph instead, the
    inputs and outputs of every batch would be alive at once (the peak) and the heap's free pages handed
    back after each subgraph would be faulted in again by the next one.

    On CUDA the next batch's inputs are copied to the device while the current one computes
    (``ActivationCache.prefetch``), and its outputs go to the host on a side stream; the pass ends with the
    compute stream ordered after those copies (``settle``), before a solve changes weights in place.
    """
    targets = [n.name for n in target_ends(sg.nodes, sg.targets)]  # a target traced into ends a region
    kept = 0  # samples whose outputs ``keep`` holds
    indices = list(range(len(batches)) if indices is None else indices)
    last_read = track == "propagation" and until is None
    frees = [name for name in sg.frees if name in sg.inputs] if last_read else []
    with _autocast(state), prof.span(track, f"subgraph {sg.index}", subgraph=sg.index, batches=len(indices)):
        for i, b in enumerate(indices):
            batch = batches[b]
            state.token_mask = _token_mask(batch)
            with prof.span("cache", "fetch", subgraph=sg.index, batch=b) as args:
                env = {name: cache.fetch(b, name) for name in sg.inputs}
                if prof.enabled:
                    args["bytes"] = tensor_bytes(env)
                if i + 1 < len(indices):
                    cache.prefetch(indices[i + 1], sg.inputs)
            sampled = keep is not None and kept < ERROR_SAMPLE_ROWS and targets
            read_after = targets[-1:] if sampled else ()  # the error sample's; the rest go at their last read
            runner.run(sg, env, until, release=read_after)
            if until is not None:
                continue
            # without store the propagation pass after the solve stores them: not both passes' outputs at once
            if store:
                with prof.span("cache", "put", subgraph=sg.index, batch=b) as args:
                    waited = cache.copy_wait_seconds
                    for name in sg.outputs:
                        cache.put(b, name, env[name])
                    if prof.enabled:
                        args["bytes"] = tensor_bytes([env[name] for name in sg.outputs])
                        if cache.copy_wait_seconds > waited:  # for the previous batch's copies to the host
                            args["waited_s"] = round(cache.copy_wait_seconds - waited, 6)
            if sampled:
                keep[b], rows = _error_sample(env[targets[-1]], state.token_mask, ERROR_SAMPLE_ROWS - kept)
                kept += rows
            for name in frees:
                if (b, name) in cache:
                    cache.drop(b, name)
        cache.settle()
    state.token_mask = None


def _run_one(runner: GraphRunner, sg: Subgraph, batches: Sequence[Mapping[str, Any]], modifiers: Sequence[Any],
             cache: ActivationCache, state: Any, calibrating: bool, owned: bool,
             prof: Profiler) -> float | None:  # fmt: skip
    """One subgraph's passes and solve; ``owned``: a modifier has modules in it (``calibrate_subgraphs``)."""
    label = f"subgraph {sg.index}"
    with torch.no_grad():
        if not calibrating:  # data-free: nothing later reads activations, so no pass at all
            with prof.span("compress", label, subgraph=sg.index):
                for m in modifiers:
                    m.compress(sg, runner.model, state)
            return None
        if sg.target_inputs:
            return _run_from_inputs(runner, sg, batches, modifiers, cache, state, prof)
        # a subgraph holding modules to compress is run again after the solve, and that propagation pass
        # stores the outputs; the calibration pass stores them only for subgraphs with nothing to compress
        transforms, modifiers = split_transforms(modifiers)  # transforms fold before the others observe
        if transforms:

            def run(ix: Sequence[int]) -> None:  # the passes below store the outputs
                _pass(runner, sg, batches, cache, state, None, prof, "calibration", ix, store=False)

            transform_with_hooks(runner.model, sg, run, len(batches), transforms, modifiers, state)
        full: dict[int, Any] = {}
        for k, shard in enumerate(_shards(state, len(batches))):  # statistics per virtual shard
            with contextlib.ExitStack() as stack:
                for m in modifiers:
                    stack.enter_context(m.calibrate(sg, runner.model, state))
                _pass(runner, sg, batches, cache, state, full if k == 0 else None, prof, "calibration", shard,
                      store=not owned)  # fmt: skip
            if state.sharding is not None:
                state.sharding.collect(sg.index, k, modifiers, state.device)
        trim_host_memory()  # as in _run_from_inputs: the solve's temporaries on a trimmed heap
        if not _compress(runner, sg, modifiers, state, prof):
            if owned:  # nothing changed after all: the outputs are the calibration pass's, not stored yet
                _pass(runner, sg, batches, cache, state, None, prof, "propagation")
            return None
        quant: dict[int, Any] = {}
        _pass(runner, sg, batches, cache, state, quant, prof, "propagation")
    errors = [e for b in full if (e := _relative_error(quant.get(b), full[b])) is not None]
    return sum(errors) / len(errors) if errors else None


def _calibrate_kv(runner: GraphRunner, sg: Subgraph, batches: Sequence[Mapping[str, Any]], modifiers: Sequence[Any],
                  cache: ActivationCache, state: Any, prof: Profiler) -> None:  # fmt: skip
    """One-pass cut: the keys and values of the attention modules whose cache update ``sg`` runs are observed in
    a pass over every batch with the subgraph's modules already quantized (as inference computes them; outputs
    not kept), then their k_scale / v_scale are set (on the subgraph's owner, sent to the other processes); the
    propagation pass after it runs them as an fp8 KV cache holds them."""
    kvs = [m for m in modifiers if getattr(m, "kv", None) is not None]
    names = [n for n in sg.kv_updates if any(n in m.kv.modules and n not in m.kv.finished for m in kvs)]
    if not names:
        return
    label = f"subgraph {sg.index} (KV cache)"
    last = [node.name for node in sg.nodes if cache_update(node) in names][-1]  # nothing after it is needed
    with prof.span("calibration", label, subgraph=sg.index, batches=len(batches)):
        for k, shard in enumerate(_shards(state, len(batches))):  # statistics per virtual shard
            with contextlib.ExitStack() as stack:
                for m in kvs:
                    stack.enter_context(m.kv.observe_updates(names))
                _pass(runner, sg, batches, cache, state, None, prof, "calibration", shard, until=last)
            if state.sharding is not None:
                state.sharding.collect(sg.index, k, kvs, state.device, split=False)
    sharding = state.sharding
    if sharding is None:
        for m in kvs:
            m.kv_finish(sg, runner.model, state, updates=True)
        return
    with prof.span("communication", f"reduce {label}", subgraph=sg.index):
        sharding.reduce(sg.index, kvs, state.device)
    owner = sharding.owners[sg.index]
    if sharding.owns(sg.index):
        for m in kvs:
            m.kv_finish(sg, runner.model, state, updates=True)
    with prof.span("communication", f"share {label}", subgraph=sg.index):
        sharding.share(sg.index, owner, [], runner.model, state, kvs, sg)


def _run_from_inputs(runner: GraphRunner, sg: Subgraph, batches: Sequence[Mapping[str, Any]],
                     modifiers: Sequence[Any], cache: ActivationCache, state: Any, prof: Profiler) -> float | None:  # fmt: skip
    """One pass for a subgraph cut before its targets: calibrate from their cached inputs, then run it once.

    The targets' inputs were computed by earlier subgraphs (with every earlier module already quantized), so
    the modifiers observe them straight from the cache; after compressing, the single pass runs with the
    quantized weights and stores the outputs for the next subgraphs.

    Returns:
        The mean relative output error of the targets, as the modifiers measured it on all calibration
        inputs (``state.module_errors[name]["rel_error"]``; GPTQ computes it from its Hessian).
    """
    if not all(getattr(m, "input_only", False) for m in modifiers):
        raise AssertionError("subgraphs cut before their targets need modifiers that use only module inputs")
    label = f"subgraph {sg.index}"
    transforms, modifiers = split_transforms(modifiers)  # transforms fold first; the cache follows them
    if transforms:
        with prof.span("calibration", f"{label} (transforms)", subgraph=sg.index, batches=len(batches)):
            masks = [_token_mask(batch) for batch in batches]
            transform_from_inputs(runner.model, sg, cache, masks, transforms, modifiers, state)
    with prof.span("calibration", label, subgraph=sg.index, batches=len(batches)):
        for k, shard in enumerate(_shards(state, len(batches))):  # statistics per virtual shard
            shard = list(shard)
            for i, b in enumerate(shard):
                state.token_mask = _token_mask(batches[b])
                for j, (source, names) in enumerate(sg.target_inputs.items()):
                    x = cache.fetch(b, source)
                    if j == 0 and i + 1 < len(shard):  # copied beside this batch's statistics (CUDA)
                        cache.prefetch(shard[i + 1], sg.target_inputs)
                    for m in modifiers:
                        m.observe(names, x, state)
                    x = None  # not held through the next fetch, nor the solve (a batch of inputs on the device)
            if state.sharding is not None:
                state.sharding.collect(sg.index, k, modifiers, state.device)
        state.token_mask = None
    trim_host_memory()  # the solve's temporaries would otherwise land on a fragmented heap (RSS peak)
    _compress(runner, sg, modifiers, state, prof)
    if sg.kv_updates:
        _calibrate_kv(runner, sg, batches, modifiers, cache, state, prof)
    if sg.outputs:
        _pass(runner, sg, batches, cache, state, None, prof, "propagation")
    errors = [e for n in sg.targets if (e := state.module_errors.get(n, {}).get("rel_error")) is not None]
    return sum(errors) / len(errors) if errors else None
