"""Autograd Functions that call target layers (Reformer's reversible residual stack).

``SomeFunction.apply(hidden, self.layers, ...)`` runs its layers inside ``SomeFunction.forward(ctx, ...)``, out
of the tracer's sight, so the layers would be hidden in one opaque node. Calibration runs without autograd,
where ``apply`` computes exactly ``forward(ctx, ...)``; so when a Function is given target-holding modules, the
tracer traces its ``forward`` with a stand-in ``ctx`` that drops what is kept for the backward pass.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from typing import Any

import torch


class FunctionContext:
    """Stand-in for an autograd ``ctx``: attributes may be set; what only the backward pass needs is dropped."""

    def save_for_backward(self, *tensors: Any) -> None:
        pass

    def mark_dirty(self, *tensors: Any) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def autograd_forward(f: Any) -> Callable[..., Any] | None:
    """``X.forward`` when ``f`` is ``X.apply`` of a ``torch.autograd.Function`` subclass X, else None."""
    owner = getattr(f, "__self__", None)
    if getattr(f, "__name__", None) != "apply" or not isinstance(owner, type):
        return None
    if not issubclass(owner, torch.autograd.Function) or owner.forward is torch.autograd.Function.forward:
        return None
    return owner.forward


def module_params(
    func: Callable[..., Any], args: tuple, kwargs: dict, reach: Collection[int]
) -> frozenset[str]:
    """Names of ``func``'s parameters (after ``ctx``) whose arguments are modules with ids in ``reach``."""
    try:
        bound = inspect.signature(func).bind(None, *args, **kwargs)
    except TypeError:
        return frozenset()
    return frozenset(
        name
        for name, value in bound.arguments.items()
        if isinstance(value, torch.nn.Module) and id(value) in reach
    )
