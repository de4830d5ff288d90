"""Input-column importance ``E[x_j^2]`` for the ``imatrix_mse`` weight observer (llama.cpp's importance matrix).

For round-to-nearest (QuantizationModifier) the framework sums ``x_j^2`` over the real tokens of each module's
inputs (``IMPORTANCE_GATHERS``, declared statistics: padding excluded) during the calibration pass. GPTQ needs
no second accumulation: its Hessian ``H = 2 X^T X / tokens`` holds the same statistic on its diagonal
(``seqcal.algorithms.importance_from_hessian``). :func:`usable_importance` applies llm-compressor's fallbacks:
without usable statistics the search is uniform (logged), or an error with ``observer_kwargs: {strict: true}``.

Example:
    >>> importance = mean_square(modifier.gathered("model.layers.0.mlp.down_proj"))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from compressed_tensors.quantization import QuantizationScheme
from torch import Tensor

from seqcal.algorithms import check_importance
from seqcal.modifiers.needs import Gather
from seqcal.modifiers.schemes import strategy_of
from seqcal.modifiers.state import RunState

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
    reason = unusable(scheme, importance, in_features)
    if reason is None:
        return importance
    if (scheme.weights.observer_kwargs or {}).get("strict", False):
        raise ValueError(f"{name}: imatrix_mse cannot weight the search ({reason}) and strict is set")
    state.results.log.append(f"{name}: imatrix_mse without importance ({reason}); uniform search")
    return None


def unusable(scheme: QuantizationScheme, importance: Tensor | None, in_features: int) -> str | None:
    """Why the imatrix_mse search of ``scheme`` cannot weigh by ``importance`` (it then searches uniformly), or
    None when it can."""
    if strategy_of(scheme.weights) == "tensor":
        return "the tensor strategy has no per-column search"
    return check_importance(importance, in_features)


# imatrix_mse's statistics of a module's inputs, gathered by the framework (``Modifier.gathers``): the sum of
# ``x_j^2`` over the real tokens (float32, as llm-compressor's) and the token count.
IMPORTANCE_GATHERS = (
    Gather("imatrix_sq", lambda x: x.pow(2).sum(dim=0)),
    Gather("imatrix_tokens", lambda x: torch.tensor([x.shape[0]], device=x.device)),
)


def mean_square(gathered: Mapping[str, Tensor] | None) -> Tensor | None:
    """``E[x_j^2]`` ``[in]`` from a module's ``IMPORTANCE_GATHERS`` (None when no input reached it).

    Example:
        >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> mean_square({g.name: g.of(x) for g in IMPORTANCE_GATHERS})
        tensor([ 5., 10.])
    """
    if gathered is None:
        return None
    count = int(gathered["imatrix_tokens"].sum().item())
    return None if count == 0 else gathered["imatrix_sq"] / count
