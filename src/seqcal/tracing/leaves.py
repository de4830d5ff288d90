"""Which modules tracing goes *into* (``trace_into``) and which stay one ``call_module`` node (leaves).

By default only the forwards between the root and the sequential targets are traced; every other module is a
leaf. ``trace_into`` opens more of them: named classes / ``re:`` patterns, or ``"all"`` (optionally limited
to ``depth`` module levels below the traced scaffold). Leaf primitives (torch.nn's own modules: Linear,
Embedding, norms, dropout, activations ...) stay leaves even then, so quantization targets remain visible as
modules; ``leaf_modules`` keeps the modules it names (and everything inside them) opaque.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from seqcal.tracing.targets import matches

ALL = "all"
TraceInto = str | Sequence[str] | None


def is_leaf_primitive(module: torch.nn.Module) -> bool:
    """torch.nn's own modules (as torch.fx's default leaves), except the Sequential container."""
    kind = type(module).__module__
    return kind.startswith(("torch.nn", "torch.ao.nn")) and not isinstance(module, torch.nn.Sequential)


def normalize_trace_into(trace_into: TraceInto) -> list[str]:
    """``"all"``, a pattern, or a list of them -> a list of patterns (``["all"]`` for all).

    Raises:
        ValueError: not a string or a list of strings.
    """
    if trace_into is None:
        return []
    patterns = [trace_into] if isinstance(trace_into, str) else trace_into
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(
            f"trace_into={trace_into!r} is not valid; give 'all', a module class name, an 're:' name "
            "pattern, or a list of them"
        )
    return [ALL] if ALL in patterns else list(patterns)


def _depth_below(name: str, scaffold: set[str]) -> int:
    """Module levels between ``name`` and its nearest traced-through ancestor (the root counts)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if ".".join(parts[:i]) in scaffold:
            return len(parts) - i
    return len(parts)


def resolve_trace_into(
    model: torch.nn.Module,
    trace_into: TraceInto,
    holders: set[int],
    user_leaf: Callable[[torch.nn.Module, str], bool],
    depth: int | None = None,
) -> set[int]:
    """Ids of the modules to trace into: those ``trace_into`` names, plus the ancestors that lead to them.

    Args:
        model: the root module.
        trace_into: ``"all"``, class names or ``re:`` patterns on qualified names (None: nothing more).
        holders: ids of the modules traced through anyway (they contain sequential targets).
        user_leaf: the ``leaf_modules`` predicate; a leaf and everything inside it stays closed.
        depth: with it, only modules at most this many levels below the traced scaffold are opened.

    Returns:
        Ids of the modules whose forwards are traced (holders excluded: they are traced anyway).

    Raises:
        ValueError: a pattern matches no module, or only torch.nn leaf primitives; a bad depth.

    Example:
        >>> opened = resolve_trace_into(model, ["LlamaAttention"], holders, lambda m, n: False)  # doctest: +SKIP
    """
    patterns = normalize_trace_into(trace_into)
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise ValueError(f"trace_depth={depth!r} must be an int >= 1 (module levels below the traced layers)")
    if not patterns:
        if depth is not None:
            raise ValueError(
                f"trace_depth={depth} needs trace_into ('all' or module classes / 're:' patterns)"
            )
        return set()
    named = dict(model.named_modules())
    _check_patterns(named, patterns)
    scaffold = {n for n, m in named.items() if id(m) in holders or not n}
    closed = [n for n, m in named.items() if n and id(m) not in holders and user_leaf(m, n)]
    opened: set[int] = set()
    for name, module in named.items():
        if not name or id(module) in holders or is_leaf_primitive(module):
            continue
        if any(name == c or name.startswith(c + ".") for c in closed):
            continue
        if depth is not None and _depth_below(name, scaffold) > depth:
            continue
        if patterns != [ALL] and not matches(module, name, patterns):
            continue
        path = _path_to(named, name, scaffold)
        if path is not None:
            opened.update(id(named[p]) for p in path)
    return opened


def _path_to(named: dict[str, torch.nn.Module], name: str, scaffold: set[str]) -> list[str] | None:
    """``name`` and its ancestors below the scaffold, or None when a leaf primitive lies on the way."""
    parts = name.split(".")
    path = []
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in scaffold:
            break
        module = named[prefix]
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue  # containers are not called; their members are
        if is_leaf_primitive(module):
            return None
        path.append(prefix)
    return path


def _check_patterns(named: dict[str, torch.nn.Module], patterns: list[str]) -> None:
    if patterns == [ALL]:
        return
    for pattern in patterns:
        hits = [m for n, m in named.items() if n and matches(m, n, [pattern])]
        if hits and not all(is_leaf_primitive(m) for m in hits):
            continue
        custom = sorted({type(m).__name__ for m in named.values() if not is_leaf_primitive(m)})
        what = "matches only torch.nn modules, which always stay one node" if hits else "matches no module"
        raise ValueError(
            f"trace_into pattern {pattern!r} {what} of {type(named['']).__name__}; use 'all', an 're:' name "
            f"pattern, or one of the model's classes: {', '.join(custom[:12])}"
        )
