"""Weight observers: the range ``(w_min, w_max)`` per qparam from which a weight's scale is computed.

Names and settings are llm-compressor's weight observers (a weight is observed once, so the moving-average
and memoryless variants are the same here):

    minmax, static_minmax, memoryless_minmax   the min / max of each qparam's weights
    mse, memoryless_mse                        the min / max shrunk by ``p`` to minimise ``sum |Q(w) - w| ** norm``
    imatrix_mse                                the same search, each error weighted by its input column's
                                               importance ``E[x_j ** 2]`` (llama.cpp's importance matrix)

The shrink search (``seqcal.algorithms.range_search``) tries ``p = 1, 1 - 1/grid, 1 - 2/grid, ...`` per
qparam row and keeps the ``p`` with the lowest error, stopping after ``patience`` steps in a row without any
row improving. With ``W [out, in]``,
the rows of qparam ``g`` (columns ``J_g``) and importance ``a_j = E[x_j^2] / mean_k E[x_k^2]``:

    err_g(p) = sum_{i, j in J_g} a_j |Q_p(W_ij) - W_ij| ** norm      (a_j = 1 for mse)

``imatrix_mse`` has its own defaults (maxshrink 0.95, grid 20, norm 3.0, its last step included, patience 0
meaning no early stop); without a usable importance (tensor strategy, none collected) it is the uniform search
with those settings, as in llm-compressor. Errors are summed in float32; candidates are quantized in W's dtype.

Example:
    >>> W = torch.randn(8, 64)
    >>> lo, hi = observe_weight(W, "imatrix_mse", strategy="group", group_size=32, num_bits=4,
    ...                         symmetric=True, importance=torch.rand(64))
    >>> lo.shape
    torch.Size([8, 2])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from seqcal.algorithms.quant import QuantType, Strategy, _as_rows, _qparams_shape, compute_qparams
from seqcal.algorithms.range_search import shrink_search

# llm-compressor's defaults per search (observers/mse.py and observers/imatrix.py)
MSE_DEFAULTS: dict[str, float] = {"maxshrink": 0.2, "grid": 100.0, "patience": 5, "norm": 2.4, "expand": 1.0}
IMATRIX_DEFAULTS: dict[str, float] = {
    "maxshrink": 0.95,
    "grid": 20,
    "patience": 5,
    "norm": 3.0,
    "expand": 1.0,
}


def observe_minmax(W: Tensor, *, strategy: Strategy, group_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Min-max observer (compressed-tensors / llm-compressor ``"minmax"``).

    Args:
        W: weight ``[out, in]``.
        strategy: ``"tensor"``, ``"channel"`` or ``"group"``.
        group_size: columns per group (group strategy only).

    Returns:
        ``(w_min, w_max)`` shaped ``[]`` (tensor), ``[out, 1]`` (channel) or ``[out, G]`` (group),
        in W's dtype.

    Example:
        >>> lo, hi = observe_minmax(torch.randn(8, 64), strategy="group", group_size=32)
        >>> lo.shape
        torch.Size([8, 2])
    """
    rows = _as_rows(W, strategy, group_size)  # [R, k]
    shape = _qparams_shape(W, strategy, group_size)
    return rows.amin(dim=-1).reshape(shape), rows.amax(dim=-1).reshape(shape)


