"""Smoothing mappings from the traced graph: which module produces the input of each group of Linears.

A *mapping* pairs a producer with the consumers that read its output directly: a norm (RMSNorm, LayerNorm)
before q/k/v or gate/up (kind ``"norm"``: scales fold into its weight and bias), or a Linear whose output
rows reach the next Linear through operations that act on each channel linearly (kind ``"linear"``:
v_proj -> attention -> o_proj, through transformers' KV-cache write (``seqcal.kv_writes``), and
up_proj -> act(gate) * up -> down_proj). Folding ``s`` into a mapping
(:func:`fold_scales`) divides the producer's output by ``s`` and multiplies the consumers' input columns by
``s``: the float model computes the same function, and the consumers now read ``X / s``.

Candidates that would change the model are skipped with a reason (logged, and returned by
:func:`derive_mappings`): a norm whose output does not scale with its weight (Gemma's ``x * (1 + w)``),
attention with grouped kv heads (v_proj narrower than o_proj's input), rotary embeddings, an activation
function or a residual add in between, or a producer output read by something other than the consumers.

Explicit mappings (a recipe's ``mappings``) override the graph: SmoothQuant's ``[[balance regexes],
smooth regex]`` pairs or AWQ's ``{smooth_layer, balance_layers}`` dicts (:func:`resolve_mappings`).

Example:
    >>> maps = resolve_mappings(model, subgraphs.traced.graph)  # doctest: +SKIP
    >>> maps[0]  # doctest: +SKIP
    Mapping(producer='model.layers.0.input_layernorm', consumers=('...q_proj', '...k_proj', '...v_proj'), kind='norm')
"""

from __future__ import annotations

import logging
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from seqcal.algorithms.smoothing import divide_producer, multiply_consumer
from seqcal.kv_writes import cache_write_input, kv_groups
from seqcal.records import Mapping as Mapping  # re-exported: defined beside Fold

logger = logging.getLogger("seqcal")

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


# --- explicit mappings ------------------------------------------------------------------------------------


