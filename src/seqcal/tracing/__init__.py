"""Tracing: a transformers model and a sample -> an fx graph whose targets are call_module nodes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from seqcal.tracing.decide import Guard
from seqcal.tracing.diagnostics import Problem, TracingError
from seqcal.tracing.leaves import TraceInto, resolve_trace_into
from seqcal.tracing.partition import target_ends
from seqcal.tracing.policy import LeafPolicy, TraceState
from seqcal.tracing.retries import trace_with_retries
from seqcal.tracing.sources import OpaqueSite
from seqcal.tracing.targets import (
    called_targets,
    check_targets,
    holders_of,
    infer_candidates,
    match_targets,
    matches,
)
from seqcal.tracing.values import contains_proxy

MAX_DECIDE_ROUNDS = 8  # traces with more runtime tests decided each time (one branch can uncover another)

__all__ = ["TraceResult", "TracingError", "Problem", "trace", "split_inputs"]


@dataclass
class TraceResult:
    """The traced graph and what tracing decided.

    Attributes:
        graph: the fx graph; targets are call_module nodes, opaque code is call_function nodes.
        targets: qualified names of the target modules, in execution order.
        input_names: tensor inputs (placeholders), in order.
        constants: non-tensor inputs the graph was specialised on (they must be the same at run time).
        opaque_sites: every place where code was made opaque, with why.
        failures: statements that failed to trace symbolically and were made opaque, with the error.
        traced_into: modules whose forwards were traced although they hold no target (``trace_into``).
        not_traced_into: modules ``trace_into`` asked for that stayed one node, with where and why.
    """

    graph: fx.Graph
    targets: list[str]
    input_names: list[str]
    constants: dict[str, Any]
    opaque_sites: list[OpaqueSite] = field(default_factory=list)
    failures: dict[tuple[str, int, int], str] = field(default_factory=dict)
    traced_into: list[str] = field(default_factory=list)
    not_traced_into: list[Problem] = field(default_factory=list)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    return False


def split_inputs(sample: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split model kwargs into tensor inputs (graph placeholders) and constants (baked into the graph)."""
    tensors = {k: v for k, v in sample.items() if _holds_tensor(v)}
    constants = {k: v for k, v in sample.items() if k not in tensors}
    if contains_proxy(constants):
        raise TypeError("sample values must be real values, not fx proxies")
    return tensors, constants


def trace(
    model: torch.nn.Module,
    sample: Mapping[str, Any],
    sequential_targets: str | Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    leaf_modules: Sequence[str] | None = None,
    trace_into: TraceInto = None,
    trace_depth: int | None = None,
    hidden_targets: bool = False,
) -> TraceResult:
    """Trace ``model(**sample)`` into a graph where each sequential target is one call_module node.

    Only the sample's *structure* is used (which inputs are given, non-tensor flags); its values and
    shapes are not: data-dependent code runs at execution time inside opaque nodes. No weight is read,
    copied or moved, so weights may sit on meta, cpu or disk.

    Args:
        model: a transformers (or any torch) model.
        sample: keyword inputs as for ``model(**sample)``.
        sequential_targets: class names or ``re:`` patterns on qualified names; default: the layers of the
            stacks the (text) model's forward calls.
        ignore: function or method names always run opaquely (their code is never traced).
        leaf_modules: class names or ``re:`` patterns of modules kept as single nodes (also inside
            ``trace_into``).
        trace_into: modules to trace into instead of keeping them one node: ``"all"`` (the full graph), or
            class names / ``re:`` patterns (their ancestors are traced too). torch.nn's own modules (Linear,
            Embedding, norms, activations ...) always stay single nodes. A target traced into becomes one
            contiguous region of nodes in its own subgraph. A module whose forward cannot be traced stays
            one node and is listed, with file and line, in ``not_traced_into``.
        trace_depth: with ``trace_into``, open only modules at most this many levels below the modules
            traced anyway (``"all"`` with 1: the layers' own forwards, their attention and MLP closed).
        hidden_targets: True to leave out the targets that run inside opaque code (no node of their own,
            as the experts of a loop over experts) instead of raising: for a graph that is read, not
            calibrated (smoothing mappings), where what is hidden is only not found.

    Returns:
        A TraceResult.

    Raises:
        TracingError: when some target cannot be its own call_module node; says where and how to fix it.

    Example:
        >>> result = trace(model, {"input_ids": ids})  # doctest: +SKIP
        >>> result.targets[:2]  # doctest: +SKIP
        ['model.layers.0', 'model.layers.1']
    """
    if isinstance(sequential_targets, str):
        sequential_targets = [sequential_targets]
    inferred = sequential_targets is None
    targets = infer_candidates(model) if inferred else match_targets(model, list(sequential_targets))
    if not targets:
        raise TracingError(
            [
                Problem(
                    type(model).__name__,
                    "found no stack of layers to use as targets",
                    "pass sequential_targets",
                )
            ]
        )
    user_leaf = (
        (lambda m, name: matches(m, name, list(leaf_modules))) if leaf_modules else (lambda m, name: False)
    )
    _check_leaf_conflicts(model, targets, user_leaf)
    tensors, constants = split_inputs(sample)
    holders = holders_of(model, targets)
    opened = resolve_trace_into(model, trace_into, holders, user_leaf, trace_depth)
    policy = LeafPolicy(targets=targets, holders=holders, user_leaf=user_leaf, opened=opened)
    ignored = frozenset(ignore or ())
    # Branches that reach a target but test runtime values hide targets when made opaque: trace again with
    # those tests decided on the sample and guarded at run time (decide.py), as long as that finds more of
    # them; if it never succeeds, the first diagnosis is reported.
    decide: frozenset[tuple[str, int, int]] = frozenset()
    first: list[Problem] | None = None
    for _ in range(MAX_DECIDE_ROUNDS):
        graph, tracer, state = trace_with_retries(model, tensors, constants, policy, ignored, decide)
        found, problems = _checked(graph, model, targets, inferred, tracer, state)
        if hidden_targets:
            called = called_targets(graph, found, tracer.entered)
            found = {i: n for i, n in found.items() if called.get(n)}
            problems = check_targets(graph, model, found, state.failures, tracer.entered)
        first = problems if first is None or any(" skip them" in p.what for p in problems) else first
        more = decide | (state.decidable & set(state.failures))
        if not problems or more == decide:
            break
        decide = frozenset(more)
    if problems:
        raise TracingError(first or problems, type(model).__name__)
    targets = found
    order = list(target_ends(graph.nodes, list(targets.values())).values())
    holder_names = {n for n, m in model.named_modules() if id(m) in holders}
    return TraceResult(
        graph=graph,
        targets=order,
        input_names=list(tensors),
        constants=constants,
        opaque_sites=list(tracer.sites.values()),
        failures=dict(state.failures),
        traced_into=[n for n in tracer.entered if n not in holder_names],
        not_traced_into=list(state.refusals),
    )


