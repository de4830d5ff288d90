"""Run subgraphs one by one over batches, keeping crossing values in an ActivationCache.

``calibrate_subgraphs`` is the calibration loop: each subgraph onloaded, replayed (a resumed run) or
calibrated (``seqcal.execution.one_subgraph``: its passes and its solve), its values past their last use
dropped, then saved and offloaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from seqcal.distributed.reduce import named_from_bytes, named_to_bytes
from seqcal.execution.cache.store import ActivationCache
from seqcal.execution.one_subgraph import run_one
from seqcal.execution.passes import autocast, run_pass
from seqcal.execution.reference import reference_pass
from seqcal.execution.transforms import (
    divide_inputs,
)
from seqcal.modifiers.contract import ModifierSet
from seqcal.modifiers.state import BatchCursor, RunState
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
    cached inputs instead and run once (``one_subgraph.run_from_inputs``). Data-free modifiers only compress: with no
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
                row["rel_error"] = run_one(
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
