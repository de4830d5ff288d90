"""Smoothing mappings derived from the traced graph: for each group of Linears reading one value, the module that
produces it (a norm, or a Linear through per-channel operations), or why there is none (``Skipped``).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from seqcal.mappings.kv_writes import cache_write_input, kv_groups
from seqcal.records import Mapping

KINDS = ("norm", "linear")


# Methods that move channels without mixing them (the last dim stays the channel dim or is split into heads
# in order): a per-channel scale passes through them.
_TRANSPARENT_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten", "to"}


_SHAPE_ONLY = {"shape", "size", "dim", "dtype", "device", "ndim"}


# Opaque statements that only reshape (HF attention's `attn_output.reshape(*input_shape, -1).contiguous()`)
_RESHAPE_SOURCE = re.compile(
    r"^[\w.]+\s*=\s*[\w.]+(\.(reshape|view|transpose|contiguous|flatten)\([^()]*\))+$"
)


@dataclass(frozen=True)
class Skipped:
    """A group of consumers with no usable producer, and why (for the log and the tests)."""

    consumers: tuple[str, ...]
    reason: str


def derive_mappings(model: torch.nn.Module, graph: fx.Graph) -> tuple[list[Mapping], list[Skipped]]:
    """Mappings of every group of Linears in ``graph`` (call_module nodes), and the groups skipped.

    Args:
        model: the traced model (``call_module`` targets are its qualified module names).
        graph: a torch.fx graph in which the Linears are ``call_module`` nodes (seqcal's trace with the
            Linears as targets, or ``torch.fx.symbolic_trace``).

    Returns:
        ``(mappings, skipped)`` in graph order.

    Example:
        >>> maps, skipped = derive_mappings(model, torch.fx.symbolic_trace(model).graph)  # doctest: +SKIP
    """
    modules = dict(model.named_modules())
    groups: dict[fx.Node, list[str]] = {}
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module" and isinstance(modules.get(str(node.target)), torch.nn.Linear):
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
            if node.args and isinstance(node.args[0], fx.Node):
                groups.setdefault(node.args[0], []).append(str(node.target))
    mappings, skipped = [], []
    for source, consumers in groups.items():
        found = _producer(source, tuple(consumers), modules, calls)
        (mappings if isinstance(found, Mapping) else skipped).append(found)
    return mappings, skipped


def _producer(source: fx.Node, consumers: tuple[str, ...], modules: dict, calls: dict) -> Mapping | Skipped:
    if any(calls[c] > 1 for c in consumers):
        return Skipped(consumers, "a consumer is called more than once per forward (shared weights)")
    if other := _other_readers(source, set(consumers)):
        return Skipped(consumers, f"its input is also read by {other} (not one of the consumers)")
    module = modules.get(str(source.target)) if source.op == "call_module" else None
    if module is not None and _is_norm(module):
        if _called_twice(source):
            return Skipped(consumers, f"norm {source.target} is called more than once per forward")
        reason = norm_fold_reason(module)
        return Skipped(consumers, reason) if reason else Mapping(str(source.target), consumers, "norm")
    path = _walk(source, modules)
    if isinstance(path, str):
        return Skipped(consumers, path)
    producer, through_attention = path
    width = modules[producer].out_features
    needs = {modules[c].in_features for c in consumers}
    if needs != {width}:
        what = "grouped kv heads (repeat_kv): " if through_attention else ""
        return Skipped(
            consumers, f"{what}{producer} has {width} outputs but the consumers read {sorted(needs)}"
        )
    return Mapping(producer, consumers, "linear")


def _called_twice(node: fx.Node) -> bool:
    graph = node.graph
    return sum(1 for n in graph.nodes if n.op == "call_module" and n.target == node.target) > 1


def _other_readers(node: fx.Node, allowed: set[str]) -> str | None:
    """A user of ``node`` that is neither an allowed call_module nor a shape query, else None."""
    for user in node.users:
        if user.op == "call_module" and str(user.target) in allowed:
            continue
        if user.op == "call_function" and user.target is getattr and user.args[1] in _SHAPE_ONLY:
            continue
        if user.op == "call_method" and user.target in ("size", "dim"):
            continue
        return f"{user.op} {getattr(user.target, '__name__', user.target)} ({user.name})"
    return None


def _is_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return "norm" in type(module).__name__.lower() and isinstance(weight, torch.Tensor) and weight.dim() == 1


def norm_fold_reason(module: torch.nn.Module) -> str | None:
    """Why dividing this norm's weight (and bias) by ``s`` would not divide its output by ``s``, or None.

    Checked numerically on the module's own forward with probe parameters (its real weights may be offloaded
    to meta): an offset norm such as Gemma's ``x * (1 + w)`` fails.
    """
    weight = module.weight
    d = weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, d, generator=gen)
    s = torch.rand(d, generator=gen) + 0.5
    params = {name: torch.rand(p.shape, generator=gen) + 0.5 for name, p in module.named_parameters()}
    probe = dict(params)
    probe["weight"] = params["weight"] / s
    if "bias" in params:
        probe["bias"] = params["bias"] / s
    buffers = {n: b.float() for n, b in module.named_buffers() if b.device.type != "meta"}
    try:
        with torch.no_grad():
            y = torch.func.functional_call(module, {**buffers, **params}, (x,))
            y_s = torch.func.functional_call(module, {**buffers, **probe}, (x,))
    except Exception as exc:  # noqa: BLE001 - any failure means the norm cannot be checked, hence not folded
        return f"norm {type(module).__name__} could not be checked ({type(exc).__name__}: {exc})"
    if not isinstance(y, torch.Tensor) or not torch.allclose(y_s * s, y, rtol=1e-4, atol=1e-5):
        return (
            f"offset norm: {type(module).__name__}'s output does not scale with its weight "
            "(e.g. Gemma's x * (1 + w)), so scales cannot fold into it"
        )
    return None


def _walk(node: fx.Node, modules: dict) -> tuple[str, bool] | str:
    """Follow ``node`` back through per-channel-linear operations to one Linear: (its name, via attention),
    or the reason the algebra breaks."""
    attention = False
    while True:
        tuple_part = False  # a getitem of a tuple: siblings read its other parts
        if node.op == "call_module":
            module = modules.get(str(node.target))
            if isinstance(module, torch.nn.Linear):
                return str(node.target), attention
            if isinstance(module, (torch.nn.Dropout, torch.nn.Identity)):
                node = node.args[0]
                continue
            kind = "a norm" if module is not None and _is_norm(module) else "module"
            return f"{kind} {node.target} ({type(module).__name__}) lies between (not linear per channel)"
        name = getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else ""
        if node.op == "call_method" and node.target in _TRANSPARENT_METHODS:
            nxt: Any = node.args[0]
        elif node.op == "call_function" and node.target is operator.getitem:
            written = cache_write_input(node)  # the keys or values a KV-cache write hands back
            nxt, tuple_part = (written, False) if written is not None else (node.args[0], True)
        elif node.op == "call_function" and (site := getattr(node.target, "site", None)) is not None:
            if not _RESHAPE_SOURCE.match(getattr(site, "source", "")):
                return f"opaque code `{getattr(site, 'source', '?')}` lies between (not known to be linear per channel)"
            tensors = [a for a in node.args if isinstance(a, fx.Node) and not _is_shape(a)]
            nxt = tensors[0] if len(tensors) == 1 else None
        elif node.op == "call_function" and "rotary" in name.lower():
            return f"rotary embedding ({name}) lies between"
        elif node.op == "call_function" and "attention" in name.lower():
            at = (
                2 if node.target is torch.nn.functional.scaled_dot_product_attention else 3
            )  # HF: (module, q, k, v)
            nxt, attention = node.kwargs.get("value", node.args[at] if len(node.args) > at else None), True
            if at == 3 and (groups := kv_groups(node.args[0], modules)) != 1:
                return f"grouped kv heads (repeat_kv): {groups} query heads read each kv head"
        elif node.op == "call_function" and node.target in (operator.mul, torch.mul):
            return _through_product(node, modules)
        elif node.op == "call_function" and node.target in (operator.add, torch.add, operator.iadd):
            return f"a residual add ({node.name}) lies between"
        else:
            return f"{node.op} {name or node.target} ({node.name}) lies between (not known to be linear per channel)"
        if not isinstance(nxt, fx.Node):
            return f"{node.name} has no tensor input to follow"
        if not tuple_part and len([u for u in nxt.users if not _shape_query(u)]) > 1:
            return f"the value {nxt.name} is also read elsewhere (a branch between producer and consumer)"
        node = nxt


def _is_shape(node: fx.Node) -> bool:
    """A shape value (``x.shape[:-1]``), not a tensor: a reshape's argument."""
    while (
        node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node)
    ):
        node = node.args[0]
    return _shape_query(node)