def matches(pattern: str, name: str, module: torch.nn.Module) -> bool:
    """A recipe pattern against a module: ``re:`` regex (``re.match`` on the qualified name), exact name,
    or class name (llm-compressor's rule for mappings, targets and ignore)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or type(module).__name__ == pattern


def _pairs(explicit: Sequence[Any], who: str) -> list[tuple[list[str], str]]:
    """(balance regexes, smooth regex) from SmoothQuant's lists or AWQ's dicts."""
    out = []
    for entry in explicit:
        if isinstance(entry, dict) and "smooth_layer" in entry and "balance_layers" in entry:
            out.append((list(entry["balance_layers"]), str(entry["smooth_layer"])))
        elif isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str):
            balance = entry[0] if isinstance(entry[0], (list, tuple)) else [entry[0]]
            out.append(([str(b) for b in balance], entry[1]))
        else:
            raise ValueError(
                f"{who}: mapping {entry!r} is neither [[balance regexes], smooth regex] nor "
                "{smooth_layer: regex, balance_layers: [regexes]}; write it in one of those forms"
            )
    return out


def common_depth(a: str, b: str) -> int:
    """Number of leading dotted components ``a`` and ``b`` share (the scope rule of explicit mappings)."""
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n


def explicit_mappings(
    model: torch.nn.Module, explicit: Sequence[Any], who: str = "mappings"
) -> list[Mapping]:
    """Resolve a recipe's mappings against ``model``; each smooth match gets the balance matches of its scope.

    Raises:
        ValueError (one sentence): a regex that matches no module, a producer that is neither a norm nor a
            Linear, an offset norm, or consumers of different input widths.
    """
    named = list(model.named_modules())
    arch = type(model).__name__
    out = []
    for balance, smooth in _pairs(explicit, who):
        producers = [(n, m) for n, m in named if matches(smooth, n, m)]
        for pattern in [smooth, *balance]:
            if not any(matches(pattern, n, m) for n, m in named):
                raise ValueError(
                    f"{who}: {pattern!r} matches no module of {arch}; fix the regex (module names look like "
                    f"{named[-2][0]!r}) or leave mappings unset to derive them from the traced graph"
                )
        for pname, pmod in producers:
            consumers = []
            for pattern in balance:
                hits = [n for n, m in named if matches(pattern, n, m) and n != pname]
                best = max((common_depth(pname, n) for n in hits), default=0)
                consumers += [n for n in hits if common_depth(pname, n) == best and n not in consumers]
            out.append(_checked(model, pname, pmod, tuple(consumers), who))
    return out


def _checked(model: torch.nn.Module, pname: str, pmod: torch.nn.Module, consumers: tuple[str, ...],
             who: str) -> Mapping:  # fmt: skip
    arch = type(model).__name__
    widths = {c: model.get_submodule(c).weight.shape[-1] for c in consumers}
    if len(set(widths.values())) != 1:
        raise ValueError(
            f"{who}: the consumers of {pname} in {arch} read inputs of different widths ({widths}); one mapping "
            "must list Linears that read the same tensor, e.g. [q_proj, k_proj, v_proj] or [gate_proj, up_proj]"
        )
    if _is_norm(pmod):
        if reason := norm_fold_reason(pmod):
            raise ValueError(f"{who}: {pname} in {arch}: {reason}; remove this mapping")
        return Mapping(pname, consumers, "norm")
    if isinstance(pmod, torch.nn.Linear):
        return Mapping(pname, consumers, "linear")
    raise ValueError(
        f"{who}: smooth layer {pname} in {arch} is a {type(pmod).__name__}, neither a norm nor a Linear; "
        "point the smooth regex at the norm or Linear whose output the balance layers read"
    )


def resolve_mappings(
    model: torch.nn.Module,
    graph: fx.Graph | None,
    explicit: Sequence[Any] | None = None,
    who: str = "mappings",
) -> list[Mapping]:
    """The mappings to smooth: ``explicit`` ones when given, else those derived from ``graph`` (skips logged).

    Args:
        model: the model.
        graph: a traced graph with the Linears as call_module nodes (ignored when ``explicit`` is given).
        explicit: a recipe's mappings (SmoothQuant or AWQ format), or None.
        who: the modifier, for messages.

    Returns:
        The mappings, in graph (or recipe) order.

    Example:
        >>> resolve_mappings(model, None, [[["re:.*q_proj", "re:.*k_proj"], "re:.*input_layernorm"]])  # doctest: +SKIP
    """
    if explicit:
        return explicit_mappings(model, explicit, who)
    if graph is None:
        raise ValueError(f"{who}: without explicit mappings a traced graph is needed to derive them")
    mappings, skipped = derive_mappings(model, graph)
    for skip in skipped:
        logger.info("seqcal: %s: not smoothing %s: %s", who, ", ".join(skip.consumers), skip.reason)
    return mappings


# --- the fold ---------------------------------------------------------------------------------------------


def fold_scales(model: torch.nn.Module, mapping: Mapping, scales: torch.Tensor) -> None:
    """Divide the producer's output by ``scales`` and multiply the consumers' input columns by them.

    The float model's function is unchanged; the consumers now read ``X / scales``. Callers inside the
    pipeline use ``RunState.fold`` (which also records the fold so cached inputs and statistics follow).

    Args:
        model: the model (parameters on a real device).
        mapping: from :func:`resolve_mappings`.
        scales: ``s [in]`` positive, in the consumers' input width.

    Example:
        >>> fold_scales(model, Mapping("norm", ("fc1", "fc2"), "norm"), torch.full((64,), 2.0))  # doctest: +SKIP
    """
    producer = model.get_submodule(mapping.producer)
    bias = getattr(producer, "bias", None)
    # A fused Linear producer wider than the scales (qkv_proj -> o_proj) feeds the consumers from its last
    # rows (the v part): only those are divided.
    rows = (
        slice(producer.weight.shape[0] - scales.shape[0], None) if mapping.kind == "linear" else slice(None)
    )
    with torch.no_grad():
        weight, new_bias = divide_producer(
            producer.weight.data[rows], None if bias is None else bias.data[rows], scales
        )
        producer.weight.data[rows] = weight
        if new_bias is not None:
            producer.bias.data[rows] = new_bias
        for name in mapping.consumers:
            consumer = model.get_submodule(name)
            consumer.weight.data = multiply_consumer(consumer.weight.data, scales)
