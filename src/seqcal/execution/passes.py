"""One pass of a subgraph over the calibration batches, and what the passes share.

``run_pass`` is the executor's loop over batches: fetch a batch's inputs from the activation cache, run the
subgraph, store its outputs, drop the inputs past their last read; the error sample of the first batches'
target outputs; the batch being run (its token mask) on the run's ``BatchCursor``, which hooks read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from seqcal.execution.cache.store import ActivationCache
from seqcal.modifiers.contract import ModifierSet
from seqcal.modifiers.kv_hooks import cache_update
from seqcal.modifiers.state import Batch, BatchCursor, RunState
from seqcal.report.profile import Profiler, tensor_bytes
from seqcal.tracing.partition import Subgraph, target_ends
from seqcal.tracing.runner import GraphRunner

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


def relative_error(got: Any, want: Any) -> float | None:
    a, b = _first_tensor(got), _first_tensor(want)
    if a is None or b is None or a.shape != b.shape:
        return None
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def error_sample(value: Any, mask: torch.Tensor | None, rows: int) -> tuple[Any, int]:
    """The first ``rows`` samples of a target's output, their real tokens only, and the samples it covers.

    Outputs at padding positions are no quantization error (nothing reads them); a value not shaped like the
    token mask is kept whole.
    """
    t = _first_tensor(value)
    if t is None or mask is None or tuple(t.shape[:2]) != tuple(mask.shape):
        return value, mask.shape[0] if mask is not None else 1
    n = min(rows, t.shape[0])
    return t[:n][mask[:n].to(t.device)], n  # [tokens, ...]: a copy, the batch's output is not held


def token_mask(batch: Mapping[str, Any]) -> torch.Tensor | None:
    mask = batch.get("attention_mask")
    return mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


def local_shards(state: RunState, num_batches: int) -> list[range]:
    """This process's virtual shards as ranges of its batches (all batches at once without sharding)."""
    return (
        list(state.config.sharding.local_shards())
        if state.config.sharding is not None
        else [range(num_batches)]
    )


def autocast(state: RunState) -> contextlib.AbstractContextManager:
    """Mixed precision as on GPUs: matmuls in the compute dtype, weights and norms in their own dtype.

    One autocast region per pass, so each weight is cast once per pass, not once per batch.
    """
    compute = state.config.compute_dtype
    return torch.autocast(state.config.device.type, dtype=compute) if compute else contextlib.nullcontext()


def run_pass(runner: GraphRunner, sg: Subgraph, batches: Sequence[Mapping[str, Any]], cache: ActivationCache,
          state: RunState, keep: dict[int, Any] | None, prof: Profiler, track: str,
          indices: Sequence[int] | None = None, until: str | None = None, store: bool = True,
          cursor: BatchCursor | None = None) -> None:  # fmt: skip
    """Run ``sg`` over every batch (or those at ``indices``), storing its outputs (none when each run stops after
    the node named ``until``, or with ``store`` False: a later pass stores them); ``keep`` collects target
    outputs of a few batches; ``cursor`` (the run's) holds the batch being run for the modifiers' hooks.

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
    with autocast(state), prof.span(track, f"subgraph {sg.index}", subgraph=sg.index, batches=len(indices)):
        for i, b in enumerate(
            (cursor or BatchCursor()).over(indices, lambda b: Batch(token_mask(batches[b])))
        ):
            batch = batches[b]
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
                keep[b], rows = error_sample(env[targets[-1]], token_mask(batch), ERROR_SAMPLE_ROWS - kept)
                kept += rows
            for name in frees:
                if (b, name) in cache:
                    cache.drop(b, name)
        cache.settle()


def calibrate_kv(runner: GraphRunner, sg: Subgraph, batches: Sequence[Mapping[str, Any]], modifiers: Sequence[Any],
                  cache: ActivationCache, state: RunState, prof: Profiler, cursor: BatchCursor) -> None:  # fmt: skip
    """One-pass cut: the keys and values of the attention modules whose cache update ``sg`` runs are observed in
    a pass over every batch with the subgraph's modules already quantized (as inference computes them; outputs
    not kept), then their k_scale / v_scale are set (on the subgraph's owner, sent to the other processes); the
    propagation pass after it runs them as an fp8 KV cache holds them."""
    mods = ModifierSet.of(modifiers)
    kvs, calibrations = mods.with_kv(), mods.kv()
    names = [n for n in sg.kv_updates if any(n in kv.modules and n not in kv.finished for kv in calibrations)]
    if not names:
        return
    label = f"subgraph {sg.index} (KV cache)"
    last = [node.name for node in sg.nodes if cache_update(node) in names][-1]  # nothing after it is needed
    with prof.span("calibration", label, subgraph=sg.index, batches=len(batches)):
        for k, shard in enumerate(local_shards(state, len(batches))):  # statistics per virtual shard
            with contextlib.ExitStack() as stack:
                for m in kvs:
                    stack.enter_context(m.kv.observe_updates(names))
                run_pass(
                    runner,
                    sg,
                    batches,
                    cache,
                    state,
                    None,
                    prof,
                    "calibration",
                    shard,
                    until=last,
                    cursor=cursor,
                )
            if state.config.sharding is not None:
                state.config.sharding.collect(sg.index, k, kvs, state.config.device, split=False)
    sharding = state.config.sharding
    if sharding is None:
        for m in kvs:
            m.kv_finish(sg, runner.model, state, updates=True)
        return
    with prof.span("communication", f"reduce {label}", subgraph=sg.index):
        sharding.reduce(sg.index, kvs, state.config.device)
    owner = sharding.owners[sg.index]
    if sharding.owns(sg.index):
        for m in kvs:
            m.kv_finish(sg, runner.model, state, updates=True)
    with prof.span("communication", f"share {label}", subgraph=sg.index):
        sharding.share(sg.index, owner, [], runner.model, state, kvs, sg)
