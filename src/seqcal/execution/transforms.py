"""Transforms first: the executor's steps for modifiers that edit weights upstream of a group (``transforms``).

Order inside a group (a subgraph cut before q/k/v, say): the transforms observe the group's cached inputs and
fold their scales (``RunState.fold``); the cached inputs are rewritten as ``X / s``; the other modifiers are
told (``on_fold``) and only then observe the rewritten inputs. No forward pass is added: the transforms
read the cache. Subgraphs cut after whole layers run one extra calibration pass for the transforms instead
(the producer lives inside the layer, so the next pass reads the new coordinates by itself).

Example:
    >>> transforms, quantizers = split_transforms(modifiers)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from seqcal.modifiers.contract import ModifierSet
from seqcal.modifiers.state import Batch, BatchCursor, RunState
from seqcal.records import Fold
from seqcal.tracing import TracingError, trace

logger = logging.getLogger("seqcal")


def split_transforms(modifiers: Sequence[Any]) -> tuple[ModifierSet, ModifierSet]:
    """(modifiers with ``transforms``, the others), each in recipe order."""
    return ModifierSet.of(modifiers).split()


def owns(modifier: Any, sg: Any) -> bool:
    return bool(modifier.modules_in(sg))


def prepare_modifiers(model: torch.nn.Module, subgraphs: Any, sample: Mapping[str, Any], modifiers: Sequence[Any],
                      state: RunState) -> None:  # fmt: skip
    """Give the transforms the traced graph (``prepare``) and add the producers they edit to the modules of
    the subgraphs that run their consumers (onloaded with them, written to the checkpoint after them)."""
    preparing = ModifierSet.of(modifiers).preparing()
    if not preparing:
        return
    graph = linear_graph(model, sample, subgraphs)
    for m in preparing:
        m.prepare(graph, model, state)
        for sg in subgraphs:
            for name in m.upstream(sg):
                if not sg.holds(name):
                    sg.modules.append(name)


def linear_graph(model: torch.nn.Module, sample: Mapping[str, Any], subgraphs: Any = None) -> fx.Graph | None:
    """A graph of ``model`` in which every Linear inside the layers is a call_module node: the run's own when
    it is cut before the modules, else a trace of ``sample`` with the Linears as targets (None if that fails).

    Example:
        >>> graph = linear_graph(model, {"input_ids": ids})  # doctest: +SKIP
    """
    if subgraphs is not None and any(sg.target_inputs for sg in subgraphs):
        return subgraphs.traced.graph

    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "." in n]
    pattern = "re:^(" + "|".join(re.escape(n) for n in names) + ")$"
    try:  # Linears inside opaque code (a loop over experts) are left out: they get no mapping, said below
        result = trace(model, dict(sample), [pattern], [], None, hidden_targets=True)
    except TracingError as err:
        logger.warning(
            "seqcal: no graph with the Linears as nodes (%s); give explicit mappings", err.problems[0].what
        )
        return None
    traced = set(result.targets)
    hidden = [n for n in names if n not in traced]
    if hidden:
        logger.warning(
            "seqcal: %d Linears run inside opaque code (%s%s), so no smoothing mapping is derived for them; "
            "give explicit mappings to smooth them", len(hidden), ", ".join(hidden[:3]), ", ..." if len(hidden) > 3 else ""
        )  # fmt: skip
    return result.graph


def transform_from_inputs(model: torch.nn.Module, sg: Any, cache: Any, batches: Sequence[Batch],
                          transforms: Sequence[Any], others: Sequence[Any], state: RunState) -> None:  # fmt: skip
    """One-pass cut: the transforms observe ``sg``'s cached group inputs and fold; the inputs are rewritten.

    Their statistics are gathered per virtual shard and reduced on every process (``reduce_statistics``), so
    that every process folds the same scales.

    Args:
        batches: what the transforms' ``observe`` gets of each batch besides its input (its token mask).
    """
    active = [t for t in transforms if owns(t, sg)]
    if not active:
        return
    for k, shard in enumerate(_shards(state, len(batches))):
        for b in shard:
            for source, names in sg.target_inputs.items():
                x = cache.fetch(b, source)
                for t in active:
                    t.observe(names, x, state, batches[b])
        _collect(state, sg, k, active)
    reduce_statistics(state, sg, active)
    start = len(state.ledger.folds)
    for t in active:
        t.compress(sg, model, state)
    for fold in state.ledger.since(start):
        divide_inputs(cache, sg, fold, len(batches))
        state.ledger.divide(sg.index, fold)
        notify(fold, others, model, state)


def divide_inputs(cache: Any, sg: Any, fold: Fold, num_batches: int) -> None:
    """Rewrite the cached input of ``fold``'s consumers in ``sg`` as ``X / s``. A resumed run repeats exactly this
    when it replays ``sg`` (after replaying the producer with its weights from before the fold), so that it
    computes the same bits as the run it resumes: the folded producer itself would round differently."""
    source = _source_of(sg, fold)
    for b in range(num_batches):
        x = cache.fetch(b, source)
        cache.put(b, source, (x.float() / fold.scales.to(x.device)).to(x.dtype))  # [..., in] / [in]
    cache.settle()  # the copies to the host done before the next fold changes weights


def transform_with_hooks(model: torch.nn.Module, sg: Any, run_pass: Callable[[Sequence[int]], None], num_batches: int,
                         transforms: Sequence[Any], others: Sequence[Any], state: RunState,
                         cursor: BatchCursor) -> None:  # fmt: skip
    """Layer cut: one calibration pass with only the transforms' hooks (a shard at a time, ``run_pass`` runs the
    batches at the given indices, moving ``cursor``, which the hooks read), then they fold (before any other modifier's hooks see the layer, which the
    next pass runs in the new coordinates)."""
    import contextlib

    active = [t for t in transforms if owns(t, sg)]
    if not active:
        return
    for k, shard in enumerate(_shards(state, num_batches)):
        with contextlib.ExitStack() as stack:
            for t in active:
                stack.enter_context(t.calibrate(sg, model, state, cursor))
            run_pass(shard)
        _collect(state, sg, k, active)
    reduce_statistics(state, sg, active)
    start = len(state.ledger.folds)
    for t in active:
        t.compress(sg, model, state)
    for fold in state.ledger.since(start):
        notify(fold, others, model, state)


def _shards(state: RunState, num_batches: int) -> list[range]:
    """This process's virtual shards as ranges of its batches (all batches at once without sharding)."""
    return (
        list(state.config.sharding.local_shards())
        if state.config.sharding is not None
        else [range(num_batches)]
    )


def _collect(state: RunState, sg: Any, shard: int, transforms: Sequence[Any]) -> None:
    if state.config.sharding is not None:
        state.config.sharding.collect(sg.index, shard, transforms, state.config.device, split=False)


def reduce_statistics(state: RunState, sg: Any, transforms: Sequence[Any]) -> None:
    """The transforms' statistics of every shard, folded in shard order, loaded on every process: each folds
    the same scales into its own copy of the weights and rewrites its own cached inputs."""
    if state.config.sharding is not None:
        state.config.sharding.reduce(sg.index, transforms, state.config.device, everywhere=True)


def notify(fold: Fold, others: Sequence[Any], model: torch.nn.Module, state: RunState) -> None:
    for m in others:
        m.on_fold(fold, model, state)


def _source_of(sg: Any, fold: Fold) -> str:
    consumers = set(fold.mapping.consumers)
    for source, names in sg.target_inputs.items():
        if consumers <= set(names):
            return source
    raise RuntimeError(
        f"subgraph {sg.index}: no cached input is read by all of {sorted(consumers)}; a fold must be recorded "
        "while the subgraph that runs its consumers is calibrated"
    )
