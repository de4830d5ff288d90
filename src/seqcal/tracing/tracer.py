"""The fx tracer: leaves are call_module nodes, the forwards above them are rewritten and traced.

Leaf policy (a module becomes one opaque ``call_module`` node): by default every target, every module the
user names in ``leaf_modules``, and every module that holds no target, so only the few forwards between the
root and the targets are traced. ``trace_into`` (see ``leaves.py``) opens more modules, targets included: a
target traced into is then one contiguous region of nodes (tagged with its name in ``node.meta``) instead of
one node. Every traced forward is rewritten first (``rewrite.py``) so that its untraceable statements become
opaque. Decisions that depend on values are never taken at trace time: calls with symbolic arguments become
nodes, ``is`` tests on runtime values and ``bool()`` of them abort the statement, which is then retried as an
opaque node. A module opened by ``trace_into`` whose forward cannot be traced at all stays a leaf, and the
failure is reported with its file and line.
"""

from __future__ import annotations
import __future__

import inspect
import logging
import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.fx.proxy import Proxy, TraceError

from seqcal.tracing.astutil import names_of
from seqcal.tracing.decide import Concrete, DecidingTracer
from seqcal.tracing.diagnostics import Problem, TracingError
from seqcal.tracing.functions import FunctionContext, autograd_forward, module_params
from seqcal.tracing.policy import LeafPolicy, ModuleRefused, StatementFailed, TraceState
from seqcal.tracing.rewrite import compile_rewritten, rewrite_source
from seqcal.tracing.sources import OpaqueSite, RewritePlan, SourceFunction, StmtId
from seqcal.tracing.values import (
    _PLAIN_TYPES,
    MUTATORS,
    SCOPE,
    OpaqueCall,
    contains_proxy,
    held_containers,
    is_plain_object,
    is_static,
    is_torch_callable,
)

logger = logging.getLogger("seqcal")


