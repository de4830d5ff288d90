"""Services of the modifier API for searches and learned rounding: a span's outputs, re-runs, gradients.

A *span* is a module of the subgraph being calibrated (a Linear, an MLP, an attention block, a decoder
layer). A forward pre-hook records each call's positional and keyword arguments (with the batch's token mask)
while the calibration pass runs; then, in ``compress``:

- ``SpanCache.outputs(module, device)`` runs the span again on every recorded call;
- ``run(module, device, i)`` runs it on call ``i`` alone (a search that scores candidates on some calls first);
- ``outputs(module, device, overrides={"down_proj.weight": W})`` does so with temporary parameters (the
  module is not changed: ``torch.func.functional_call``), e.g. a grid search over candidate scales (AWQ);
- ``gradients(module, device, params, overrides_of, loss)`` re-runs it differentiably with parameters
  computed from ``params`` and accumulates ``d loss / d params`` into ``params[k].grad`` (AutoRound-like
  learned rounding: examples/learned_rounding.py).

``observe_outputs`` hands a pass's module outputs to a modifier (the outputs of a group). The cache keeps
calls of each virtual shard (``end_shard`` starts the next) until they would pass ``max_bytes`` (always at
least one per shard), so the memory a search holds is bounded and which calls it holds does not depend on the
processes; the span is inside the onloaded subgraph, so re-runs stay within the run's memory bound.

Example:
    >>> cache = SpanCache(max_bytes=1 << 30)  # doctest: +SKIP
    >>> handle = module.register_forward_pre_hook(cache.hook(lambda: batches.current.token_mask), with_kwargs=True)  # doctest: +SKIP
    >>> outputs = cache.outputs(module, torch.device("cpu"))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.func import functional_call

from seqcal.backend import linears_on_onednn


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

    def outputs(
        self,
        module: torch.nn.Module,
        device: torch.device,
        overrides: Mapping[str, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """``module`` run again on every recorded call (its first output when it returns a tuple).

        Args:
            module: the span (the module whose calls were recorded).
            device: where to run.
            overrides: parameter or buffer names relative to ``module`` -> tensors used instead of them for
                these runs only (the module keeps its own).
        """
        return [self._run(module, device, overrides, call) for call in self.calls]

    def run(self, module: torch.nn.Module, device: torch.device, index: int) -> torch.Tensor:
        """``module`` run again on recorded call ``index`` alone (as ``outputs``, one call at a time)."""
        return self._run(module, device, None, self.calls[index])

    def gradients(
        self,
        module: torch.nn.Module,
        device: torch.device,
        params: Mapping[str, torch.Tensor],
        overrides_of: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
        loss: Callable[[torch.Tensor, int], torch.Tensor],
    ) -> float:
        """Re-run the span differentiably and accumulate ``d loss / d params`` into ``params[k].grad``.

        Args:
            module: the span.
            device: where to run.
            params: leaf tensors with ``requires_grad`` (e.g. rounding offsets), yours to update after.
            overrides_of: ``params`` -> parameters of ``module`` to use (e.g. the fake-quantized weight), as
                in ``outputs``; the module's other parameters take no gradient.
            loss: (output of recorded call i, i) -> scalar; one backward per call, so one call's graph is
                alive at a time.

        Returns:
            The summed loss over the recorded calls.
        """
        frozen = {k: v.detach() for k, v in module.named_parameters()}
        total = 0.0
        with torch.enable_grad():
            for i, call in enumerate(self.calls):
                value = loss(self._run(module, device, {**frozen, **overrides_of(params)}, call), i)
                value.backward()
                total += value.item()
        return total

    def _run(self, module: torch.nn.Module, device: torch.device, overrides: Mapping[str, Any] | None,
             call: tuple[tuple, dict, torch.Tensor | None]) -> torch.Tensor:  # fmt: skip
        args, kwargs = moved(call[0], device), moved(call[1], device)
        with linears_on_onednn(device):  # float32 Linears on oneDNN where MKL is slow (products)
            out = (
                functional_call(module, dict(overrides), args, kwargs)
                if overrides
                else module(*args, **kwargs)
            )
        return out[0] if isinstance(out, (tuple, list)) else out

    def masks(self) -> list[torch.Tensor | None]:
        return [mask for _, _, mask in self.calls]


def map_tensors(value: Any, fn: Any) -> Any:
    """``value`` with ``fn`` applied to each tensor in it (tuples, lists, dicts); anything else as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


def moved(value: Any, device: str | torch.device | None) -> Any:
    """``value`` (tensors in tuples, lists, dicts) with its tensors detached, on ``device`` (None: in place)."""
    return map_tensors(value, lambda t: t.detach() if device is None else t.detach().to(device))


def nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, (tuple, list)):
        return sum(map(nbytes, value))
    return sum(map(nbytes, value.values())) if isinstance(value, dict) else 0


@contextlib.contextmanager
def observe_outputs(
    model: torch.nn.Module,
    names: Iterable[str],
    observe: Callable[[str, torch.Tensor, torch.Tensor | None], None],
    token_mask: Callable[[], torch.Tensor | None],
) -> Iterator[None]:
    """During the block, every output of the modules ``names`` goes to ``observe(name, output, token_mask)``
    (the first element when a module returns a tuple): the outputs of a group, from the same pass as its
    inputs (use it in ``calibrate``; the hooks are removed on exit, also on error).

    Example:
        >>> with observe_outputs(model, ["model.layers.0.mlp"], record, lambda: batches.current.token_mask):  # doctest: +SKIP
        ...     yield
    """

    def hook(name: str) -> Callable[..., None]:
        def forward_hook(module: torch.nn.Module, args: tuple, out: Any) -> None:
            observe(name, (out[0] if isinstance(out, (tuple, list)) else out).detach(), token_mask())

        return forward_hook

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
