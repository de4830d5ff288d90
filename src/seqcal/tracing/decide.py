"""Guarded decisions: a branch that reaches a target and tests a runtime value, decided on the trace sample.

An ``if`` that calls a target in its body, or that ``continue``s / ``break``s / ``return``s past one, cannot be
made opaque without hiding the target. When its test depends on a runtime value (``seq_len > chunk``, whether
a cache holds an entry, ``x is None`` for a computed ``x``), the tracer evaluates that value on the trace
sample (the nodes it depends on, with the model's real weights), takes the branch the sample takes, and puts
a *guard* node in the graph. At execution time the guard recomputes the test and raises ``GuardError`` if a
batch would take the other branch: the partition is never silently wrong, it refuses the batch instead.

Decisions are a last resort: statements that do not reach a target are made opaque instead, as before
(DESIGN invariant 3), and a decision is tried only after the statement failed to trace symbolically.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import logging
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import fx
from torch.fx import _symbolic_trace
from torch.fx.proxy import Proxy, TraceError

from seqcal.errors import SeqcalError
from seqcal.tracing.runner import GraphRunner

logger = logging.getLogger("seqcal")


class GuardError(SeqcalError, RuntimeError):
    """A batch takes another branch than the trace sample took at a guarded decision."""


class Guard:
    """``call_function`` target checking at run time that a decision taken at trace time still holds."""

    def __init__(self, where: str, source: str, expected: bool, kind: str = "bool") -> None:
        self.where = where
        self.source = source
        self.expected = expected
        self.kind = kind  # "bool": bool(value); "is": value is other; "is not": value is not other
        self.__name__ = self.__qualname__ = "seqcal_guard"
        self.__module__ = "seqcal.guard"

    def __call__(self, value: Any, other: Any = None) -> None:
        got = bool(value) if self.kind == "bool" else (value is other) == (self.kind == "is")
        if got != self.expected:
            raise GuardError(
                f"at {self.where} the graph was traced with `{self.source}` deciding {self.expected}, but this "
                f"batch decides {got}; trace on a sample shaped like this batch (same inputs given, same length "
                "range), or run without tracing: pipeline='basic'"
            )

    def __repr__(self) -> str:
        return f"<guard {self.where}: {self.expected}>"


@contextlib.contextmanager
def _untraced_modules() -> Iterator[None]:
    """Module calls run eagerly again: while tracing, fx routes every ``Module.__call__`` to the tracer."""
    patched = torch.nn.Module.__call__, torch.nn.Module.__getattr__
    torch.nn.Module.__call__ = _symbolic_trace._orig_module_call  # type: ignore[method-assign]
    torch.nn.Module.__getattr__ = _symbolic_trace._orig_module_getattr  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.__call__, torch.nn.Module.__getattr__ = patched  # type: ignore[method-assign]


def _statement_head(file: str, line: int) -> str:
    """The statement starting at ``line`` up to its first body (``if (a\n and b):`` spans lines), on one line."""
    text = ""
    for number in range(line, line + 12):
        text += linecache.getline(file, number).strip() + " "
        for candidate in (text, text + "\n    pass"):
            try:
                ast.parse(candidate.strip())
            except SyntaxError:
                continue
            return " ".join(text.split())
    return linecache.getline(file, line).strip()


class Concrete:
    """Values of graph nodes on the trace sample, computed on demand (only the nodes a decision needs)."""

    def __init__(self, root: torch.nn.Module, tensors: dict[str, Any]) -> None:
        self.root = root
        self.tensors = tensors
        self.env: dict[str, Any] = {}
        self.done: set[fx.Node] = set()

    def value(self, node: fx.Node) -> Any:
        """The value of ``node`` for the trace sample.

        Raises:
            Exception: whatever computing it raises (weights on meta, for instance).
        """
        order: list[fx.Node] = []
        stack: list[tuple[fx.Node, bool]] = [(node, False)]
        seen: set[fx.Node] = set()
        while stack:  # post-order over the inputs not computed yet
            current, expanded = stack.pop()
            if expanded:
                order.append(current)
                continue
            if current in seen or current in self.done:
                continue
            seen.add(current)
            stack.append((current, True))
            stack.extend((n, False) for n in current.all_input_nodes if n not in self.done)
        runnable = []
        for n in order:
            if n.op == "placeholder":
                self.env[n.name] = self.tensors[str(n.target)]
            elif n.op != "get_attr":
                runnable.append(n)
        with torch.no_grad(), _untraced_modules():
            GraphRunner(self.root).run(SimpleNamespace(index=-1, nodes=runnable), self.env)  # type: ignore[arg-type]
        self.done.update(order)
        if node.op == "get_attr":
            return GraphRunner(self.root).attr(str(node.target))
        return self.env[node.name]


class DecidingTracer(fx.Tracer):
    """The decisions of ``SeqTracer``: inside ``__seqcal_decide`` / ``__seqcal_deciding`` (statements the rewriter
    marked), ``bool()`` and ``is`` of a runtime value take the sample's outcome and leave a ``Guard`` node."""

    concrete: Concrete | None
    _deciding: list[tuple[str, int, int]]

    def _decide(self, sid: tuple[str, int, int], test: Callable[[], Any]) -> bool:
        self._deciding.append(sid)
        try:
            value = test()
            return self._decided(value) if isinstance(value, Proxy) else bool(value)
        finally:
            self._deciding.pop()

    @contextlib.contextmanager
    def _deciding_in(self, sid: tuple[str, int, int]) -> Iterator[None]:
        self._deciding.append(sid)
        try:
            yield
        finally:
            self._deciding.pop()

    def to_bool(self, obj: Proxy) -> bool:
        return self._decided(obj) if self._deciding else super().to_bool(obj)

    def _decided(self, proxy: Proxy, negate: bool | None = None, other: Any = None) -> bool:
        """The sample's outcome of ``bool(proxy)`` (or of ``proxy is [not] other``), guarded at run time."""
        assert self.concrete is not None and self._deciding
        try:
            value = self.concrete.value(proxy.node)
        except Exception as exc:  # noqa: BLE001 - e.g. weights on meta: the statement is reported as before
            raise TraceError(
                f"cannot evaluate {proxy.node.format_node()} on the sample to decide: {exc!r}"
            ) from exc
        file, line, _ = self._deciding[-1]
        where, source = f"{file}:{line}", _statement_head(file, line)
        if negate is None:
            result = bool(value)
            self.create_proxy("call_function", Guard(where, source, result), (proxy,), {})
        else:
            result = (value is not other) if negate else (value is other)
            kind = "is not" if negate else "is"
            self.create_proxy("call_function", Guard(where, source, result, kind), (proxy, other), {})
        logger.info(
            "seqcal: %s decided %s on the trace sample, guarded at run time (`%s`)", where, result, source
        )
        return result
