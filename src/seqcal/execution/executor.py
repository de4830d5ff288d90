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
from seqcal.execution.passes import autocast, calibrate_kv, local_shards, relative_error, run_pass, token_mask
from seqcal.execution.reference import reference_pass
from seqcal.execution.transforms import (
    divide_inputs,
    split_transforms,
    transform_from_inputs,
    transform_with_hooks,
)
from seqcal.modifiers import contract
from seqcal.modifiers.contract import ModifierSet
from seqcal.modifiers.state import Batch, BatchCursor, RunState
from seqcal.records import Fold, fold_records, folds_from
from seqcal.report.profile import NullProfiler, Profiler
from seqcal.tracing.partition import Subgraph
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


def calibrate_subgraphs(
    model: torch.nn.Module,
    subgraphs: Sequence[Subgraph],
    batches: Sequence[Mapping[str, Any]],
    modifiers: Sequence[Any],
    cache: ActivationCache,
    placeholders: Mapping[str, str],
    state: RunState,
    on_subgraph_done: Callable[[Subgraph], int | None] | None = None,
    progress: bool = True,
    resume_from: int = 0,
    restore: Callable[[Subgraph], list[Fold]] | None = None,
    on_subgraph_start: Callable[[Subgraph], int | None] | None = None,
    profiler: Profiler | None = None,
    reference: ActivationCache | None = None,
    cursor: BatchCursor | None = None,
) -> list[dict[str, Any]]:
    """The sequential calibration loop (DESIGN data flow), one subgraph at a time.

    For each subgraph: modifiers attach hooks -> calibration pass over all batches -> modifiers compress ->
    propagation pass (hooks removed) when weights changed -> outputs stay in the cache -> values past their
    last use are freed. Subgraphs cut before their targets (``Subgraph.target_inputs``) calibrate from the
    cached inputs instead and run once (``_run_from_inputs``). Data-free modifiers only compress: with no
    modifier that needs data, no pass runs at all. Subgraphs whose outputs nobody reads and that hold nothing
    to compress (the head after the last layer) are skipped.

    Subgraphs before ``resume_from`` were finished by an interrupted run: ``restore`` puts their saved
    quantized weights back (and returns the folds whose scales divided their cached inputs) and they only run
    the propagation pass.

    ``reference``: the full-precision stream's cache, when a modifier reads full-precision inputs
    (``execution.reference``); every subgraph also runs on it, before its modules are compressed.

    ``cursor``: the batch being run, for the modifiers' hooks (the run's, when a stand-in KV cache reads it too).

    Returns:
        One dict per subgraph: index, targets, seconds, rel_error (quantized vs full precision output).
    """
    runner = GraphRunner(model, state.config.device)
    cursor = cursor if cursor is not None else BatchCursor()
    prof = profiler if profiler is not None else NullProfiler()
    _put_inputs(subgraphs, batches, cache, placeholders)
    if reference is not None:
        _put_inputs(subgraphs, batches, reference, placeholders)
    modifiers = ModifierSet.of(modifiers)
    calibrating = modifiers.calibrating
    rows = []
    bar = tqdm(total=len(subgraphs), desc="calibrating", unit="subgraph", disable=not progress)
    try:
        for sg in subgraphs:
            start = time.perf_counter()
            owned = modifiers.owns(sg)
            row: dict[str, Any] = {"index": sg.index, "targets": sg.targets, "rel_error": None}
            replay = sg.index < resume_from
            label = f"subgraph {sg.index}"
            if on_subgraph_start is not None:
                with prof.span("onload", label, subgraph=sg.index) as args:
                    moved = on_subgraph_start(sg)  # e.g. onload its weights
                    if isinstance(moved, int):
                        args["bytes"] = moved
            if replay:
                if reference is not None and sg.outputs:  # the model's own weights, before the saved ones
                    with prof.span("calibration", f"{label} (full precision)", subgraph=sg.index):
                        reference_pass(runner, sg, batches, reference, lambda: autocast(state))
                with prof.span("onload", f"{label} (restore)", subgraph=sg.index):
                    folds = _restore(sg, restore, runner.model, state)
                for fold in _replayed_folds(sg, state, folds):  # the divisions the interrupted run made here
                    divide_inputs(cache, sg, fold, len(batches))
                for m in modifiers:  # their records of what the interrupted run did to it
                    m.replayed(sg, runner.model, state)
                if sg.outputs and calibrating:
                    with torch.no_grad():
                        run_pass(runner, sg, batches, cache, state, None, prof, "propagation", cursor=cursor)
                row["replayed"] = True
            elif sg.outputs or owned:
                row["rel_error"] = _run_one(
                    runner, sg, batches, modifiers, cache, state, calibrating, owned, prof, reference, cursor
                )
            with prof.span("cache", "drop", subgraph=sg.index, names=len(sg.frees)):
                for name in sg.frees:
                    cache.drop_name(name)
                    if reference is not None:
                        reference.drop_name(name)
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
    sg: Subgraph, restore: Callable[[Subgraph], list[Fold]] | None, model: torch.nn.Module, state: RunState
) -> list[Fold]:
    """Put a finished subgraph's saved weights back; with several processes the one that writes the checkpoint
    reads them and sends them to the others: every module a modifier changed (quantized, pruned, folded into,
    calibrated buffers), or the others would replay a different model than the one the checkpoint holds.

    Returns:
        The folds whose scales divided the subgraph's cached inputs, as its file records them (none where
        this process does not read the checkpoint).
    """
    folds = restore(sg) if restore is not None else []
    if state.config.sharding is not None:
        restored = [n for n in sorted(state.changed_modules()) if sg.holds(n)]
        state.config.sharding.share(sg.index, 0, restored, model, state)
    return folds