class SeqTracer(DecidingTracer):
    """fx tracer with seqcal's leaf policy and source rewriting (see module docstring)."""

    def __init__(self, policy: LeafPolicy, ignored: frozenset[str], state: TraceState) -> None:
        super().__init__(autowrap_modules=(), autowrap_functions=(), param_shapes_constant=False)
        self.policy = policy
        self.ignored = ignored
        self.state = state
        self.sites: dict[str, OpaqueSite] = {}
        self.helpers: dict[str, Callable[..., Any]] = {}
        self._compiled: dict[tuple[Any, int], Callable[..., Any]] = {}
        self._sources = state.sources  # parsed once per trace call, shared by its retraces
        self.rewritten_files: set[str] = set()
        self.module_scope: list[str] = []  # modules whose forwards are being traced, innermost last
        self.entered: Counter[str] = Counter()  # how often each module was traced into
        self._essential_methods: dict[int, set[str]] = {}
        self._persistent: set[int] | None = None
        self.concrete: Concrete | None = None  # the sample's values, for guarded decisions
        self._deciding: list[tuple[str, int, int]] = []

    # -- fx hooks -------------------------------------------------------------------------------------------
    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return self.policy.is_leaf(m, module_qualified_name)

    def call_module(self, m: torch.nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        name = self.path_of_module(m)
        if self.is_leaf_module(m, name):
            return self.create_proxy("call_module", name, args, kwargs)
        self.entered[name] += 1
        self.module_scope.append(name)
        try:
            return self.call_rewritten(m, type(m).forward, args, kwargs)
        except (StatementFailed, ModuleRefused):
            raise
        except Exception as exc:
            if self.policy.is_opened(m):  # asked for, not needed: keep it a leaf rather than fail the trace
                raise ModuleRefused(name, m, exc) from exc
            raise
        finally:
            self.module_scope.pop()

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None,
                    type_expr: Any = None) -> fx.Node:  # fmt: skip
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if self.module_scope and kind not in ("placeholder", "get_attr", "output"):
            node.meta[SCOPE] = self.module_scope[-1]
        return node

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, torch.nn.Parameter) or isinstance(a, (torch.nn.Module, Proxy)):
            return super().create_arg(a)
        if isinstance(a, torch.Tensor):
            for name, buf in self.root.named_buffers():
                if a is buf:
                    return self.create_node("get_attr", name, (), {})
            return a  # a constant tensor stays a plain argument: the model is never modified
        if isinstance(a, (tuple, list, dict, slice, range, *_PLAIN_TYPES)) and not hasattr(a, "_fields"):
            try:
                return super().create_arg(a)
            except NotImplementedError:
                return a
        return a  # opaque Python objects (configs, modules' helpers) are kept by reference

    def trace_root(
        self, root: torch.nn.Module, tensors: dict[str, Any], constants: dict[str, Any]
    ) -> fx.Graph:
        """Trace ``root(**tensors, **constants)``; tensor inputs become placeholders in that order."""
        names = list(tensors)
        self.concrete = Concrete(root, tensors)

        def create_args_for_root(root_fn: Any, is_module: bool, concrete_args: Any = None) -> tuple:
            proxies = [self.create_proxy("placeholder", n, (), {}) for n in names]

            def entry(*values: Any) -> Any:
                return self.call_rewritten(
                    root, type(root).forward, (), {**dict(zip(names, values)), **constants}
                )

            return entry, proxies

        self.create_args_for_root = create_args_for_root  # type: ignore[method-assign]
        return self.trace(root)

    # -- rewriting ------------------------------------------------------------------------------------------
    def call_rewritten(
        self,
        module: Any,
        func: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        params: frozenset[str] = frozenset(),
    ) -> Any:
        fn = self._rewritten(module, func, params)
        return fn(module, *args, **kwargs)

    def _source(self, func: Callable[..., Any]) -> SourceFunction:
        key = inspect.unwrap(func)
        if key not in self._sources:
            try:
                self._sources[key] = SourceFunction.of(func)
            except (OSError, TypeError) as exc:
                raise TracingError(
                    [
                        Problem(
                            where=getattr(key, "__qualname__", repr(key)),
                            what=f"its source is not available ({exc}), so it cannot be traced through",
                            fix="make the module a leaf (leaf_modules=[...]) or choose targets outside it",
                        )
                    ]
                ) from exc
        return self._sources[key]

    def _rewritten(self, module: Any, func: Callable[..., Any], params: frozenset[str]) -> Callable[..., Any]:
        key = (func, id(module), params)
        if key in self._compiled:
            return self._compiled[key]
        src = self._source(func)
        plan = RewritePlan(
            essential_attrs=frozenset(self.essential_attrs(module)),
            essential_methods=frozenset(self.essential_methods(module)),
            ignored=self.ignored,
            force_opaque=frozenset(self.state.force_opaque),
            decide=frozenset(self.state.decide),
            module_params=params,
            # A module opened by trace_into whose forward fails stays one node (reported), as it always did.
            lift_tails=not (isinstance(module, torch.nn.Module) and self.policy.is_opened(module)),
        )
        rewritten = rewrite_source(src, plan)
        self.state.decidable |= rewritten.decidable
        self.sites.update(rewritten.sites)
        owner = _defining_class(type(module), src.func)
        fn, helpers = compile_rewritten(rewritten, src, owner, self._runtime(), flags=_FUTURE_ANNOTATIONS)
        self.helpers.update(helpers)
        self.rewritten_files.add(src.filename)
        self._compiled[key] = fn
        return fn

    def essential_attrs(self, module: torch.nn.Module) -> set[str]:
        # Opened modules (trace_into) do not count: the forwards above them are rewritten exactly as without
        # trace_into, so a compound statement guarding a call to one stays opaque (and runs eagerly).
        reach = self.policy.holders | set(self.policy.targets)
        if not isinstance(module, torch.nn.Module):  # an autograd ctx stand-in (functions.py)
            return set()
        attrs = {name for name, child in module._modules.items() if child is not None and id(child) in reach}
        for name, value in vars(type(module)).items():
            if isinstance(value, property):
                try:
                    target = getattr(module, name)
                except Exception:  # noqa: BLE001 - a property that fails here is simply not a module alias
                    continue
                if isinstance(target, torch.nn.Module) and id(target) in reach:
                    attrs.add(name)
        return attrs

    def essential_methods(self, module: torch.nn.Module) -> set[str]:
        """Methods of ``module`` whose code reaches a target-holding attribute (fixpoint over self.X calls)."""
        if id(module) not in self._essential_methods:
            self._essential_methods[id(module)] = self._find_essential_methods(module)
        return self._essential_methods[id(module)]

    def _find_essential_methods(self, module: torch.nn.Module) -> set[str]:
        attrs = self.essential_attrs(module)
        if not attrs:
            return set()
        methods: dict[str, set[str]] = {}
        for klass in type(module).__mro__:
            if klass in (torch.nn.Module, object) or klass.__module__.startswith("torch."):
                continue
            for name, value in vars(klass).items():
                if isinstance(value, types.FunctionType) and name not in methods and name != "forward":
                    if value not in self.state.method_refs:
                        try:
                            refs = names_of([SourceFunction.of(value).tree]).self_attrs
                        except (OSError, TypeError, SyntaxError):
                            refs = set()
                        self.state.method_refs[value] = refs
                    methods[name] = self.state.method_refs[value]
        essential: set[str] = set()
        changed = True
        while changed:
            changed = False
            for name, refs in methods.items():
                if name not in essential and refs & (attrs | essential):
                    essential.add(name)
                    changed = True
        return essential

    # -- runtime checks injected into rewritten code --------------------------------------------------------
    def _runtime(self) -> dict[str, Any]:
        return {
            "__seqcal_call": self._call,
            "__seqcal_is": self._is,
            "__seqcal_fail": self._fail,
            "__seqcal_opaque": self._opaque,
            "__seqcal_decide": self._decide,
            "__seqcal_deciding": self._deciding_in,
        }

    def _call(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (Proxy, torch.nn.Module)):
            return f(*args, **kwargs)
        name = getattr(f, "__name__", None)
        owner = getattr(f, "__self__", None)
        symbolic = contains_proxy(args) or contains_proxy(kwargs)
        if isinstance(owner, torch.nn.Module) and isinstance(
            getattr(f, "__func__", None), types.FunctionType
        ):
            holder = not self.policy.is_leaf(owner, self.path_of_module_safe(owner))
            if (
                holder
                and name not in self.ignored
                and (name == "forward" or name in self.essential_methods(owner))
            ):
                return self.call_rewritten(owner, f.__func__, args, kwargs)
            if not holder and name == "forward":
                # ``layer.forward(x)`` (SqueezeBERT's encoder): called as ``layer(x)``, so a leaf or target is a
                # call_module node, and the modifiers' hooks see it at run time
                return owner(*args, **kwargs)
        if symbolic and (type(owner) in (list, dict) or (name in MUTATORS and is_plain_object(owner))):
            return self._container_call(f, owner, args, kwargs)
        forward = autograd_forward(f)
        if forward is not None and name not in self.ignored:
            params = module_params(forward, args, kwargs, self.policy.holders | set(self.policy.targets))
            if params:  # its forward calls targets: traced (calibration runs without autograd)
                return self.call_rewritten(FunctionContext(), forward, args, kwargs, params)
        if isinstance(owner, FunctionContext):
            return None  # ctx.save_for_backward(...) and the like: only the backward pass needs them
        if not symbolic and name not in self.ignored:
            if is_torch_callable(f) and not isinstance(f, type):
                return self.create_proxy("call_function", f, args, kwargs)  # tensors are made at run time
            result = f(*args, **kwargs)
            # A result holding proxies (``outs.pop()``, ``named["x"]``) is already in graph terms; as a node it
            # would hand the proxies themselves to the run.
            if is_static(result) or contains_proxy(result):
                return result
        return self.create_proxy("call_function", f, args, kwargs)

    def _container_call(self, f: Any, owner: Any, args: tuple, kwargs: dict) -> Any:
        """``outs.append(x)``, ``named.get(k, x)``: a method of a Python object, with a value only known at run time.

        As a node it would run on the trace-time object at run time: a change it makes would be missed by every
        read of the object at trace time (a list appended to in a loop, then stacked: the graph stacks what the
        list held before the loop), and a read would see the proxies it holds. A list or dict the forward built
        is used now, holding proxies as a literal would; a change to anything else (a model's own list, other
        objects), or a dict key only known at run time, fails the statement, which then runs opaquely.
        """
        name = getattr(f, "__name__", "")
        if type(owner) in (list, dict):
            if self._persistent is None:
                self._persistent = held_containers(self.root)
            persistent = id(owner) in self._persistent
            runtime_key = isinstance(owner, dict) and bool(args) and isinstance(args[0], Proxy)
            if not runtime_key and not (persistent and name in MUTATORS):
                return f(*args, **kwargs)
        raise TraceError(
            f"{type(owner).__name__}.{name}() on an object tracing cannot follow, with a value only known at run time"
        )

    def path_of_module_safe(self, module: torch.nn.Module) -> str:
        try:
            return self.path_of_module(module)
        except NameError:
            return ""

    def _is(self, a: Any, b: Any, negate: bool) -> bool:
        for value in (a, b):
            if isinstance(value, Proxy) and value.node.op not in ("placeholder", "get_attr"):
                if self._deciding and not isinstance(b, Proxy):
                    return self._decided(a, negate, b)
                raise TraceError(f"`is` test on a value only known at run time ({value.node.format_node()})")
        return (a is not b) if negate else (a is b)

    def _fail(self, sid: StmtId, err: BaseException) -> None:
        if isinstance(err, (StatementFailed, TracingError, ModuleRefused)):
            raise err
        raise StatementFailed(sid, err) from err

    def _opaque(
        self, site_id: str, helper: Callable[..., Any], module: torch.nn.Module, inputs: tuple
    ) -> Any:
        site = self.sites[site_id]
        call = OpaqueCall(helper, module, site)
        folded: Any = None
        if not contains_proxy(inputs):
            folded = self._fold(call, inputs)
            if folded is not None and is_static(folded[0]):
                return folded[0]
        proxy = self.create_proxy("call_function", call, inputs, {})
        if folded is not None and isinstance(folded[0], tuple):
            # Keep what is static (flags, sizes) as constants; the rest comes from the node at run time.
            return tuple(v if is_static(v) else proxy[i] for i, v in enumerate(folded[0]))
        return proxy

    def _fold(self, call: OpaqueCall, inputs: tuple) -> tuple[Any] | None:
        """Run constant-only statements now; nodes they created while running are removed again."""
        last = list(self.graph.nodes)[-1] if len(self.graph.nodes) else None
        try:
            result: tuple[Any] | None = (call(*inputs),)
        except Exception:  # noqa: BLE001 - whatever failed will run (and fail, if it must) at run time
            result = None
        for node in reversed(list(self.graph.nodes)):
            if node is last:
                break
            self.graph.erase_node(node)
        if result is not None and contains_proxy(result[0]):
            return None
        return result


_FUTURE_ANNOTATIONS = __future__.annotations.compiler_flag


def _defining_class(cls: type, func: Callable[..., Any]) -> type:
    for klass in cls.__mro__:
        for value in vars(klass).values():
            if value is func or getattr(value, "__wrapped__", None) is func or inspect.unwrap(value) is func:
                return klass
    return cls