def _checked(
    graph: fx.Graph,
    model: torch.nn.Module,
    targets: dict[int, str],
    inferred: bool,
    tracer: Any,
    state: TraceState,
) -> tuple[dict[int, str], list[Problem]]:
    """The targets the trace called (inferred ones narrowed to the stacks called) and invariant-2 problems."""
    if inferred:
        targets = _called_candidates(graph, model, targets, tracer.entered)
    guards = [n.target for n in graph.nodes if n.op == "call_function" and isinstance(n.target, Guard)]
    counts = called_targets(graph, targets, tracer.entered)
    skipped = sorted(name for name, count in counts.items() if count == 0)
    if not guards or not skipped:
        return targets, check_targets(graph, model, targets, state.failures, tracer.entered)
    # Targets skipped by a branch decided on the sample: they get no input, so they cannot be calibrated.
    kept = {i: n for i, n in targets.items() if n not in skipped}
    called = sorted({type(model.get_submodule(n)).__name__ for n in kept.values()})
    where = "; ".join(sorted({f"{g.where} (`{g.source}`)" for g in guards}))
    problem = Problem(
        where=guards[0].where,
        what=(
            f"{len(skipped)} target(s) ({', '.join(skipped[:3])}) are not called for the trace sample's inputs: "
            f"the branches at {where} test runtime values and, decided on the sample, skip them"
        ),
        fix=f"target only the layers that run: sequential_targets={called}, or trace on inputs that use them",
    )
    return targets, [problem, *check_targets(graph, model, kept, state.failures, tracer.entered)]


def _check_leaf_conflicts(model: torch.nn.Module, targets: dict[int, str], user_leaf: Any) -> None:
    names = set(targets.values())
    for name, module in model.named_modules():
        if name and id(module) not in targets and user_leaf(module, name):
            hidden = [t for t in names if t.startswith(name + ".")]
            if hidden:
                raise TracingError(
                    [
                        Problem(
                            where=name,
                            what=f"leaf module {name} ({type(module).__name__}) contains targets {hidden[:3]}",
                            fix="remove it from leaf_modules or choose targets outside it",
                        )
                    ]
                )


def _called_candidates(
    graph: fx.Graph, model: torch.nn.Module, candidates: dict[int, str], entered: Mapping[str, int]
) -> dict[int, str]:
    """Inferred targets: the candidate stacks the forward calls. A stack called only in part is an error."""
    called = {n.target for n in graph.nodes if n.op == "call_module"} | set(entered)
    stacks: dict[str, list[str]] = {}
    for name in candidates.values():
        stacks.setdefault(name.rsplit(".", 1)[0], []).append(name)
    kept: dict[int, str] = {}
    for members in stacks.values():
        if any(m in called for m in members):
            kept.update({i: n for i, n in candidates.items() if n in members})
    # None called: keep them all, so that check_targets reports where each is hidden and why.
    return kept or candidates
