"""Sequential targets: matching user patterns, inferring the default, and checking invariant 2."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import fx

from seqcal.tracing.diagnostics import Problem, TracingError
from seqcal.tracing.values import SCOPE, OpaqueCall

# A list of layers is a sequential-target candidate when it holds at least this share of the parameters:
# that separates decoder/encoder stacks from per-layer norms or small heads kept in module lists.
MIN_STACK_SHARE = 0.10


def matches(module: torch.nn.Module, name: str, patterns: Sequence[str]) -> bool:
    """Whether ``module`` (qualified ``name``) matches a class name or an ``re:`` name pattern."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif type(module).__name__ == pattern:
            return True
    return False


def match_targets(model: torch.nn.Module, patterns: Sequence[str]) -> dict[int, str]:
    """Modules matching ``patterns``, id -> qualified name, in module order.

    Raises:
        TracingError: nothing matches (the message lists the layer classes that exist), or matches nest.
    """
    found = {id(m): n for n, m in model.named_modules() if n and matches(m, n, patterns)}
    if not found:
        classes = sorted({type(m).__name__ for m in _stack_members(model)})
        raise TracingError(
            [
                Problem(
                    where=type(model).__name__,
                    what=f"no module matches sequential_targets={list(patterns)}",
                    fix=f"use a class name of the model's layers, e.g. one of {classes}, or an 're:' name pattern",
                )
            ]
        )
    names = sorted(found.values())
    for outer, inner in zip(names, names[1:]):
        if inner.startswith(outer + "."):
            raise TracingError(
                [
                    Problem(
                        where=inner,
                        what=f"target {inner!r} is nested inside target {outer!r}; a target runs as one node",
                        fix="choose targets that do not contain each other",
                    )
                ]
            )
    return found


def _param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _stack_members(model: torch.nn.Module) -> Iterable[torch.nn.Module]:
    for container in model.modules():
        if isinstance(container, (torch.nn.ModuleList, torch.nn.ModuleDict)) and len(container) >= 1:
            for child in container.children():
                if not type(child).__module__.startswith("torch."):
                    yield child


