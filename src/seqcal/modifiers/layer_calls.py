"""A decoder layer's recorded calls as rows: AutoRound re-runs a layer on batches of the rows it was called with.

``Calls.of`` stacks calls of one shape into one unit of rows (tensors equal in every call kept once, batch-major
ones concatenated); ``Calls.batch`` hands out the calls restricted to some rows, with their token masks and the
reference outputs of those rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from seqcal.modifiers.spans import map_tensors, moved

__all__ = ["Calls", "hidden_of", "with_hidden"]


@dataclass
class _Unit:
    """Recorded calls made one: ``args``, ``kwargs`` whose batch-major tensors hold ``rows`` rows, and the mask."""

    args: tuple
    kwargs: dict
    mask: torch.Tensor | None
    rows: int

    def select(self, rows: torch.Tensor, device: torch.device) -> tuple[tuple, dict]:
        """The call restricted to ``rows`` (tensors of two or more dimensions whose first is ``self.rows``)."""
        take = lambda t: t[rows.to(t.device)] if t.dim() >= 2 and t.shape[0] == self.rows else t  # noqa: E731
        return moved(map_tensors(self.args, take), device), moved(map_tensors(self.kwargs, take), device)


@dataclass
class Calls:
    """A layer's recorded calls as units of rows: one unit when every call has the same shapes (tensors equal
    in every call kept once, batch-major ones concatenated), else one unit per call."""

    units: list[_Unit]

    @classmethod
    def of(cls, calls: list[tuple[tuple, dict, torch.Tensor | None]]) -> Calls:
        units = [_Unit(a, k, m, hidden_of(a, k).shape[0]) for a, k, m in calls]
        if len(units) > 1 and (stacked := _stacked(units)) is not None:
            return cls([stacked])
        return cls(units)

    @property
    def rows(self) -> int:
        return sum(u.rows for u in self.units)

    def accepts(self, carried: list[torch.Tensor]) -> bool:
        """Whether ``carried`` (one tensor per unit) can stand for the units' hidden states."""
        return len(carried) == len(self.units) and all(
            c.shape == hidden_of(u.args, u.kwargs).shape for c, u in zip(carried, self.units, strict=True)
        )

    def batch(
        self, rows: torch.Tensor, reference: list[torch.Tensor], device: torch.device
    ) -> Iterator[tuple]:
        """The global ``rows`` as ``(share of the rows, args, kwargs, mask, target)`` per unit they fall in."""
        start = 0
        for u, unit in enumerate(self.units):
            mine = rows[(rows >= start) & (rows < start + unit.rows)] - start
            start += unit.rows
            if len(mine):
                args, kwargs = unit.select(mine, device)
                mask = None if unit.mask is None else unit.mask[mine.to(unit.mask.device)]
                yield len(mine) / len(rows), args, kwargs, mask, reference[u][mine.to(reference[u].device)]


def _stacked(units: list[_Unit]) -> _Unit | None:
    """``units`` as one, or None when a value differs between them and is not batch-major."""

    def merge(values: list[Any]) -> Any:
        v0 = values[0]
        if isinstance(v0, torch.Tensor):
            if all(
                isinstance(v, torch.Tensor) and v.shape == v0.shape and torch.equal(v, v0) for v in values
            ):
                return v0  # the same in every call (positions, masks of unpadded batches)
            if all(isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == u.rows
                   and v.shape[1:] == v0.shape[1:] for v, u in zip(values, units, strict=True)):  # fmt: skip
                return torch.cat(values)
            raise _Unstackable
        if isinstance(v0, (tuple, list)) and all(type(v) is type(v0) and len(v) == len(v0) for v in values):
            return type(v0)(merge([v[i] for v in values]) for i in range(len(v0)))
        if isinstance(v0, dict) and all(isinstance(v, dict) and v.keys() == v0.keys() for v in values):
            return {k: merge([v[k] for v in values]) for k in v0}
        if all(v is v0 or (type(v) in (int, float, bool, str, type(None)) and v == v0) for v in values):
            return v0
        raise _Unstackable

    try:
        args, kwargs = merge([u.args for u in units]), merge([u.kwargs for u in units])
        masks = [torch.ones(u.rows, hidden_of(u.args, u.kwargs).shape[1], dtype=torch.bool) if u.mask is None
                 else u.mask.bool() for u in units]  # fmt: skip
        if any(m.shape[1:] != masks[0].shape[1:] for m in masks):
            return None
    except _Unstackable:
        return None
    mask = torch.cat([m.cpu() for m in masks])
    rows = sum(u.rows for u in units)
    mask = None if bool(mask.all()) else mask
    return _Unit(args, kwargs, mask, rows) if hidden_of(args, kwargs).shape[0] == rows else None


class _Unstackable(Exception):
    """A recorded value differs between calls in a way that rows cannot be concatenated."""


def hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a decoder layer is called with: its first positional argument, else ``hidden_states``."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        raise ValueError("AutoRoundModifier: a sequential target was called without hidden states as its first "
                         "argument or `hidden_states`; set sequential_targets to the model's decoder layers")  # fmt: skip
    return hidden


def with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    """The call with ``hidden`` in place of its hidden states (see :func:`hidden_of`)."""
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}