def _shape_query(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is getattr and node.args[1] in _SHAPE_ONLY


def _through_product(node: fx.Node, modules: dict) -> tuple[str, bool] | str:
    """``a * b`` is linear in one factor when the other does not depend on it: act(gate) * up -> up."""
    found, reasons = [], []
    for arg in node.args[:2]:
        if not isinstance(arg, fx.Node):
            continue
        got = _walk(arg, modules)
        (found if isinstance(got, tuple) else reasons).append(got)
    if len(found) == 1 and not _depends_on(node.args, found[0][0]):
        return found[0]
    if found:
        return f"both factors of {node.name} depend on a Linear ({', '.join(f[0] for f in found)})"
    return f"no factor of {node.name} comes linearly from a Linear ({'; '.join(reasons)})"


def _depends_on(args: Sequence[Any], producer: str) -> bool:
    """Whether both factors read ``producer`` (then the product is not linear in it)."""
    hits = 0
    for arg in args[:2]:
        seen, stack = set(), [arg]
        while stack:
            n = stack.pop()
            if not isinstance(n, fx.Node) or n in seen:
                continue
            seen.add(n)
            if n.op == "call_module" and str(n.target) == producer:
                hits += 1
                break
            stack.extend(n.all_input_nodes)
    return hits > 1
