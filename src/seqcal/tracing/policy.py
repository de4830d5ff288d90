"""What one trace attempt is given and what it signals back: which modules stay nodes (``LeafPolicy``), what
earlier attempts learned (``TraceState``: statements forced opaque, decided, refused modules), and the two
signals that end an attempt (``StatementFailed``, ``ModuleRefused``); ``seqcal.tracing.retries`` loops on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from seqcal.tracing.diagnostics import Problem
from seqcal.tracing.sources import SourceFunction, StmtId


class StatementFailed(Exception):
    """Internal: a statement tried symbolically failed; it is retried as an opaque node."""

    def __init__(self, sid: StmtId, cause: BaseException) -> None:
        super().__init__(f"statement at {sid} failed: {cause!r}")
        self.sid = sid
        self.cause = cause


class ModuleRefused(Exception):
    """Internal: tracing into a module opened by ``trace_into`` failed; it is retried as a leaf."""

    def __init__(self, name: str, module: torch.nn.Module, cause: BaseException) -> None:
        super().__init__(f"tracing into {name} failed: {cause!r}")
        self.name = name
        self.module = module
        self.cause = cause


@dataclass
class LeafPolicy:
    """Which modules are targets, which hold targets, and which are traced into (``trace_into``).

    A module is traced when it holds a target or is opened (and its class was not refused on an earlier
    attempt); every other module, targets included unless opened, is a leaf.
    """

    targets: dict[int, str]  # id(module) -> qualified name
    holders: set[int]  # ids of modules that contain a target (not targets themselves)
    user_leaf: Callable[[torch.nn.Module, str], bool] = lambda m, name: False
    opened: set[int] = field(default_factory=set)  # ids of modules traced into although they hold no target
    refused: set[type] = field(default_factory=set)  # opened classes whose forward could not be traced

    def is_leaf(self, module: torch.nn.Module, name: str) -> bool:
        if id(module) in self.holders:
            return False
        return id(module) not in self.opened or type(module) in self.refused

    def is_opened(self, module: torch.nn.Module) -> bool:
        """Traced because ``trace_into`` asked for it (not because it holds a target)."""
        return id(module) in self.opened and type(module) not in self.refused


@dataclass
class TraceState:
    """What survives between retraces: statements to make opaque and why they failed."""

    force_opaque: set[StmtId] = field(default_factory=set)
    failures: dict[StmtId, str] = field(default_factory=dict)
    refusals: list[Problem] = field(default_factory=list)  # opened modules kept as leaves, and why
    sources: dict[Any, SourceFunction] = field(default_factory=dict)  # parsed forwards (never edited)
    method_refs: dict[Any, set[str]] = field(default_factory=dict)  # method -> self attributes it reads
    decidable: set[StmtId] = field(default_factory=set)  # ``if`` statements that cannot be made opaque
    decide: set[StmtId] = field(default_factory=set)  # those decided on the sample, with a guard
