"""Input-column importance ``E[x_j^2]`` for the ``imatrix_mse`` weight observer (llama.cpp's importance matrix).

For round-to-nearest (QuantizationModifier) ``ImportanceCalibration`` sums ``x_j^2`` over the real tokens of
each module's inputs (padding excluded, ``Batch.real``) during the calibration pass. GPTQ needs
no second accumulation: its Hessian ``H = 2 X^T X / tokens`` holds the same statistic on its diagonal
(``seqcal.algorithms.importance_from_hessian``). :func:`usable_importance` applies llm-compressor's fallbacks:
without usable statistics the search is uniform (logged), or an error with ``observer_kwargs: {strict: true}``.

Example:
    >>> calib = ImportanceCalibration({"fc": scheme})  # doctest: +SKIP
    >>> calib.observe(["fc"], x, state, Batch()); calib.mean_square("fc")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationScheme
from torch import Tensor

from seqcal.algorithms import check_importance
from seqcal.modifiers.schemes import strategy_of
from seqcal.modifiers.state import Batch, BatchCursor, RunState
from seqcal.records import Statistic

IMATRIX = "imatrix_mse"


def uses_importance(scheme: QuantizationScheme) -> bool:
    """Whether the scheme's weight observer needs the inputs' importance (``imatrix_mse``)."""
    return scheme.weights is not None and scheme.weights.observer == IMATRIX


def usable_importance(
    name: str, scheme: QuantizationScheme, importance: Tensor | None, in_features: int, state: RunState
) -> Tensor | None:
    """``importance`` when the search can use it; else None (uniform search), logged, or an error when strict.

    Args:
        name: the module, for the log.
        scheme: its scheme (``weights.observer_kwargs.strict``).
        importance: ``[in]`` mean squared input per column, or None when none was collected.
        in_features: the weight's columns.
        state: the run state (its ``results.log``).

    Returns:
        The importance, or None.

    Raises:
        ValueError: the importance is unusable and the observer is strict.
    """
    if not uses_importance(scheme):
        return None
    if strategy_of(scheme.weights) == "tensor":
        reason: str | None = "the tensor strategy has no per-column search"
    else:
        reason = check_importance(importance, in_features)
    if reason is None:
        return importance
    if (scheme.weights.observer_kwargs or {}).get("strict", False):
        raise ValueError(f"{name}: imatrix_mse cannot weight the search ({reason}) and strict is set")
    state.results.log.append(f"{name}: imatrix_mse without importance ({reason}); uniform search")
    return None


class ImportanceCalibration:
    """Running ``sum_t x_tj^2`` and token count of the inputs of the modules whose weights use ``imatrix_mse``.

    Args:
        schemes: module name -> scheme (only ``imatrix_mse`` weights are observed).
    """

    def __init__(self, schemes: Mapping[str, QuantizationScheme]) -> None:
        self.names = {n for n, s in schemes.items() if uses_importance(s)}
        self.sums: dict[str, tuple[Tensor, int]] = {}
        # the last input and its column sums: q/k/v (gate/up) read the same tensor
        self._last: tuple[Tensor | None, int, tuple[Tensor, int] | None] = (None, -1, None)

    def __bool__(self) -> bool:
        return bool(self.names)

    def observe(self, names: list[str], x: Tensor, state: RunState, batch: Batch) -> None:
        """Add one batch's input ``x [..., in]`` of the modules ``names`` (others are skipped)."""
        mine = [n for n in names if n in self.names and n not in state.results.quantized]
        if not mine:
            return
        last, version, summed = self._last
        if summed is None or last is not x or version != x._version:
            X = batch.real(x.detach())  # padding tokens carry no signal
            summed = (X.float().pow(2).sum(dim=0), X.shape[0])  # float32 sums, as llm-compressor's
            self._last = (x, x._version, summed)
        for name in mine:
            total, count = self.sums.get(name, (None, 0))
            self.sums[name] = (
                summed[0].clone() if total is None else total.add_(summed[0]),
                count + summed[1],
            )

    @contextlib.contextmanager
    def hooks(
        self, names: list[str], model: torch.nn.Module, state: RunState, batches: BatchCursor
    ) -> Iterator[None]:
        """Observe the inputs of ``names`` during a calibration pass (removed on exit, also on error)."""
        handles = []
        try:
            for name in [n for n in names if n in self.names]:
                hook = lambda module, args, name=name: self.observe([name], args[0], state, batches.current)  # noqa: E731
                handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._last = (None, -1, None)  # release the last batch's activations

    def partial_statistics(self) -> dict[str, dict[str, Any]]:
        """This shard's sums (``Modifier.partial_statistics``), then forgotten: per module ``importance:<name>``,
        ``sum`` (of ``x_j^2``, float32) and ``tokens``; both add across shards."""
        out = {f"importance:{name}": {"sum": Statistic(total), "tokens": Statistic(torch.tensor([count]))}
               for name, (total, count) in self.sums.items()}  # fmt: skip
        self.sums.clear()
        self._last = (None, -1, None)
        return out

    def load_statistics(self, reduced: Mapping[str, Mapping[str, Tensor]]) -> None:
        """The sums of every shard combined (``partial_statistics``' keys), for ``mean_square``."""
        for key, stats in reduced.items():
            if key.startswith("importance:"):
                self.sums[key[len("importance:") :]] = (stats["sum"], int(stats["tokens"].item()))

    def mean_square(self, name: str) -> Tensor | None:
        """``E[x_j^2]`` ``[in]`` of ``name``'s inputs (its sums are freed), or None when none was seen."""
        total, count = self.sums.pop(name, (None, 0))
        return None if total is None or count == 0 else total / count
