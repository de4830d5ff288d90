"""Value <-> skeleton for the activation cache: ``flatten`` splits a value into containers and tensor leaves.

The skeleton (``_Node``) keeps containers, constants and opaque objects; ``unflatten`` rebuilds the value
from it. ``seqcal.execution.cache.store.ActivationCache`` stores the tensor leaves and keeps the skeleton.

Example:
    >>> unflatten(flatten((torch.ones(1), None), lambda t: t * 2), lambda r: r)
    (tensor([2.]), None)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

# ---- structure: value <-> skeleton with tensor leaves ---------------------------------------------------
# Not torch.utils._pytree: it decomposes plain dataclasses or slices only after a process-global
# registration (DESIGN: no global state), and what it decomposes depends on what the installed transformers
# registered (ModelOutput subclasses, some Cache classes). This cache must keep unknown objects whole.


@dataclasses.dataclass(frozen=True, eq=False)
class _Node:
    kind: str  # "tensor" | "keep" | a key of _REBUILD
    children: tuple[_Node, ...] = ()
    meta: Any = None  # tensor: its _TensorRef; keep: the object; containers: (class, keys, extra)


def _is_plain_tensor(value: Any) -> bool:
    """Dense tensor with data; subclasses, sparse, quantized, nested and meta tensors are kept whole."""
    return (
        type(value) in (torch.Tensor, torch.nn.Parameter)
        and value.layout == torch.strided
        and not (value.is_quantized or value.is_nested or value.device.type == "meta")
    )


def _container_kind(value: Any) -> str | None:
    cls = type(value)
    if cls in (tuple, list):
        return "seq"
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return "namedtuple" if hasattr(cls, "_fields") else "structseq" if hasattr(cls, "n_fields") else None
    if cls in (dict, collections.OrderedDict, collections.defaultdict):
        return "dict"
    if isinstance(value, dict) and dataclasses.is_dataclass(value):
        return "model_output"  # transformers ModelOutput: an OrderedDict dataclass holding its non-None keys
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "dataclass"
    return "slice" if cls is slice else None


def _parts(kind: str, value: Any) -> tuple[tuple | None, list[Any]]:
    """(keys, child values) of a container."""
    if kind in ("dict", "model_output"):
        return tuple(value.keys()), list(value.values())
    if kind == "dataclass":  # fields plus attributes set in __post_init__
        names = [f.name for f in dataclasses.fields(value) if hasattr(value, f.name)]
        names += [k for k in getattr(value, "__dict__", {}) if k not in names]
        return tuple(names), [getattr(value, k) for k in names]
    if kind == "slice":
        return None, [value.start, value.stop, value.step]
    return None, list(value)


def _new_dataclass(cls: type, keys: tuple, values: list) -> Any:
    # Not cls(**...): __init__/__post_init__ already ran on the original and may not be idempotent.
    obj = cls.__new__(cls)
    for key, val in zip(keys, values):
        object.__setattr__(obj, key, val)  # object's setattr also works for frozen dataclasses
    return obj


_REBUILD: dict[str, Callable[[type, tuple | None, Any, list], Any]] = {
    "seq": lambda cls, keys, extra, vals: cls(vals),
    "namedtuple": lambda cls, keys, extra, vals: cls(*vals),
    "structseq": lambda cls, keys, extra, vals: cls(vals),  # torch.return_types
    "dict": lambda cls, keys, extra, vals: (
        cls(extra, zip(keys, vals)) if cls is collections.defaultdict else cls(zip(keys, vals))
    ),
    "model_output": lambda cls, keys, extra, vals: cls(**dict(zip(keys, vals))),
    "dataclass": lambda cls, keys, extra, vals: _new_dataclass(cls, keys, vals),
    "slice": lambda cls, keys, extra, vals: slice(*vals),
}


def flatten(value: Any, store: Callable[[torch.Tensor], Any], _active: set[int] | None = None) -> _Node:
    """Skeleton of `value` whose tensor leaves are replaced by `store(tensor)`.

    Args:
        value: nested tuple/list/dict/namedtuple/dataclass/ModelOutput/slice of tensors and other objects;
            anything else (scalars, dtypes, DynamicCache, ...) is kept by reference.
        store: called once per tensor leaf; its result is kept in the skeleton.

    Returns:
        The skeleton; `unflatten(skeleton, load)` rebuilds the value.

    Example:
        >>> unflatten(flatten((torch.ones(1), None), lambda t: t * 2), lambda r: r)
        (tensor([2.]), None)
    """
    if isinstance(value, torch.Tensor) and _is_plain_tensor(value):
        return _Node("tensor", meta=store(value))
    kind = _container_kind(value)
    if kind is None:
        return _Node("keep", meta=value)
    active = set() if _active is None else _active
    if id(value) in active:
        raise ValueError(
            f"ActivationCache: a {type(value).__name__} contains itself; a value crossing a subgraph "
            "boundary must be a tree. Break the cycle or wrap the object so it is kept by reference."
        )
    active.add(id(value))
    try:
        keys, items = _parts(kind, value)
        children = tuple(flatten(item, store, active) for item in items)
    finally:
        active.discard(id(value))
    extra = value.default_factory if isinstance(value, collections.defaultdict) else None
    return _Node(kind, children, (type(value), keys, extra))


def unflatten(node: _Node, load: Callable[[Any], torch.Tensor]) -> Any:
    """Rebuild the value of a `flatten` skeleton; `load` turns each stored leaf back into a tensor."""
    if node.kind == "tensor":
        return load(node.meta)
    if node.kind == "keep":
        return node.meta
    cls, keys, extra = node.meta
    return _REBUILD[node.kind](cls, keys, extra, [unflatten(child, load) for child in node.children])
