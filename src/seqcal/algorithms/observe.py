"""Weight observers: the range ``(w_min, w_max)`` per qparam from which a weight's scale is computed.

Names and settings are llm-compressor's weight observers (a weight is observed once, so the moving-average
and memoryless variants are the same here):

    minmax, static_minmax, memoryless_minmax   the min / max of each qparam's weights
    mse, memoryless_mse                        the min / max shrunk by ``p`` to minimise ``sum |Q(w) - w| ** norm``
    imatrix_mse                                the same search, each error weighted by its input column's
                                               importance ``E[x_j ** 2]`` (llama.cpp's importance matrix)

The shrink search tries ``p = 1, 1 - 1/grid, 1 - 2/grid, ...`` per qparam row and keeps the ``p`` with the
lowest error, stopping after ``patience`` steps in a row without any row improving. With ``W [out, in]``,
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

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from seqcal.algorithms.quant import (
    QuantType,
    Strategy,
    _as_rows,
    _qparams_shape,
    compute_qparams,
    fake_quantize,
    quant_range,
)

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


def _row_weights(importance: Tensor, W: Tensor, strategy: Strategy, group_size: int | None) -> Tensor:
    """Importance ``[in]`` as a factor per element of ``_as_rows(W)`` (normalised to mean 1)."""
    a = importance.to(device=W.device, dtype=torch.float32)
    a = a / (a.mean() + torch.finfo(torch.float32).tiny)
    if strategy == "channel":
        return a.reshape(1, -1)  # [1, in] against rows [out, in]
    G = W.shape[-1] // group_size
    return a.reshape(1, G, group_size).expand(W.shape[0], G, group_size).reshape(-1, group_size)


# Rows per chunk of the CPU search: 64k float32 values (256 KB) stay in a core's L2 cache through all of a
# candidate's elementwise steps, where whole-weight temporaries stream through memory once per step.
_CHUNK_VALUES = 1 << 16


class _CandidateErrors:
    """``sum_k a_k |Q(w_k) - w_k| ** norm`` per row of ``rows`` for one candidate's qparams.

    The int float32 case is computed in place in a reused buffer, chunk by chunk on the CPU: the same
    operations in the same order as ``fake_quantize`` (``w / s + z``, clamp, round, ``- z``, ``* s``; its int8
    round trip is exact for these integral values), so the errors are equal bit for bit, at a fraction of the
    memory traffic (6-8x faster for a [1536, 576] weight in groups of 64 on one core). Other dtypes and fp8
    take ``fake_quantize`` itself. torch has no fused kernel for this; ``torch.compile`` would cost more to
    compile than a search takes.
    """

    def __init__(self, rows: Tensor, weights: Tensor | None, *, num_bits: int, symmetric: bool,
                 type: QuantType, norm: float) -> None:  # fmt: skip
        self.rows, self.weights, self.norm = rows, weights, norm
        self.num_bits, self.symmetric, self.type = num_bits, symmetric, type
        self.fused = type == "int" and rows.dtype == torch.float32
        if not self.fused:
            self.rows32 = rows.float()
            return
        R, k = rows.shape
        self.step = max(1, _CHUNK_VALUES // k) if rows.device.type == "cpu" else R
        self.buf = torch.empty(min(self.step, R), k, dtype=rows.dtype, device=rows.device)
        self.err = torch.empty(R, dtype=torch.float32, device=rows.device)

    def __call__(self, scale: Tensor, zero: Tensor) -> Tensor:
        rows, weights = self.rows, self.weights
        if not self.fused:
            Q = fake_quantize(rows, scale, zero, num_bits=self.num_bits, type=self.type)
            err = (Q.float() - self.rows32).abs_().pow_(self.norm)
            return (err if weights is None else err.mul_(weights)).sum(dim=-1)
        qmin, qmax = quant_range(self.num_bits, self.type)
        z = None if self.symmetric else zero.to(rows.dtype)
        for r0 in range(0, rows.shape[0], self.step):
            r1 = min(r0 + self.step, rows.shape[0])
            x, w, s = self.buf[: r1 - r0], rows[r0:r1], scale[r0:r1]
            torch.div(w, s, out=x)
            if z is not None:
                x.add_(z[r0:r1])
            x.clamp_(qmin, qmax).round_()
            if z is not None:
                x.sub_(z[r0:r1])
            x.mul_(s).sub_(w).abs_().pow_(self.norm)
            if weights is not None:
                x.mul_(weights if weights.shape[0] == 1 else weights[r0:r1])  # [1, in] for channel rows
            torch.sum(x, dim=-1, out=self.err[r0:r1])
        return self.err


def shrink_search(
    W: Tensor,
    *,
    strategy: Strategy,
    num_bits: int,
    symmetric: bool,
    group_size: int | None = None,
    type: QuantType = "int",
    shrinks: list[float],
    patience: int | None,
    norm: float,
    expand: float = 1.0,
    importance: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The range per qparam ``p * expand * (min, max)`` with ``p`` from ``shrinks`` minimising the error.

    Args:
        W: weight ``[out, in]``.
        strategy, group_size, num_bits, symmetric, type: the target format (candidates are quantized with it).
        shrinks: the factors ``p`` to try, in order.
        patience: stop after this many candidates in a row improve no row; None: try them all.
        norm: error exponent.
        expand: factor on the min / max before shrinking (llm-compressor's ``expand``).
        importance: ``[in]`` non-negative weight of each input column's errors (channel and group only), or None.

    Returns:
        ``(w_min, w_max)`` shaped like :func:`observe_minmax`'s.

    Example:
        >>> lo, hi = shrink_search(torch.randn(4, 8), strategy="channel", num_bits=4, symmetric=True,
        ...                        shrinks=[1.0, 0.9], patience=None, norm=2.0)
    """
    rows = _as_rows(W, strategy, group_size)  # [R, k]
    weights = None if importance is None else _row_weights(importance, W, strategy, group_size)
    lo, hi = rows.amin(dim=-1) * expand, rows.amax(dim=-1) * expand  # [R]
    best_lo, best_hi = lo.clone(), hi.clone()
    best_err = torch.full(lo.shape, math.inf, dtype=torch.float32, device=W.device)
    stale = 0
    errors = _CandidateErrors(rows, weights, num_bits=num_bits, symmetric=symmetric, type=type, norm=norm)
    for p in shrinks:
        scale, zero = compute_qparams(p * lo, p * hi, num_bits=num_bits, symmetric=symmetric, type=type)
        err = errors(scale.reshape(-1, 1), zero.reshape(-1, 1))  # [R]
        better = err < best_err
        if better.any():
            best_err[better], best_lo[better], best_hi[better] = err[better], p * lo[better], p * hi[better]
            stale = 0
        else:
            stale += 1
            if patience is not None and stale >= patience:
                break
    shape = _qparams_shape(W, strategy, group_size)
    return best_lo.reshape(shape), best_hi.reshape(shape)


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
