"""What the source rewriter takes and gives: a forward's source (``SourceFunction``), which statements to keep
traced or make opaque (``RewritePlan``), the rewritten code (``Rewritten``), and each place code was made
opaque, with why (``OpaqueSite``). ``seqcal.tracing.rewrite`` does the rewriting.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

StmtId = tuple[str, int, int]  # (file, line, column) of a statement: stable across rewrites


@dataclass(frozen=True)
class OpaqueSite:
    """One group of statements run opaquely at execution time."""

    site_id: str
    filename: str
    lineno: int
    end_lineno: int
    owner: str  # qualified name of the function the statements come from
    reason: str  # why it is opaque
    source: str  # first line of the statements, for reports
    touched: tuple[str, ...]  # attributes of ``self`` the statements read (submodules used at run time)
    # The helper's argument names (the call_function node's args, in order) and the names it returns (item i
    # of its result), and the statements' code: what reads the graph through the site (seqcal.mappings).
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    code: str = ""


@dataclass
class SourceFunction:
    """A function's parsed source with where it lives, so rewritten code keeps its file and lines."""

    func: Callable[..., Any]
    tree: ast.FunctionDef
    filename: str
    qualname: str

    @classmethod
    def of(cls, func: Callable[..., Any]) -> SourceFunction:
        inner = inspect.unwrap(func)
        lines, start = inspect.getsourcelines(inner)
        tree = ast.parse(textwrap.dedent("".join(lines)))
        fdef = tree.body[0]
        if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise TypeError(f"{inner.__qualname__} is not a plain function definition")
        ast.increment_lineno(tree, start - 1)
        return cls(inner, fdef, inspect.getsourcefile(inner) or "<unknown>", inner.__qualname__)


@dataclass
class RewritePlan:
    """What the rewriter needs to know about the module whose forward it rewrites.

    Attributes:
        essential_attrs: attributes of ``self`` that hold target modules (directly or nested).
        essential_methods: methods of ``self`` whose code reaches an essential attribute.
        ignored: function/method names that are always run opaquely.
        force_opaque: simple statements that failed to trace on an earlier attempt.
    """

    essential_attrs: frozenset[str]
    essential_methods: frozenset[str]
    ignored: frozenset[str] = frozenset()
    force_opaque: frozenset[StmtId] = frozenset()
    decide: frozenset[StmtId] = frozenset()  # ``if`` tests decided on the trace sample, guarded (decide.py)
    module_params: frozenset[str] = frozenset()  # parameters bound to target-holding modules (functions.py)
    lift_tails: bool = (
        True  # an early return that failed takes the rest along (off in modules trace_into opened)
    )


@dataclass
class Rewritten:
    """The rewritten function plus the opaque helpers and the statements it may retry."""

    factory_source: str
    sites: dict[str, OpaqueSite] = field(default_factory=dict)
    tried: dict[StmtId, str] = field(default_factory=dict)  # statement id -> first source line
    decidable: set[StmtId] = field(default_factory=set)  # ``if`` statements that cannot be made opaque
