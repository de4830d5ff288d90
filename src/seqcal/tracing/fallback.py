"""Layer-by-layer capture: the fallback when tracing fails but the targets form a simple chain.

The forward is run eagerly once per batch up to the first target (a pre-hook captures its inputs and stops
the forward); from there each target is called with the previous target's output and the *same* other
arguments. That is only right when the model really is such a chain, so we check it on the first batch
with a full eager forward before relying on it, and refuse otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from seqcal.tracing import TraceResult

logger = logging.getLogger("seqcal")


class _Stop(Exception):
    """Raised by the capture hook to end the forward once the first target's inputs are known."""


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b or (type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b)


def _hidden(output: Any) -> Any:
    return output[0] if isinstance(output, (tuple, list)) else output


def check_chain(model: torch.nn.Module, targets: Sequence[str], batch: Mapping[str, Any]) -> str | None:
    """None if ``targets`` form a chain on ``batch`` (each one's input is the previous output, same other
    arguments), else why not."""
    calls: dict[str, tuple[tuple, dict, Any]] = {}
    handles = []
    try:
        for name in targets:

            def hook(module: torch.nn.Module, args: tuple, kwargs: dict, out: Any, name: str = name) -> None:
                calls[name] = (args, kwargs, out)

            handles.append(model.get_submodule(name).register_forward_hook(hook, with_kwargs=True))
        with torch.no_grad():
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    missing = [t for t in targets if t not in calls]
    if missing:
        return f"targets never called by the forward: {missing[:3]}"
    for prev, cur in zip(targets, targets[1:]):
        args, kwargs, _ = calls[cur]
        prev_args, prev_kwargs, prev_out = calls[prev]
        if not args or not _same(args[0], _hidden(prev_out)):
            return f"the input of {cur} is not the output of {prev}"
        if (
            not _same(args[1:], prev_args[1:])
            or kwargs.keys() != prev_kwargs.keys()
            or not all(_same(kwargs[k], prev_kwargs[k]) for k in kwargs)
        ):
            return f"{cur} gets other arguments than {prev} (e.g. per-layer masks)"
    return None


def capture_first_inputs(model: torch.nn.Module, first: str, batch: Mapping[str, Any]) -> tuple[tuple, dict]:
    """The arguments the forward passes to the first target on ``batch`` (the rest of the forward is skipped)."""
    captured: list[tuple[tuple, dict]] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        captured.append((args, kwargs))
        raise _Stop

    handle = model.get_submodule(first).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**batch)
    except _Stop:
        pass
    finally:
        handle.remove()
    return captured[0]


def chain_graph(targets: Sequence[str], example: tuple[tuple, dict]) -> TraceResult:
    """A graph calling the targets one after another, fed with captured inputs (placeholders ``arg_i``,
    ``kw_<name>``); what the captured inputs hold is decided per batch, at run time."""
    args, kwargs = example
    graph = fx.Graph()
    arg_nodes = [graph.placeholder(f"arg_{i}") for i in range(len(args))]
    kw_nodes = {k: graph.placeholder(f"kw_{k}") for k in kwargs}
    hidden: Any = arg_nodes[0]
    for name in targets:
        out = graph.call_module(name, (hidden, *arg_nodes[1:]), dict(kw_nodes))
        hidden = graph.call_function(_hidden, (out,))
    graph.output(hidden)
    names = [f"arg_{i}" for i in range(len(args))] + [f"kw_{k}" for k in kwargs]
    return TraceResult(graph=graph, targets=list(targets), input_names=names, constants={})


def chain_batches(
    model: torch.nn.Module, first: str, batches: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Each batch turned into the first target's captured inputs, keyed like ``chain_graph``'s placeholders."""
    out = []
    for batch in batches:
        args, kwargs = capture_first_inputs(model, first, batch)
        row = {f"arg_{i}": a for i, a in enumerate(args)}
        row.update({f"kw_{k}": v for k, v in kwargs.items()})
        if "attention_mask" in batch:
            row["attention_mask"] = batch["attention_mask"]  # for the modifiers' token mask only
        out.append(row)
    return out