def _replayed_folds(sg: Subgraph, state: RunState, folds: list[Fold]) -> list[Fold]:
    """The folds whose scales divided ``sg``'s cached inputs in the interrupted run (``folds``: read by the
    process that writes the checkpoint, ``StreamingCheckpoint.restore``, and sent to the others)."""
    if state.config.sharding is None or state.config.sharding.group.world_size == 1 or not sg.target_inputs:
        return folds

    data = None
    if state.config.sharding.group.writes:
        data = named_to_bytes({str(i): f.scales for i, f in enumerate(folds)}, {"folds": fold_records(folds)})
    tensors, meta = named_from_bytes(
        state.config.sharding.group.broadcast(data, 0, f"replaying subgraph {sg.index}")
    )
    return folds_from(meta["folds"], [tensors[str(i)] for i in range(len(tensors))])


def _compress(
    runner: GraphRunner, sg: Subgraph, modifiers: ModifierSet, state: RunState, prof: Profiler
) -> bool:
    """Statistics of every shard folded on the processes that solve the subgraph (its owner, or one per module
    group), which compress their part; the weights go to every process. Returns whether weights changed."""
    label, sharding = f"subgraph {sg.index}", state.config.sharding
    if sharding is None:
        contract.finish_local(modifiers)
        with prof.span("compress", label, subgraph=sg.index):
            return any([m.compress(sg, runner.model, state) for m in modifiers])
    with prof.span("communication", f"reduce {label}", subgraph=sg.index):
        sharding.reduce(sg.index, modifiers, state.config.device)
    before, changed = {*state.results.quantized, *state.results.sparsity}, False
    part = sharding.part(sg)  # what this process solves; a modifier that compresses everywhere (AWQ) does all
    todo = [(m, sg if modifiers.compresses_everywhere(m) else part) for m in modifiers]
    todo = [(m, view) for m, view in todo if view is not None]
    if todo:
        with prof.span("compress", label, subgraph=sg.index):
            changed = any([m.compress(view, runner.model, state) for m, view in todo])
    names = [
        n for n in {**state.results.quantized, **state.results.sparsity} if n not in before
    ]  # quantized or pruned
    owner = sharding.owners[sg.index]
    with prof.span("communication", f"share {label}", subgraph=sg.index):
        for src in sharding.solvers(sg.index):  # each solver's modules, in rank order; the owner's results
            mine = [n for n in names if sharding.parts.get(n, owner) == src]
            got = sharding.share(sg.index, src, mine, runner.model, state, modifiers if src == owner else (),
                                 sg if src == owner else None)  # fmt: skip
            changed = got or changed
    return changed


