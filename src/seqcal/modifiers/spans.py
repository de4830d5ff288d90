"""Cached calls of a module ("span"), to run it again on the same arguments (AWQ's scale search).

A forward pre-hook records each call's positional and keyword arguments (with the batch's token mask) while
the calibration pass runs; ``SpanCache.outputs`` runs the module again on them. The cache keeps the calls of
each virtual shard (``end_shard`` starts the next) until they would pass ``max_bytes`` (always at least one per
shard), so the memory a search holds is bounded and which calls it holds does not depend on the processes.

Example:
    >>> cache = SpanCache(max_bytes=1 << 30)  # doctest: +SKIP
    >>> handle = module.register_forward_pre_hook(cache.hook(lambda: state.token_mask), with_kwargs=True)  # doctest: +SKIP
    >>> outputs = cache.outputs(module, torch.device("cpu"))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class SpanCache:
    """The recorded calls of one module: ``(args, kwargs, token mask)`` per batch, within ``max_bytes``.

    Args:
        max_bytes: bytes of tensors the recorded calls may hold; later calls are dropped once it is reached.
        device: where recorded tensors wait (None: where they were computed).
    """

    def __init__(self, max_bytes: int, device: str | torch.device | None = None) -> None:
        self.max_bytes, self.device = max_bytes, device
        self.calls: list[tuple[tuple, dict, torch.Tensor | None]] = []
        self.shards: list[int] = []  # the (local) virtual shard of each call
        self.nbytes = 0  # of the current shard's calls
        self.dropped = 0
        self._shard = 0

    def hook(self, token_mask: Callable[[], torch.Tensor | None]) -> Callable[..., None]:
        """A forward pre-hook (``with_kwargs=True``) that records each call; ``token_mask`` gives its mask."""

        def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            call = moved((args, kwargs, token_mask()), self.device)
            size = nbytes(call)
            if self.shards and self.shards[-1] == self._shard and self.nbytes + size > self.max_bytes:
                self.dropped += 1
                return
            self.calls.append(call)
            self.shards.append(self._shard)
            self.nbytes += size

        return record

    def end_shard(self) -> None:
        """The calls recorded from now on belong to the next virtual shard (with a budget of their own)."""
        self._shard += 1
        self.nbytes = 0

    def outputs(self, module: torch.nn.Module, device: torch.device) -> list[torch.Tensor]:
        """``module`` run again on every recorded call (its first output when it returns a tuple)."""
        results = []
        for args, kwargs, _ in self.calls:
            out = module(*moved(args, device), **moved(kwargs, device))
            results.append(out[0] if isinstance(out, (tuple, list)) else out)
        return results

    def masks(self) -> list[torch.Tensor | None]:
        return [mask for _, _, mask in self.calls]


def moved(value: Any, device: str | torch.device | None) -> Any:
    """``value`` (tensors in tuples, lists, dicts) with its tensors detached, on ``device`` (None: in place)."""
    if isinstance(value, torch.Tensor):
        return value.detach() if device is None else value.detach().to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(moved(v, device) for v in value)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    return value


def nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, (tuple, list)):
        return sum(map(nbytes, value))
    return sum(map(nbytes, value.values())) if isinstance(value, dict) else 0
