"""One subgraph calibrated: its passes over the batches, its modifiers' solve, the pass that stores its outputs.

In the layer cut (``run_one``) a calibration pass feeds the modifiers' hooks, statistics per virtual shard,
then the subgraph is compressed and a propagation pass stores its outputs for the next subgraphs; a subgraph
cut before its targets (``run_from_inputs``) calibrates from their cached inputs and runs once. With several
processes the statistics are folded on the processes that solve the subgraph, and the weights they compute
go to every process (``compress_subgraph``). ``seqcal.execution.executor`` runs this for each subgraph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from seqcal.backend.host import trim_host_memory
from seqcal.execution.cache.store import ActivationCache
from seqcal.execution.passes import autocast, calibrate_kv, local_shards, relative_error, run_pass, token_mask
from seqcal.execution.reference import reference_pass
from seqcal.execution.transforms import split_transforms, transform_from_inputs, transform_with_hooks
from seqcal.modifiers import contract
from seqcal.modifiers.contract import ModifierSet
from seqcal.modifiers.state import Batch, BatchCursor, RunState
from seqcal.report.profile import Profiler
from seqcal.tracing.partition import Subgraph
from seqcal.tracing.runner import GraphRunner


def run_one(runner: GraphRunner, sg: Subgraph, batches: Sequence[Mapping[str, Any]], modifiers: Sequence[Any],
             cache: ActivationCache, state: RunState, calibrating: bool, owned: bool, prof: Profiler,
             reference: ActivationCache | None = None, cursor: BatchCursor | None = None) -> float | None:  # fmt: skip
    """One subgraph's passes and solve; ``owned``: a modifier has modules in it (``executor.calibrate_subgraphs``)."""
    label = f"subgraph {sg.index}"
    with torch.no_grad():
        if not calibrating:  # data-free: nothing later reads activations, so no pass at all
            with prof.span("compress", label, subgraph=sg.index):
                for m in modifiers:
                    m.compress(sg, runner.model, state)
            return None
        if sg.target_inputs:
            return run_from_inputs(runner, sg, batches, modifiers, cache, state, prof, reference, cursor)
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
        trim_host_memory()  # as in run_from_inputs: the solve's temporaries on a trimmed heap
        if not compress_subgraph(runner, sg, modifiers, state, prof):
            if owned:  # nothing changed after all: the outputs are the calibration pass's, not stored yet
                run_pass(runner, sg, batches, cache, state, None, prof, "propagation", cursor=cursor)
            return None
        quant: dict[int, Any] = {}
        run_pass(runner, sg, batches, cache, state, quant, prof, "propagation", cursor=cursor)
    errors = [e for b in full if (e := relative_error(quant.get(b), full[b])) is not None]
    return sum(errors) / len(errors) if errors else None


def run_from_inputs(runner: GraphRunner, sg: Subgraph, batches: Sequence[Mapping[str, Any]],
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
    compress_subgraph(runner, sg, modifiers, state, prof)
    if sg.kv_updates:
        calibrate_kv(runner, sg, batches, modifiers, cache, state, prof, cursor or BatchCursor())
    if sg.outputs:
        run_pass(runner, sg, batches, cache, state, None, prof, "propagation", cursor=cursor)
    errors = [
        e for n in sg.targets if (e := state.results.module_errors.get(n, {}).get("rel_error")) is not None
    ]
    return sum(errors) / len(errors) if errors else None


def compress_subgraph(
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
