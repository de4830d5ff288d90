"""Per-module input statistics gathered during calibration: GPTQ's and SparseGPT's Hessians, Wanda's norms.

Modules fed the very same input tensor (q/k/v, gate/up) share one accumulator, filled once per batch,
whether the inputs arrive through forward pre-hooks (subgraphs cut after layers) or through ``observe``
(subgraphs cut before the modules, ``Modifier.input_only``). Padding tokens are dropped first
(``Batch.real``). What is accumulated is the caller's ``add`` function.

Example:
    >>> inputs = SharedInputs(add_hessian("float32"))
    >>> inputs.observe(["q_proj", "k_proj"], torch.randn(1, 4, 8), Batch())
    >>> inputs.acc["q_proj"] is inputs.acc["k_proj"], inputs.acc["q_proj"].n
    (True, 4)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from seqcal.algorithms import accumulate_hessian, symmetrize_upper
from seqcal.modifiers.base import Statistic
from seqcal.modifiers.state import Batch, BatchCursor


@dataclass
class _Accumulator:
    """One statistic (a Hessian, or a vector) shared by every module that reads the same input tensor."""

    H: torch.Tensor | None = None
    n: int = 0
    upper: bool = False  # H is accumulated upper-only (on cpu); symmetrize_upper before it is used
    # H made exactly symmetric from its upper triangle after the last batch (``symmetrize_upper``: the CPU's
    # lower triangle is stale, a GPU's full product equal to the upper's mirror up to rounding), so that a solve
    # keeps its values as half a matrix while its memory serves as scratch (``kept_hessian.KeptHessian``)
    symmetric: bool = False
    # The input most recently added, held so that its identity cannot be reused by a later tensor
    # (comparing data pointers is not enough: the allocator hands freed memory to the next batch).
    last_input: torch.Tensor | None = None
    last_version: int = -1


Add = Callable[[_Accumulator, torch.Tensor], None]


def add_hessian(products: str = "float32") -> Add:
    """``add`` for :class:`SharedInputs` that accumulates ``H = 2 X^T X / tokens`` (upper-only on the cpu)."""

    def add(acc: _Accumulator, X: torch.Tensor) -> None:
        if acc.H is None:  # the CPU's matmul is compute-bound: update only the upper triangle's blocks
            acc.upper = X.device.type == "cpu"
        acc.H, acc.n = accumulate_hessian(acc.H, X, acc.n, getattr(torch, products), upper=acc.upper)

    return add


class SharedInputs:
    """Accumulators by module name; modules reading one input tensor share one (see the module docstring).

    Args:
        add: folds one batch's real tokens ``X [..., in]`` into an accumulator.
    """

    def __init__(self, add: Add) -> None:
        self.add = add
        self.acc: dict[str, _Accumulator] = {}

    @contextlib.contextmanager
    def hooks(self, names: list[str], model: torch.nn.Module, batches: BatchCursor) -> Iterator[None]:
        """Forward pre-hooks on ``names`` for one calibration pass (``batches``: the batch it runs); removed (and
        inputs released) on exit."""
        # id of the first batch's input -> (a weak reference to it, the accumulator)
        shared: dict[int, tuple] = {}
        handles = []
        try:
            for name in names:
                handles.append(
                    model.get_submodule(name).register_forward_pre_hook(self._hook(name, shared, batches))
                )
            yield
        finally:
            for handle in handles:
                handle.remove()
            for acc in self.acc.values():
                acc.last_input = None  # release the last batch's activations

    def _hook(self, name: str, shared: dict, batches: BatchCursor) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0]
            acc = self.acc.get(name)
            if acc is None:  # first batch: modules fed the very same tensor share one accumulator
                # by id while that tensor lives: a later input may get a freed one's id (a whole-model pass)
                held = shared.get(id(x))
                if held is None or held[0]() is not x:
                    held = shared[id(x)] = (weakref.ref(x), _Accumulator())
                acc = self.acc[name] = held[1]
            if acc.last_input is x and acc.last_version == x._version:
                return  # a sibling (q after k, up after gate) already added this input
            acc.last_input, acc.last_version = x, x._version
            self.add(acc, batches.current.real(x.detach()))  # padding tokens carry no signal

        return hook

    def observe(self, names: list[str], x: torch.Tensor, batch: Batch) -> None:
        """One batch's input ``x`` of the modules ``names`` (they all read it)."""
        if not names:
            return
        acc = self.acc.get(names[0])
        if acc is None:  # first batch: the modules reading x share one accumulator
            acc = _Accumulator()
            self.acc.update(dict.fromkeys(names, acc))
        self.add(acc, batch.real(x.detach()))

    def partial_statistics(self, kind: str) -> dict[str, dict[str, Statistic]]:
        """This shard's accumulators (``Modifier.partial_statistics``), then forgotten: per shared accumulator
        ``<kind>:<modules>``, ``H`` as a sum (the running mean times its tokens) and ``tokens``; both add across
        shards.

        Args:
            kind: what the accumulators hold ("hessian", "norms"), the start of each key.
        """
        sharing: dict[int, tuple[_Accumulator, list[str]]] = {}
        for name, acc in self.acc.items():
            if acc.H is not None:
                sharing.setdefault(id(acc), (acc, []))[1].append(name)
        out = {}
        for acc, names in sharing.values():
            if acc.upper:
                symmetrize_upper(acc.H)
            tokens = torch.tensor([acc.n], dtype=torch.int64)
            out[f"{kind}:" + ",".join(sorted(names))] = {
                "H": Statistic(acc.H.mul_(acc.n)),
                "tokens": Statistic(tokens),
            }
        self.acc.clear()
        return out

    def load_statistics(self, reduced: dict[str, dict[str, torch.Tensor]], kind: str) -> None:
        """Accumulators holding every shard's statistics combined (``partial_statistics``' keys of ``kind``)."""
        for key, stats in reduced.items():
            if key.startswith(f"{kind}:"):
                n = int(stats["tokens"].item())
                acc = _Accumulator(H=stats["H"].div_(max(n, 1)), n=n)
                self.acc.update(dict.fromkeys(key[len(kind) + 1 :].split(","), acc))
