"""Source rewriting of the forwards that tracing goes *through* (the ancestors of the targets).

torch.fx can only trace Python whose control flow does not depend on tensor values. The forwards of
transformers' top-level models are full of such code (mask creation, cache objects, ``if x is None``,
``ModelOutput`` construction). Rather than freezing it from the trace sample, we rewrite the forward:

* a statement that reaches a target-holding submodule (``self.layers``, a loop variable bound to a layer,
  a method that calls them) is *essential*: it is traced, compound statements recurse into their bodies;
* a compound statement that reaches none is *opaque*: it is lifted into a helper function that becomes one
  ``call_function`` node and runs at execution time with real values (or, when every input is a constant, is
  folded at trace time); the loop's locals it reads are its arguments;
* a simple statement that reaches none is tried first; if tracing it fails it is made opaque on a retrace.

Every call in a traced statement goes through ``__seqcal_call`` and every ``is`` comparison through
``__seqcal_is`` so the tracer can decide at trace time (see ``tracer.py``) instead of specialising silently.
The math is none; this module only turns a function's AST into another function.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable
from typing import Any

from seqcal.tracing.astutil import CallRouter, call, names_of
from seqcal.tracing.sources import OpaqueSite, RewritePlan, Rewritten, SourceFunction

_PREFIX = "__seqcal_"
_COMPOUND = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith, ast.Match)
_SIMPLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _stmt_id(node: ast.stmt) -> tuple[int, int]:
    return (node.lineno, node.col_offset)


class _BodyRewriter:
    """Rewrites one function body; see the module docstring for the rules."""

    def __init__(self, plan: RewritePlan, src: SourceFunction, params: set[str]) -> None:
        self.plan = plan
        self.src = src
        self.helpers: list[ast.FunctionDef] = []
        self.result = Rewritten(factory_source="")
        self.module_names: set[str] = set(plan.module_params)  # locals that may hold target-holding modules
        self.bound: set[str] = set(params)
        self.maybe_unbound: set[str] = set()  # locals a loop body assigns: unbound before their first store
        self.params = params
        positional = [*src.tree.args.posonlyargs, *src.tree.args.args]
        self.first = positional[0].arg if positional else "self"  # ``ctx`` in an autograd Function's forward

    def is_essential(self, stmts: list[ast.stmt]) -> bool:
        names = names_of(stmts)
        return bool(
            names.self_attrs & (self.plan.essential_attrs | self.plan.essential_methods)
            or names.loads & self.module_names
            or ("super" in names.calls and "forward" in names.calls and self.plan.essential_attrs)
        )

    def rewrite(self, body: list[ast.stmt], top: bool) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        pending: list[ast.stmt] = []
        for i, stmt in enumerate(body):
            kind = self._classify(stmt)
            if kind != "opaque" and top and self._absorbs_tail(pending, body[i:]):
                pending += body[i:]  # an early return that failed to trace: lift it with the rest
                break
            if kind == "opaque":
                if pending and not _jumps(pending + [stmt]):
                    # One helper per statement: one whose inputs are all constants is then folded at trace
                    # time (``if use_cache: ...`` with use_cache=False), instead of making everything the
                    # group assigns a value only known at run time.
                    out += self._lift(pending, top=False)
                    pending = []
                pending.append(stmt)
                continue
            if pending:
                out += self._lift(pending, top=False)
                pending = []
            out += self._traced(stmt, kind)
            self.bound |= names_of([stmt]).stores
        if pending:
            out += self._lift(pending, top=top)
        return out

    def _forced(self, stmt: ast.stmt) -> bool:
        return (self.src.filename, *_stmt_id(stmt)) in self.plan.force_opaque

    def _absorbs_tail(self, pending: list[ast.stmt], tail: list[ast.stmt]) -> bool:
        """Whether opaque statements holding a ``return`` take the rest of the function with them.

        A ``return`` can only be lifted at the end of the function. When such a group failed to trace
        (``if not return_dict: return tuple(...)`` after a statement made opaque), the statements after
        it move into the group, as long as none of them reaches a target.
        """
        names = names_of(pending)
        return (
            self.plan.lift_tails
            and names.has_return
            and not (names.has_yield or names.has_scope_stmt or names.has_loose_jump)
            and any(self._forced(s) for s in pending)
            and not self.is_essential(tail)
            and not names_of(tail).has_yield
        )

    def _classify(self, stmt: ast.stmt) -> str:
        # A simple statement is always tried: if it fails it becomes opaque, and should it have called a
        # target, the invariant-2 check after tracing reports the hidden target with this failure.
        if isinstance(stmt, (ast.Pass, ast.Import, ast.ImportFrom)):
            return "keep"
        if isinstance(stmt, _SIMPLE):
            forced = (self.src.filename, *_stmt_id(stmt)) in self.plan.force_opaque
            names = names_of([stmt])
            # Storing into ``self`` at trace time would leave proxies on the model: it runs at execution time.
            return "opaque" if forced or names.calls & self.plan.ignored or "self" in names.mutated else "try"
        if isinstance(stmt, _COMPOUND) and self.is_essential([stmt]):
            forced = (self.src.filename, *_stmt_id(stmt)) in self.plan.force_opaque
            return "opaque" if forced else "essential"
        return "opaque"

    def _traced(self, stmt: ast.stmt, kind: str) -> list[ast.stmt]:
        if kind == "keep":
            return [stmt]
        if isinstance(stmt, ast.For) and self.is_essential([ast.Expr(stmt.iter)]):
            self.module_names |= names_of([stmt.target]).stores
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            if not isinstance(stmt.value, ast.Call) and self.is_essential([ast.Expr(stmt.value)]):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                self.module_names |= names_of(targets).stores
        sid = (self.src.filename, *_stmt_id(stmt))
        if isinstance(stmt, _COMPOUND):
            routed = self._compound(stmt)
            if isinstance(stmt, ast.If) and kind in ("essential", "must"):
                self.result.decidable.add(sid)
                if sid in self.plan.decide:  # evaluated inside a thunk, so that bool() of parts is seen
                    thunk = ast.Lambda(args=_NO_ARGS, body=routed.test)
                    routed.test = call(f"{_PREFIX}decide", ast.Constant(sid), thunk)
        else:
            routed = CallRouter().visit(stmt)
            if self.is_essential([stmt]):  # calls a target: an ``is`` test in it is decided on the sample
                self.result.decidable.add(sid)
                if sid in self.plan.decide:
                    decide = ast.withitem(context_expr=call(f"{_PREFIX}deciding", ast.Constant(sid)))
                    routed = ast.copy_location(ast.With(items=[decide], body=[routed]), stmt)
        if kind == "must" and sid in self.plan.force_opaque:  # failed once already: reported as is
            return [routed]
        self.result.tried[sid] = ast.unparse(stmt).splitlines()[0]
        handler = ast.ExceptHandler(
            type=ast.Name(id="Exception", ctx=ast.Load()),
            name=f"{_PREFIX}err",
            body=[
                ast.Expr(
                    call(f"{_PREFIX}fail", ast.Constant(sid), ast.Name(id=f"{_PREFIX}err", ctx=ast.Load()))
                )
            ],
        )
        return [ast.Try(body=[routed], handlers=[handler], orelse=[], finalbody=[])]

    def _compound(self, stmt: ast.stmt) -> ast.stmt:
        self._bind_header(stmt)
        for attr in ("test", "iter", "subject"):
            if hasattr(stmt, attr):
                setattr(stmt, attr, CallRouter().visit(getattr(stmt, attr)))
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            stmt.items = [CallRouter().visit(item) for item in stmt.items]
            self.bound |= names_of([i.optional_vars for i in stmt.items if i.optional_vars]).stores
        if isinstance(stmt, (ast.For, ast.AsyncFor)):  # the loop variables are locals an opaque body reads
            self.bound |= names_of([stmt.target]).stores
        for attr in ("body", "orelse", "finalbody"):
            if getattr(stmt, attr, None):
                setattr(stmt, attr, self.rewrite(getattr(stmt, attr), top=False))
        if isinstance(stmt, ast.Try):
            for handler in stmt.handlers:
                handler.body = self.rewrite(handler.body, top=False)
        if isinstance(stmt, ast.Match):
            for case in stmt.cases:
                case.body = self.rewrite(case.body, top=False)
        return stmt

    def _bind_header(self, stmt: ast.stmt) -> None:
        """Names the body of ``stmt`` may read as locals, bound before it runs: loop targets, ``with ... as``,
        ``except ... as``, walrus targets, and what a loop body assigns (read by the next iteration).

        A helper lifted from the body takes them as arguments; missed, the helper would look them up as
        globals at run time.
        """
        header: list[ast.AST] = [
            getattr(stmt, a) for a in ("target", "test", "iter", "subject") if hasattr(stmt, a)
        ]
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            header += [item for item in stmt.items]
        self.bound |= names_of(header).stores
        if isinstance(stmt, ast.Try):
            self.bound |= {h.name for h in stmt.handlers if h.name}
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            carried = names_of(stmt.body).stores - self.bound
            self.maybe_unbound |= carried
            self.bound |= carried

    def _lift(self, stmts: list[ast.stmt], top: bool) -> list[ast.stmt]:
        names = names_of(stmts)
        if names.has_yield or names.has_scope_stmt or names.has_loose_jump or (names.has_return and not top):
            # Cannot be moved into a helper without changing control flow: trace it and let the
            # tracer report precisely if it fails.
            return [s for stmt in stmts for s in self._traced(stmt, "must")]
        site_id = f"{self.src.qualname.replace('.', '_')}_L{stmts[0].lineno}"
        inputs = sorted((names.loads | names.mutated | names.stores) & self.bound - {"self"})
        # A mutated name is returned only when it is a local: rebinding a global would make it local.
        outputs = sorted((names.stores | (names.mutated & self.bound)) - {"self"} - names.deleted)
        fresh = [o for o in outputs if o not in inputs]
        helper_body: list[ast.stmt] = [
            ast.Assign(targets=[ast.Name(id=o, ctx=ast.Store())], value=ast.Constant(None)) for o in fresh
        ]
        helper_body += stmts
        if top and names.has_return:
            helper_body.append(ast.Return(ast.Constant(None)))
        else:
            helper_body.append(
                ast.Return(ast.Tuple(elts=[ast.Name(id=o, ctx=ast.Load()) for o in outputs], ctx=ast.Load()))
            )
        helper = ast.FunctionDef(
            name=f"{_PREFIX}op_{site_id}",
            args=ast.arguments(
                posonlyargs=[],
                args=[ast.arg(arg=a) for a in ["self", *inputs]],
                kwonlyargs=[],
                kw_defaults=[],
                defaults=[],
            ),
            body=helper_body,
            decorator_list=[],
            returns=None,
            type_params=[],
        )
        ast.copy_location(helper, stmts[0])
        self.helpers.append(helper)
        self.result.sites[site_id] = OpaqueSite(
            site_id=site_id,
            filename=self.src.filename,
            lineno=stmts[0].lineno,
            end_lineno=getattr(stmts[-1], "end_lineno", stmts[-1].lineno) or stmts[-1].lineno,
            owner=self.src.qualname,
            reason=_reason(stmts),
            source=ast.unparse(stmts[0]).splitlines()[0][:120],
            touched=tuple(sorted(names.self_attrs)),
            inputs=tuple(inputs),
            outputs=tuple(outputs) if not (top and names.has_return) else (),
            code="\n".join(ast.unparse(stmt) for stmt in stmts),
        )
        invoke = call(
            f"{_PREFIX}opaque",
            ast.Constant(site_id),
            ast.Name(id=helper.name, ctx=ast.Load()),
            ast.Name(id=self.first, ctx=ast.Load()),
            ast.Tuple(elts=[_bound_or_none(a, a in self.params) for a in inputs], ctx=ast.Load()),
        )
        if top and names.has_return:
            out: list[ast.stmt] = [ast.Return(invoke)]
        else:
            tmp = f"{_PREFIX}out"
            out = [ast.Assign(targets=[ast.Name(id=tmp, ctx=ast.Store())], value=invoke)]
            for i, o in enumerate(outputs):
                index = ast.Subscript(
                    value=ast.Name(id=tmp, ctx=ast.Load()), slice=ast.Constant(i), ctx=ast.Load()
                )
                out.append(ast.Assign(targets=[ast.Name(id=o, ctx=ast.Store())], value=index))
        for stmt in out:
            ast.copy_location(stmt, stmts[0])
        self.bound |= set(outputs)
        return out


def _jumps(stmts: list[ast.stmt]) -> bool:
    names = names_of(stmts)
    return names.has_return or names.has_yield or names.has_scope_stmt or names.has_loose_jump


_NO_ARGS = ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])


def _bound_or_none(name: str, loaded: bool) -> ast.expr:
    """The value of local ``name``; a local other than a parameter may be unbound here (assigned in a branch
    not taken at trace time, or only in another branch), so it is passed as ``locals().get(name)``."""
    if loaded:
        return ast.Name(id=name, ctx=ast.Load())
    get = ast.Attribute(value=call("locals"), attr="get", ctx=ast.Load())
    return ast.Call(func=get, args=[ast.Constant(name)], keywords=[])


def _reason(stmts: list[ast.stmt]) -> str:
    first = stmts[0]
    if isinstance(first, ast.If):
        return "control flow on runtime values (if)"
    if isinstance(first, (ast.For, ast.While)):
        return "loop that reaches no target"
    if isinstance(first, (ast.Raise, ast.Assert)):
        return "runtime check"
    if isinstance(first, (ast.Try, ast.With)):
        return "try/with block that reaches no target"
    return "statement failed to trace symbolically"


def rewrite_source(src: SourceFunction, plan: RewritePlan) -> Rewritten:
    """Rewrite ``src`` under ``plan`` into the source of a factory ``__seqcal_factory(__class__)``.

    The factory returns ``(function, helpers)``; compiling it in the original function's globals keeps
    decorators, ``super()`` and global names working.

    Args:
        src: the parsed function (usually a ``forward``).
        plan: which attributes/methods are essential and which statements must be opaque.

    Returns:
        The factory source, the opaque sites and the statements that are traced on trial.
    """
    fdef = copy.deepcopy(src.tree)  # rewriting edits the tree in place; the cached source stays pristine
    args = fdef.args
    params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    params |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    rewriter = _BodyRewriter(plan, src, params)
    body = list(fdef.body)
    docstring = []
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        docstring, body = body[:1], body[1:]  # kept: documentation decorators read it
    new_body = docstring + (rewriter.rewrite(body, top=True) or [ast.Pass()])
    new_fdef = ast.FunctionDef(
        name=fdef.name,
        args=fdef.args,
        body=new_body,
        decorator_list=fdef.decorator_list,
        returns=None,
        type_params=[],
    )
    ast.copy_location(new_fdef, fdef)
    helpers_dict = ast.Dict(
        keys=[ast.Constant(h.name) for h in rewriter.helpers],
        values=[ast.Name(id=h.name, ctx=ast.Load()) for h in rewriter.helpers],
    )
    ret = ast.Return(ast.Tuple(elts=[ast.Name(id=fdef.name, ctx=ast.Load()), helpers_dict], ctx=ast.Load()))
    factory = ast.FunctionDef(
        name=f"{_PREFIX}factory",
        args=ast.arguments(
            posonlyargs=[], args=[ast.arg(arg="__class__")], kwonlyargs=[], kw_defaults=[], defaults=[]
        ),
        body=[*rewriter.helpers, new_fdef, ret],
        decorator_list=[],
        returns=None,
        type_params=[],
    )
    ast.copy_location(factory, fdef)
    ast.copy_location(ret, fdef)
    module = ast.Module(body=[factory], type_ignores=[])
    ast.fix_missing_locations(module)
    rewriter.result.factory_source = module  # type: ignore[assignment]  # an AST, compiled by compile_rewritten
    return rewriter.result


def compile_rewritten(
    rewritten: Rewritten, src: SourceFunction, owner: type, runtime: dict[str, Any], flags: int = 0
) -> tuple[Callable[..., Any], dict[str, Callable[..., Any]]]:
    """Compile a rewrite in a copy of the original globals plus ``runtime`` (the tracer's checks).

    Args:
        rewritten: output of ``rewrite_source``.
        src: the original function.
        owner: the class that defines the function (the ``__class__`` cell for zero-argument ``super()``).
        runtime: the ``__seqcal_*`` callables, bound to the current tracer.
        flags: compiler flags (``from __future__ import annotations`` keeps annotations unevaluated).

    Returns:
        The rewritten function (decorators re-applied) and its opaque helpers by name.
    """
    namespace = dict(src.func.__globals__)
    namespace.update(runtime)
    code = compile(rewritten.factory_source, src.filename, "exec", flags=flags, dont_inherit=True)  # type: ignore[arg-type]
    exec(code, namespace)  # noqa: S102 - our own rewrite of source the user already imported
    fn, helpers = namespace[f"{_PREFIX}factory"](owner)
    return fn, helpers