def observe_mse(
    W: Tensor, *, strategy: Strategy, num_bits: int, symmetric: bool, group_size: int | None = None,
    type: QuantType = "int", maxshrink: float = 0.2, grid: float = 100, patience: int = 5, norm: float = 2.4,
    expand: float = 1.0, importance: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """llm-compressor's ``"mse"`` search: ``p = 1 - i / grid`` for ``i < int(maxshrink * grid)``.

    Args:
        W, strategy, group_size, num_bits, symmetric, type: as in :func:`shrink_search`.
        maxshrink, grid, patience, norm, expand: the ``observer_kwargs`` (defaults ``MSE_DEFAULTS``).
        importance: optional ``[in]`` column weights.

    Returns:
        ``(w_min, w_max)`` shaped like :func:`observe_minmax`'s.

    Example:
        >>> lo, hi = observe_mse(torch.randn(8, 64), strategy="channel", num_bits=4, symmetric=True)
    """
    shrinks = [1 - i / grid for i in range(int(maxshrink * grid))]
    return shrink_search(
        W, strategy=strategy, num_bits=num_bits, symmetric=symmetric, group_size=group_size, type=type,
        shrinks=shrinks, patience=int(patience), norm=norm, expand=expand, importance=importance,
    )  # fmt: skip


def observe_imatrix_mse(
    W: Tensor, *, strategy: Strategy, num_bits: int, symmetric: bool, group_size: int | None = None,
    type: QuantType = "int", maxshrink: float = 0.95, grid: float = 20, patience: int = 5, norm: float = 3.0,
    expand: float = 1.0, importance: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """llm-compressor's ``"imatrix_mse"`` search: ``p = 1 - i / grid`` for ``i <= max(1, int(maxshrink * grid))``.

    The importance is ignored for the tensor strategy (uniform search), as in llm-compressor.

    Args:
        W, strategy, group_size, num_bits, symmetric, type: as in :func:`shrink_search`.
        maxshrink, grid, patience, norm, expand: the ``observer_kwargs`` (``IMATRIX_DEFAULTS``); patience 0
            never stops early.
        importance: ``[in]`` mean squared input of each column (:func:`importance_from_hessian`), or None.

    Returns:
        ``(w_min, w_max)`` shaped like :func:`observe_minmax`'s.

    Example:
        >>> W = torch.randn(8, 64)
        >>> lo, hi = observe_imatrix_mse(W, strategy="channel", num_bits=4, symmetric=True, importance=torch.rand(64))
    """
    shrinks = [1 - i / grid for i in range(max(1, int(maxshrink * grid)) + 1)]
    return shrink_search(
        W, strategy=strategy, num_bits=num_bits, symmetric=symmetric, group_size=group_size, type=type,
        shrinks=shrinks, patience=int(patience) or None, norm=norm, expand=expand,
        importance=None if strategy == "tensor" else importance,
    )  # fmt: skip


def _minmax(
    W: Tensor, *, strategy: Strategy, group_size: int | None = None, **_: Any
) -> tuple[Tensor, Tensor]:
    return observe_minmax(W, strategy=strategy, group_size=group_size)


# Weight observer name (llm-compressor's) -> search. A literal dict: a miss lists these names.
OBSERVERS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "minmax": _minmax,
    "static_minmax": _minmax,
    "memoryless_minmax": _minmax,
    "mse": observe_mse,
    "memoryless_mse": observe_mse,
    "imatrix_mse": observe_imatrix_mse,
}
# The observer_kwargs each search reads (others, e.g. averaging_constant or strict, are not search settings).
SEARCH_KWARGS: dict[str, tuple[str, ...]] = {
    "mse": tuple(MSE_DEFAULTS), "memoryless_mse": tuple(MSE_DEFAULTS), "imatrix_mse": tuple(IMATRIX_DEFAULTS),
}  # fmt: skip


def observe_weight(
    W: Tensor, observer: str, *, strategy: Strategy, num_bits: int, symmetric: bool, group_size: int | None = None,
    type: QuantType = "int", observer_kwargs: Mapping[str, Any] | None = None, importance: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The range ``(w_min, w_max)`` of ``W`` per qparam, by the weight observer named ``observer``.

    Args:
        W: weight ``[out, in]``.
        observer: a name of ``OBSERVERS``.
        strategy, group_size, num_bits, symmetric, type: the target format.
        observer_kwargs: the scheme's ``observer_kwargs`` (search settings; others are ignored).
        importance: ``[in]`` column importance for ``imatrix_mse`` (ignored by the others).

    Returns:
        ``(w_min, w_max)`` shaped like :func:`observe_minmax`'s.

    Raises:
        ValueError: an unknown observer name.

    Example:
        >>> lo, hi = observe_weight(torch.randn(8, 64), "mse", strategy="channel", num_bits=4, symmetric=True)
        >>> lo.shape
        torch.Size([8, 1])
    """
    if observer not in OBSERVERS:
        raise ValueError(f"unknown weight observer {observer!r}; valid: {', '.join(OBSERVERS)}")
    kw = {k: v for k, v in (observer_kwargs or {}).items() if k in SEARCH_KWARGS.get(observer, ())}
    if observer == "imatrix_mse":
        kw["importance"] = importance
    return OBSERVERS[observer](
        W, strategy=strategy, num_bits=num_bits, symmetric=symmetric, group_size=group_size, type=type, **kw
    )


def weight_qparams(
    W: Tensor, *, num_bits: int, symmetric: bool, strategy: Strategy, group_size: int | None = None,
    type: QuantType = "int", observer: str = "minmax", observer_kwargs: Mapping[str, Any] | None = None,
    importance: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Observe ``W`` and compute its qparams, in W's dtype (as llm-compressor does for RTN).

    Args:
        W: weight ``[out, in]``.
        num_bits, symmetric, type: the target format.
        strategy, group_size: qparam granularity.
        observer, observer_kwargs, importance: as in :func:`observe_weight`.

    Returns:
        ``(scale, zero_point)`` with the shapes listed in ``seqcal.algorithms.quant``.

    Example:
        >>> s, z = weight_qparams(torch.randn(8, 64), num_bits=4, symmetric=True, strategy="group", group_size=32)
        >>> s.shape, z.dtype
        (torch.Size([8, 2]), torch.int8)
    """
    w_min, w_max = observe_weight(
        W, observer, strategy=strategy, num_bits=num_bits, symmetric=symmetric, group_size=group_size,
        type=type, observer_kwargs=observer_kwargs, importance=importance,
    )  # fmt: skip
    return compute_qparams(w_min, w_max, num_bits=num_bits, symmetric=symmetric, type=type)


def importance_from_hessian(H: Tensor) -> Tensor:
    """``E[x_j^2]`` per input column from the GPTQ Hessian ``H = 2 X^T X / tokens``: ``diag(H) / 2``.

    Example:
        >>> importance_from_hessian(2 * torch.eye(3))
        tensor([1., 1., 1.])
    """
    return H.diagonal().float() / 2


def check_importance(importance: Tensor | None, in_features: int) -> str | None:
    """Why ``importance`` cannot weight the search (llm-compressor's fallbacks to uniform), or None when it can.

    Example:
        >>> check_importance(torch.zeros(4), 4)
        'all importances are zero'
    """
    if importance is None:
        return "no calibration input was seen"
    if importance.numel() != in_features:
        return f"{importance.numel()} importances for {in_features} input columns"
    if not bool(torch.isfinite(importance).all()):
        return "importances are not finite"
    if bool((importance < 0).any()):
        return "importances are negative"
    if not bool((importance != 0).any()):
        return "all importances are zero"
    return None