def _run_one(runner: GraphRunner, sg: Subgraph, batches: Sequence[Mapping[str, Any]], modifiers: Sequence[Any],
             cache: ActivationCache, state: RunState, calibrating: bool, owned: bool, prof: Profiler,
             reference: ActivationCache | None = None, cursor: BatchCursor | None = None) -> float | None:  # fmt: skip
    """One subgraph's passes and solve; ``owned``: a modifier has modules in it (``calibrate_subgraphs``)."""
    label = f"subgraph {sg.index}"
    with torch.no_grad():
        if not calibrating:  # data-free: nothing later reads activations, so no pass at all
            with prof.span("compress", label, subgraph=sg.index):
                for m in modifiers:
                    m.compress(sg, runner.model, state)
            return None
        if sg.target_inputs:
            return _run_from_inputs(runner, sg, batches, modifiers, cache, state, prof, reference, cursor)
        # a subgraph holding modules to compress is run again after the solve, and that propagation pass
        # stores the outputs; the calibration pass stores them only for subgraphs with nothing to compress
        transforms, modifiers = split_transforms(modifiers)  # transforms fold before the others observe
        if transforms:

            def run(ix: Sequence[int]) -> None:  # the passes below store the outputs
                run_pass(
                    runner,
                    sg,
                    batches,
                    cache,
                    state,
                    None,
                    prof,
                    "calibration",
                    ix,
                    store=False,
                    cursor=cursor,
                )

            transform_with_hooks(runner.model, sg, run, len(batches), transforms, modifiers, state, cursor)
        full: dict[int, Any] = {}
        capture = ModifierSet.of(modifiers).float_modules(sg) if reference is not None else []
        for k, shard in enumerate(local_shards(state, len(batches))):  # statistics per virtual shard
            # with a full-precision stream, batch by batch: its module inputs paired with the calibration's
            for j, part in enumerate([shard] if reference is None else [[b] for b in shard]):
                paired = None
                if reference is not None:
                    paired = reference_pass(
                        runner, sg, batches, reference, lambda: autocast(state), part, capture
                    )
                with contextlib.ExitStack() as stack:
                    for m in modifiers:
                        stack.enter_context(contract.calibrating(m, sg, runner.model, state, cursor, paired))
                    run_pass(runner, sg, batches, cache, state, full if k == j == 0 else None, prof, "calibration",
                          part, store=not owned, cursor=cursor)  # fmt: skip
            if state.config.sharding is not None:
                state.config.sharding.collect(sg.index, k, modifiers, state.config.device)
        trim_host_memory()  # as in _run_from_inputs: the solve's temporaries on a trimmed heap
        if not _compress(runner, sg, modifiers, state, prof):
            if owned:  # nothing changed after all: the outputs are the calibration pass's, not stored yet
                run_pass(runner, sg, batches, cache, state, None, prof, "propagation", cursor=cursor)
            return None
        quant: dict[int, Any] = {}
        run_pass(runner, sg, batches, cache, state, quant, prof, "propagation", cursor=cursor)
    errors = [e for b in full if (e := relative_error(quant.get(b), full[b])) is not None]
    return sum(errors) / len(errors) if errors else None


def _run_from_inputs(runner: GraphRunner, sg: Subgraph, batches: Sequence[Mapping[str, Any]],
                     modifiers: Sequence[Any], cache: ActivationCache, state: RunState, prof: Profiler,
                     reference: ActivationCache | None = None, cursor: BatchCursor | None = None,
                     ) -> float | None:  # fmt: skip
    """One pass for a subgraph cut before its targets: calibrate from their cached inputs, then run it once.

    The targets' inputs were computed by earlier subgraphs (with every earlier module already quantized), so
    the modifiers observe them straight from the cache; after compressing, the single pass runs with the
    quantized weights and stores the outputs for the next subgraphs.

    Returns:
        The mean relative output error of the targets, as the modifiers measured it on all calibration
        inputs (``state.results.module_errors[name]["rel_error"]``; GPTQ computes it from its Hessian).
    """
    if not modifiers.input_only:
        raise AssertionError("subgraphs cut before their targets need modifiers that use only module inputs")
    label = f"subgraph {sg.index}"
    transforms, modifiers = split_transforms(modifiers)  # transforms fold first; the cache follows them
    if transforms:
        with prof.span("calibration", f"{label} (transforms)", subgraph=sg.index, batches=len(batches)):
            seen = [Batch(token_mask(batch)) for batch in batches]
            transform_from_inputs(runner.model, sg, cache, seen, transforms, modifiers, state)
    with prof.span("calibration", label, subgraph=sg.index, batches=len(batches)):
        for k, shard in enumerate(local_shards(state, len(batches))):  # statistics per virtual shard
            shard = list(shard)
            for i, b in enumerate(shard):
                batch = Batch(token_mask(batches[b]))
                for j, (source, names) in enumerate(sg.target_inputs.items()):
                    x = cache.fetch(b, source)
                    if j == 0 and i + 1 < len(shard):  # copied beside this batch's statistics (CUDA)
                        cache.prefetch(shard[i + 1], sg.target_inputs)
                    ref = reference.fetch(b, source) if reference is not None else None
                    for m in modifiers:
                        contract.observe(m, names, x, state, batch, ref)
                    x = ref = (
                        None  # not held through the next fetch, nor the solve (a batch of inputs on the device)
                    )
            if state.config.sharding is not None:
                state.config.sharding.collect(sg.index, k, modifiers, state.config.device)
    if reference is not None and sg.outputs:  # with the subgraph's weights as the model has them
        with prof.span("calibration", f"{label} (full precision)", subgraph=sg.index, batches=len(batches)):
            reference_pass(runner, sg, batches, reference, lambda: autocast(state))
    trim_host_memory()  # the solve's temporaries would otherwise land on a fragmented heap (RSS peak)
    _compress(runner, sg, modifiers, state, prof)
    if sg.kv_updates:
        calibrate_kv(runner, sg, batches, modifiers, cache, state, prof, cursor or BatchCursor())
    if sg.outputs:
        run_pass(runner, sg, batches, cache, state, None, prof, "propagation", cursor=cursor)
    errors = [
        e for n in sg.targets if (e := state.results.module_errors.get(n, {}).get("rel_error")) is not None
    ]
    return sum(errors) / len(errors) if errors else None
