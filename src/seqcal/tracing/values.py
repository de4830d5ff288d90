"""Values during tracing: opaque call targets, proxy detection, and what may stay a graph constant."""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.fx.proxy import Proxy

from seqcal.tracing.sources import OpaqueSite

SCOPE = "seqcal_module"  # node.meta key: qualified name of the innermost module whose forward made the node


class OpaqueCall:
    """``call_function`` target running lifted statements of ``module``'s code with real values."""

    def __init__(self, helper: Callable[..., Any], module: torch.nn.Module, site: OpaqueSite) -> None:
        self.helper = helper
        self.module = module
        self.site = site
        self.__name__ = self.__qualname__ = f"opaque_{site.site_id}"
        self.__module__ = "seqcal.opaque"

    def __call__(self, *args: Any) -> Any:
        # Containers are copied so that statements mutating e.g. ``kwargs`` never change the graph's constants.
        return self.helper(self.module, *(_copy_containers(a) for a in args))

    def __repr__(self) -> str:
        return f"<opaque {self.site.owner} {self.site.filename}:{self.site.lineno}>"


def _copy_containers(value: Any) -> Any:
    # fx stores node arguments as immutable_dict / immutable_list; model code expects plain, mutable ones.
    if type(value) in (dict, immutable_dict):
        return {k: _copy_containers(v) for k, v in value.items()}
    if type(value) in (list, immutable_list):
        return [_copy_containers(v) for v in value]
    if type(value) is tuple:
        return tuple(_copy_containers(v) for v in value)
    return value


def contains_proxy(value: Any) -> bool:
    if isinstance(value, Proxy):
        return True
    if isinstance(value, (tuple, list)):
        return any(contains_proxy(v) for v in value)
    if isinstance(value, dict):
        return any(contains_proxy(v) for v in value.values())
    if isinstance(value, slice):
        return any(contains_proxy(v) for v in (value.start, value.stop, value.step))
    return False


# Methods that change their object in place (list, dict, set, deque and look-alikes).
MUTATORS = frozenset(
    {"append", "extend", "insert", "appendleft", "extendleft", "update", "setdefault", "add", "pop", "popitem",
     "remove", "discard", "clear", "sort", "reverse", "__setitem__", "__delitem__"}
)  # fmt: skip

_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum, type)


def is_static(value: Any) -> bool:
    """Whether a value computed at trace time from constants may be kept as a constant of the graph.

    Tensors and stateful objects (caches) are not: they are recreated at every run by a node instead.
    """
    if isinstance(value, _PLAIN_TYPES) or value is Ellipsis:
        return True
    if isinstance(value, (torch.nn.Module, types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        return True
    if isinstance(value, functools.partial):
        return True
    if isinstance(value, (tuple, list, set, frozenset)):
        return all(is_static(v) for v in value)
    if isinstance(value, dict):
        return all(is_static(v) for v in value.values())
    if isinstance(value, slice):
        return all(is_static(v) for v in (value.start, value.stop, value.step))
    if isinstance(value, (range, Iterator)):
        return True  # enumerate(self.layers), zip(...), range(n) drive loops over modules
    return type(value).__name__.endswith("Config")  # configs are read, never written, by forwards


def is_torch_callable(f: Any) -> bool:
    module = getattr(f, "__module__", None) or ""
    return module == "torch" or module.startswith(("torch.", "torch._C")) or f in vars(torch).values()


def is_plain_object(owner: Any) -> bool:
    """Whether a bound method's object is a plain Python object: not a module, a proxy or torch's own."""
    return (
        owner is not None
        and not isinstance(owner, (Proxy, torch.nn.Module, types.ModuleType, type))
        and not is_torch_callable(type(owner))
    )


def held_containers(root: torch.nn.Module) -> set[int]:
    """Ids of the lists and dicts the modules of ``root`` hold: they outlive a forward, so never hold proxies."""
    return {id(v) for m in root.modules() for v in vars(m).values() if type(v) in (list, dict)}
