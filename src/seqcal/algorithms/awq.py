"""AWQ (Lin et al., 2023, "Activation-aware Weight Quantization"): per-channel scales, pure tensor math.

Notation (the paper's, with llm-compressor's refinements):

    X        inputs of the balance layers (the Linears that read the smoothed activation), [tokens, in]
    x_mean   mean |X| per input channel, [in]
    w_mean   mean over output rows of |W| / max|W of its quantization group|, per input channel, [in]
             (the balance layers' rows pooled; "duo scaling" uses it)
    s        s = x_mean^r / w_mean^(1-r)   (duo scaling)   or   s = x_mean^r   (activations only)
             for ratios r on a grid in [0, 1], normalised to s / sqrt(max(s) * min(s))
    loss(s)  MSE between the span's float output and its output with every balance weight replaced by
             Q(W * s) / s  (Q: the scheme's round-to-nearest), i.e. Q(W s)(s^-1 X)
             (a span that is the balance Linear itself: from the Gram matrix of its inputs, ``linear_error``)

The scale with the lowest loss is kept; folding 1/s into the producer and s into the balance weights keeps
the float model unchanged (``seqcal.mappings.fold_scales``). Running the span and
quantizing weights is the caller's part: ``search_scales`` takes the loss as a function.

Example:
    >>> x_mean = torch.tensor([1.0, 4.0]); w_mean = torch.tensor([0.5, 0.5])
    >>> result = search_scales(lambda s: float((s - 2).abs().sum()), x_mean, w_mean, n_grid=5)
    >>> result.ratio in [r for r, _ in grid_points(5, True)]
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from seqcal.algorithms.hessian import add_products
from seqcal.algorithms.output_error import quadratic_forms

DUO_SCALING: tuple[object, ...] = (True, False, "both")


def grid_points(n_grid: int, duo_scaling: bool | str = True) -> list[tuple[float, bool]]:
    """The (ratio, duo) pairs the search tries, in llm-compressor's order.

    Args:
        n_grid: number of points (>= 2).
        duo_scaling: True (the identity scale, then n_grid - 1 ratios with weights), False (n_grid ratios from
            activations only) or "both" (n_grid // 2 ratios, each with and without weights).

    Returns:
        A list of ``(ratio in [0, 1], use weights)``.

    Example:
        >>> grid_points(3, False)
        [(0.0, False), (0.5, False), (1.0, False)]
    """
    if duo_scaling == "both":
        half = n_grid // 2
        return [(i / (half - 1), duo) for i in range(half) for duo in (False, True)]
    if duo_scaling is False:
        return [(i / (n_grid - 1), False) for i in range(n_grid)]
    if duo_scaling is True:  # the identity scale (ratio 0 without weights) is always among the candidates
        return [(0.0, False)] + [(i / (n_grid - 2), True) for i in range(n_grid - 1)]
    raise ValueError(f"duo_scaling must be one of {DUO_SCALING}, got {duo_scaling!r}")


def add_channel_abs(total: Tensor | None, X: Tensor) -> Tensor:
    """Add ``sum |X|`` over tokens (``X [tokens, in]``) to the running float32 ``total [in]``."""
    batch = X.detach().abs().sum(dim=0, dtype=torch.float32)
    return batch if total is None else total + batch.to(total.device)


def weight_mean(weights: Sequence[Tensor], group_size: int | None) -> Tensor:
    """Mean normalised magnitude per input channel of the balance weights (``w_mean``).

    Each weight ``[out, in]`` is cut into its quantization groups along the input (``group_size`` columns;
    None: whole rows, the per-channel case), divided by the group's max |W| (+1e-6), and averaged over all
    output rows of all weights.

    Args:
        weights: the balance layers' weights, same ``in``.
        group_size: columns per quantization group, None for per-channel (or per-tensor) schemes.

    Returns:
        float32 ``[in]``.
    """
    total, rows = None, 0
    for W in weights:
        out_features, in_features = W.shape
        size = group_size or in_features
        A = W.detach().float().abs().reshape(-1, size)  # [out * in / size, size]
        A = (A / (A.amax(dim=1, keepdim=True) + 1e-6)).reshape(out_features, in_features)
        total = A.sum(dim=0) if total is None else total + A.sum(dim=0)
        rows += out_features
    assert total is not None, "weight_mean needs at least one weight"
    return total / rows


def awq_scales(x_mean: Tensor, w_mean: Tensor | None, ratio: float, duo: bool) -> Tensor:
    """The candidate scale ``s [in]`` for one grid point, normalised to ``s / sqrt(max(s) min(s))``.

    Args:
        x_mean: mean |X| per channel ``[in]``.
        w_mean: ``weight_mean`` of the balance layers ``[in]`` (needed when ``duo``).
        ratio: the exponent r in [0, 1].
        duo: use the weights (s = x^r / w^(1-r)) or the activations only (s = x^r).
    """
    if duo:
        assert w_mean is not None, "duo scaling needs w_mean"
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    else:
        s = x_mean.pow(ratio).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))  # a degenerate channel keeps scale 1


@dataclass
class ScaleSearch:
    """The result of ``search_scales``: the best scale, its loss, and every grid point's loss."""

    scales: Tensor  # [in], float32
    loss: float
    ratio: float
    duo: bool
    initial_loss: float  # the first grid point's loss (the identity scale for duo_scaling True/False)
    history: list[tuple[float, bool, float]] = field(default_factory=list)  # (ratio, duo, loss)


def search_scales(
    loss: Callable[[Tensor], float],
    x_mean: Tensor,
    w_mean: Tensor | None,
    n_grid: int = 20,
    duo_scaling: bool | str = True,
) -> ScaleSearch:
    """Grid search over ``grid_points``: the scale whose ``loss(s)`` is lowest (the first one on ties).

    Args:
        loss: maps a candidate ``s [in]`` to the span's output MSE with Q(W s)/s weights.
        x_mean: mean |X| per channel ``[in]``.
        w_mean: ``weight_mean`` (None when ``duo_scaling`` is False).
        n_grid, duo_scaling: as in ``grid_points``.

    Returns:
        ScaleSearch.

    Raises:
        FloatingPointError: no grid point gave a finite loss (NaN or inf in the span's output).
    """
    return search_all_scales(lambda candidates: [float(loss(s)) for s in candidates], x_mean, w_mean, n_grid,
                             duo_scaling)  # fmt: skip


def search_all_scales(
    losses: Callable[[list[Tensor]], list[float]],
    x_mean: Tensor,
    w_mean: Tensor | None,
    n_grid: int = 20,
    duo_scaling: bool | str = True,
) -> ScaleSearch:
    """``search_scales`` with every candidate scored at once: ``losses`` maps the candidates (in
    ``grid_points`` order) to their losses, so that a caller may add them up over several processes first.

    Example:
        >>> search_all_scales(lambda c: [float((s - 2).abs().sum()) for s in c], torch.ones(4), None, 5, False).ratio
        0.0
    """
    points = grid_points(n_grid, duo_scaling)
    candidates = [awq_scales(x_mean, w_mean, ratio, duo) for ratio, duo in points]
    values = [float(v) for v in losses(candidates)]
    best: ScaleSearch | None = None
    history = [(ratio, duo, value) for (ratio, duo), value in zip(points, values)]
    for (ratio, duo), s, value in zip(points, candidates, values):
        if value == value and value != float("inf") and (best is None or value < best.loss):
            best = ScaleSearch(s.clone(), value, ratio, duo, history[0][2])
    if best is None:
        raise FloatingPointError("no grid point gave a finite loss: the span's output holds NaN or inf")
    best.history = history
    return best


def shortlist(losses: Sequence[float], keep: int) -> list[int]:
    """The grid points worth scoring on every token after a screening pass: the first point (the identity scale
    for ``duo_scaling`` True/False/"both", so the search never ends worse than plain round-to-nearest) and the
    ``keep`` points with the lowest screening ``losses`` (the first ones on ties), in grid order.

    Example:
        >>> shortlist([5.0, 1.0, 3.0, 2.0, 9.0], 2)
        [0, 1, 3]
    """
    order = sorted(range(len(losses)), key=lambda i: (not losses[i] == losses[i], losses[i], i))  # NaN last
    return sorted({0, *order[:keep]})


def add_gram(total: Tensor | None, X: Tensor) -> Tensor:
    """Add ``X^T X`` (``X [tokens, in]``, in float32) to the running ``total [in, in]`` (on X's device).

    On the CPU only the upper blocks are updated (``accumulate_hessian``'s ``upper``: about half the flops),
    which is all :func:`linear_error` reads there; elsewhere the whole matrix. Read it on the device it was
    summed on.
    """
    X = X.detach().float()
    if total is None:
        total = torch.zeros(X.shape[1], X.shape[1], dtype=torch.float32, device=X.device)
    return add_products(total, X.to(total.device), upper=total.device.type == "cpu")


def linear_error(E: Tensor, gram: Tensor) -> float:
    """``sum_t |x_t E^T|^2`` for a Linear whose weight moved by ``E [out, in]``, from ``gram = sum_t x_t^T x_t``.

    The squared output error of a Linear over its inputs, without running it: ``sum((E gram) * E)``, taken from
    the Gram matrix's upper blocks (``quadratic_forms``), costs about ``out * in^2 / 2`` whatever the number
    of tokens, where running it costs ``tokens * out * in`` per candidate.

    Example:
        >>> X, E = torch.randn(50, 8), torch.randn(3, 8)
        >>> abs(linear_error(E, add_gram(None, X)) - float((X @ E.T).pow(2).sum())) < 1e-3
        True
    """
    return float(quadratic_forms(E.float().to(gram.device), gram).sum())


def masked_mse(reference: Tensor, output: Tensor, mask: Tensor | None) -> tuple[float, int]:
    """Sum of squared differences over the real tokens and how many elements it covers.

    Args:
        reference, output: ``[batch, seq, ...]`` span outputs (float and with quantized weights).
        mask: ``[batch, seq]`` bool (False: padding), or None to count every position.
    """
    diff = output.float() - reference.float().to(output.device)
    if mask is not None and tuple(mask.shape) == tuple(diff.shape[:2]) and not bool(mask.all()):
        diff = diff[mask.to(diff.device, torch.bool)]
    return float(diff.pow(2).sum()), diff.numel()