def _language_scope(model: torch.nn.Module) -> str | None:
    """Qualified name of the text model inside a multimodal model (its config is the text config)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return None
    text = config.get_text_config()
    if text is config:
        return None
    for name, module in model.named_modules():
        cfg = getattr(module, "config", None)
        if name and (cfg is text or (type(cfg) is type(text) and cfg.to_dict() == text.to_dict())):
            return name
    return None


def infer_candidates(model: torch.nn.Module) -> dict[int, str]:
    """Default target candidates: the stacked layers the model declares, else the largest stacks.

    A model declares its layer classes in ``_no_split_modules`` (transformers' "keep this block on one
    device"); the members of module lists holding those classes are the candidates. Models that declare none
    (or none in a list) fall back to the outermost layers of stacks holding >= 10% of the parameters; that
    share is taken of the parameters outside embedding tables, so a large vocabulary does not hide the layers.
    For a multimodal model, only the text model's stacks (vision towers are left alone unless asked).
    The tracer then keeps the candidates that the forward actually calls (see ``check_targets``).

    Args:
        model: the model to quantize.

    Returns:
        Candidate modules, id -> qualified name, outermost only.

    Example:
        >>> list(infer_candidates(LlamaForCausalLM(config)).values())[:2]  # doctest: +SKIP
        ['model.layers.0', 'model.layers.1']
    """
    stacks = _stacks(model)
    declared = _declared_layer_classes(model)
    # A stack with one declared member is taken whole: hybrid models alternate layer classes in one list.
    found = {id(m): n for members in stacks if any(type(m).__name__ in declared for _, m in members)
             for n, m in members}  # fmt: skip
    if not found:
        # Embedding tables are left out of the total: a large vocabulary (or RoCBert's shape and
        # pronunciation tables) would otherwise hide the layers of a small model.
        embeddings = sum(_param_count(m) for m in model.modules() if isinstance(m, torch.nn.Embedding))
        total = max(_param_count(model) - embeddings, 1)
        for members in stacks:
            if sum(_param_count(m) for _, m in members) >= MIN_STACK_SHARE * total:
                found.update({id(m): n for n, m in members})
    names = sorted(found.values())
    nested = {inner for outer in names for inner in names if inner.startswith(outer + ".")}
    return {i: n for i, n in found.items() if n not in nested}


def _declared_layer_classes(model: torch.nn.Module) -> set[str]:
    """Class names in the ``_no_split_modules`` of the model and of the pretrained models inside it."""
    declared: set[str] = set()
    for module in model.modules():
        declared.update(getattr(module, "_no_split_modules", None) or ())
    return declared


def _stacks(model: torch.nn.Module) -> list[list[tuple[str, torch.nn.Module]]]:
    """The members (qualified name, module) of every non-empty module list or dict, in the text model."""
    scope = _language_scope(model)
    stacks = []
    for name, container in model.named_modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue
        if scope is not None and not name.startswith(scope + "."):
            continue
        members = [(f"{name}.{k}", m) for k, m in container.named_children()]
        members = [(n, m) for n, m in members if not type(m).__module__.startswith("torch.")]
        if members:
            stacks.append(members)
    return stacks


def holders_of(model: torch.nn.Module, targets: dict[int, str]) -> set[int]:
    """Ids of the modules that contain a target (the ones tracing goes through)."""
    by_name = dict(model.named_modules())
    holders: set[int] = set()
    for name in targets.values():
        parts = name.split(".")
        for i in range(len(parts)):
            holders.add(id(by_name[".".join(parts[:i])]))
    return holders


def called_targets(
    graph: fx.Graph, targets: dict[int, str], entered: Mapping[str, int] | None = None
) -> dict[str, int]:
    """How often each target's name appears as a call_module node or was traced into (``entered``)."""
    names = set(targets.values())
    counts: dict[str, int] = {name: (entered or {}).get(name, 0) for name in names}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in names:
            counts[node.target] += 1
    return counts


def _empty_regions(graph: fx.Graph, names: set[str]) -> set[str]:
    """Targets traced into that produced no node of their own (nothing to cut after)."""
    seen = {s for n in graph.nodes if (s := n.meta.get(SCOPE))}
    return {t for t in names if not any(s == t or s.startswith(t + ".") for s in seen)}


def check_targets(
    graph: fx.Graph,
    model: torch.nn.Module,
    targets: dict[int, str],
    failures: dict[tuple[str, int, int], str] | None = None,
    entered: Mapping[str, int] | None = None,
) -> list[Problem]:
    """DESIGN invariant 2: every target instance is exactly one call_module node, or, when ``trace_into``
    opened it, exactly one traced region (``entered``: how often the tracer went into each module).
    Returns the violations.

    ``failures`` (statement -> error) explains why code hiding a target was made opaque.
    """
    problems: list[Problem] = []
    hidden_by: dict[str, list[str]] = {}  # one problem per hiding site, listing its targets
    opened = {t for t in targets.values() if (entered or {}).get(t)}
    for name in sorted(_empty_regions(graph, opened)):
        problems.append(
            Problem(
                where=name,
                what=f"target {name} computes nothing of its own once traced into, so it has no subgraph",
                fix=f"keep it one node: leaf_modules=[{type(model.get_submodule(name)).__name__!r}]",
            )
        )
    counts = called_targets(graph, targets, entered)
    # the classes of the targets the forward does call: a layer kind it skips (Mllama's cross-attention layers
    # without images) is left out by targeting these
    running = sorted({type(model.get_submodule(n)).__name__ for n, c in counts.items() if c > 0})
    for name, count in counts.items():
        module = model.get_submodule(name)
        if count == 1:
            continue
        if count == 0:
            site = _hiding_site(graph, model, name)
            where = f"{site.filename}:{site.lineno} in {site.owner}" if site else name
            what = f"target {name} ({type(module).__name__}) is not called by traced code" + (
                f"; it runs inside opaque code: `{site.source}`" if site else "; the forward never calls it"
            )
            causes = [
                f"{err} (line {line})"
                for (file, line, _), err in (failures or {}).items()
                if site and file == site.filename and site.lineno <= line <= site.end_lineno
            ]
            if causes:
                what += "; that code was made opaque because tracing it failed: " + "; ".join(causes)
            fix = (
                "if that code must stay opaque, choose sequential_targets outside it; if the function it calls "
                "reaches the target through an unusual path, report it (with this message)"
                if site
                else f"exclude it: sequential_targets=['re:...'] matching only the called layers, or ignore={name!r}"
            )
            if running and type(module).__name__ not in running:
                fix = f"target only the layers that run: sequential_targets={running!r}; or " + fix
            if where in hidden_by:
                hidden_by[where].append(name)
                continue
            hidden_by[where] = [name]
            problems.append(Problem(where=where, what=what, fix=fix, source=site.source if site else ""))
        else:
            problems.append(
                Problem(
                    where=name,
                    what=f"target {name} ({type(module).__name__}) is called {count} times in one forward (a layer "
                    "shared, or looped over as in recurrent-depth models): a sequential run calibrates each target "
                    "once, in forward order, from the one input the subgraph before it gives",
                    fix="pass pipeline='basic' (the whole model in one forward, each Linear's statistics over all its "
                    "calls), or choose a target class whose instances are each called once",
                )
            )
    return [_with_count(p, hidden_by.get(p.where, [])) for p in problems]


def _with_count(problem: Problem, names: list[str]) -> Problem:
    if len(names) <= 1:
        return problem
    what = problem.what.replace(f"target {names[0]}", f"{len(names)} targets ({names[0]}, ...)", 1)
    return Problem(where=problem.where, what=what, fix=problem.fix, source=problem.source)


def _hiding_site(graph: fx.Graph, model: torch.nn.Module, name: str):  # noqa: ANN202 - OpaqueSite | None
    """The opaque node whose code most likely calls the hidden target ``name``."""
    modules = dict(model.named_modules())
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, OpaqueCall):
            call = node.target
            prefix = next((n for n, m in modules.items() if m is call.module), None)
            if prefix is None:
                continue
            rel = name[len(prefix) + 1 :] if prefix else name
            if (not prefix or name.startswith(prefix + ".")) and rel.split(".")[0] in call.site.touched:
                return call.site
    for node in graph.nodes:  # a method of an ancestor that is run opaquely, e.g. get_image_features()
        if node.op == "call_function" and isinstance(node.target, OpaqueCall):
            call = node.target
            prefix = next((n for n, m in modules.items() if m is call.module), None)
            is_method = any(
                not isinstance(getattr(call.module, a, None), torch.nn.Module) for a in call.site.touched
            )
            if prefix is not None and (not prefix or name.startswith(prefix + ".")) and is_method:
                return call.site
    return None
