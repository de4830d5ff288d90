"""AST helpers for the rewriter: which names statements read/write, and routing calls through checks."""

from __future__ import annotations

import ast
from collections.abc import Iterable

PREFIX = "__seqcal_"
_MUTATORS = frozenset(
    {"pop", "update", "setdefault", "append", "extend", "insert", "clear", "remove", "popitem", "add"}
)


class _Names(ast.NodeVisitor):
    """Collects names read and written in statements, skipping nested scopes' own locals."""

    def __init__(self) -> None:
        self.loads: set[str] = set()
        self.stores: set[str] = set()
        self.deleted: set[str] = set()
        self.mutated: set[str] = set()
        self.self_attrs: set[str] = set()
        self.calls: set[str] = set()
        self.has_return = self.has_yield = self.has_scope_stmt = False
        self.loop_depth = 0
        self.has_loose_jump = False

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Del):  # ``del x`` reads a bound name and leaves it unbound
            self.loads.add(node.id)
            self.deleted.add(node.id)
            return
        (self.loads if isinstance(node.ctx, ast.Load) else self.stores).add(node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            self.self_attrs.add(node.attr)
        if isinstance(node.ctx, (ast.Store, ast.Del)) and isinstance(node.value, ast.Name):
            self.mutated.add(node.value.id)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)) and isinstance(node.value, ast.Name):
            self.mutated.add(node.value.id)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name):
            self.calls.add(func.id)
        elif isinstance(func, ast.Attribute):
            self.calls.add(func.attr)
            if func.attr in _MUTATORS and isinstance(func.value, ast.Name):
                self.mutated.add(func.value.id)
        self.generic_visit(node)

    def _visit_scope(self, node: ast.AST) -> None:
        # A nested function/lambda/comprehension has its own locals; only its free reads matter here.
        inner = _Names()
        for child in ast.iter_child_nodes(node):
            inner.visit(child)
        self.loads |= inner.loads - inner.stores
        self.self_attrs |= inner.self_attrs
        self.calls |= inner.calls
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self.stores.add(node.name)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _visit_scope
    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _visit_scope

    def visit_Return(self, node: ast.Return) -> None:
        self.has_return = True
        self.generic_visit(node)

    def visit_Yield(self, node: ast.AST) -> None:
        self.has_yield = True

    visit_YieldFrom = visit_Await = visit_Yield

    def visit_Global(self, node: ast.AST) -> None:
        self.has_scope_stmt = True

    visit_Nonlocal = visit_Global

    def _visit_loop(self, node: ast.AST) -> None:
        self.loop_depth += 1
        self.generic_visit(node)
        self.loop_depth -= 1

    visit_For = visit_While = visit_AsyncFor = _visit_loop

    def visit_Break(self, node: ast.AST) -> None:
        if self.loop_depth == 0:
            self.has_loose_jump = True

    visit_Continue = visit_Break


def names_of(stmts: Iterable[ast.AST]) -> _Names:
    visitor = _Names()
    for stmt in stmts:
        visitor.visit(stmt)
    return visitor


def call(name: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=list(args), keywords=[])


class CallRouter(ast.NodeTransformer):
    """Routes calls and ``is`` tests of a traced statement through the tracer's runtime checks."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in {"super", "locals", "globals", "vars"}:
            return node  # zero-argument super() and frame introspection must run in this frame
        return ast.Call(
            func=ast.Name(id=f"{PREFIX}call", ctx=ast.Load()),
            args=[node.func, *node.args],
            keywords=node.keywords,
        )

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)):
            negate = ast.Constant(isinstance(node.ops[0], ast.IsNot))
            return call(f"{PREFIX}is", node.left, node.comparators[0], negate)
        return node

    def _keep(self, node: ast.AST) -> ast.AST:
        return node  # nested scopes run later with real values, not at trace time

    visit_Lambda = visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _keep
    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _keep
