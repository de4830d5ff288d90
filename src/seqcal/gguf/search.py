"""llama.cpp's sub-block scale searches (ggml-quants.c), vectorized over sub-blocks (pure tensor functions).

Each function takes ``x [N, n]``, N sub-blocks of n weights in float32, and returns the scale (and minimum) the
reference quantizer of a k-quant picks for every sub-block before it quantizes those scales against the block's
fp16 ``d``: ``qkx2`` (Q2_K, Q4_K, Q5_K: a scale and a minimum fitted by weighted least squares over a grid of
trial steps; with an importance matrix the same fit is ``make_qkx3_quants`` on other steps and weights), ``qx``
(Q6_K: a signed scale from trial steps around ``max / nmax``) and ``q3`` (Q3_K: codes moved one at a time while the
weighted fit improves). With an importance matrix, Q4_K's and Q5_K's sub-block scales and minimums are then
quantized against the block's ``d`` by ``qp`` (``make_qp_quants``: a weighted fit of ``d`` and the integers, not
the largest one over 63). Rounding is to nearest, ties to even, as ggml's ``nearest_int``.

Example:
    >>> scale, the_min = qkx2(torch.randn(4, 32), torch.ones(4, 32), 15, -1.0, 0.1, 20)
    >>> scale.shape, bool((the_min >= 0).all())
    (torch.Size([4]), True)
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP_MAX_EPS = 1e-15  # ggml: a sub-block whose largest magnitude is below this is all zero


def qkx2(
    x: Tensor, w: Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool = False
) -> tuple[Tensor, Tensor]:
    """``make_qkx2_quants``: per row of ``x``, the scale and minimum of ``x ~ scale * l - the_min``, l in 0..nmax.

    Args:
        x: ``[N, n]`` float32 sub-blocks.
        w: ``[N, n]`` the error's weights.
        nmax: the largest code.
        rmin, rdelta, nstep: the trial steps ``(nmax + rmin + rdelta * i) / (max - min)``, i = 0..nstep.
        use_mad: weigh absolute errors (Q2_K) instead of squared ones.

    Returns:
        ``(scale [N], the_min [N])``, ``the_min >= 0`` (the minimum is ``-the_min``, never above 0).
    """
    lo = x.amin(1).clamp(max=0)  # [N]
    hi = x.amax(1)
    flat = hi == lo
    span = torch.where(flat, torch.ones_like(hi), hi - lo)
    sum_w, sum_x = w.sum(1), (w * x).sum(1)
    shifted = x - lo[:, None]

    def error(scale: Tensor, low: Tensor, codes: Tensor) -> Tensor:
        diff = scale[:, None] * codes + low[:, None] - x
        return (w * (diff.abs() if use_mad else diff * diff)).sum(1)

    iscale = nmax / span
    scale = 1 / iscale
    codes = torch.round(iscale[:, None] * shifted).clamp_(0, nmax)
    best, low = error(scale, lo, codes), lo.clone()
    for i in range(nstep + 1):
        trial = (rmin + rdelta * i + nmax) / span
        codes = torch.round(trial[:, None] * shifted).clamp_(0, nmax)
        sum_l, sum_l2, sum_xl = (w * codes).sum(1), (w * codes * codes).sum(1), (w * codes * x).sum(1)
        D = sum_w * sum_l2 - sum_l * sum_l
        safe = torch.where(D > 0, D, torch.ones_like(D))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0  # the minimum may not be above 0: refit the scale alone
        this_scale = torch.where(positive, sum_xl / torch.where(sum_l2 > 0, sum_l2, 1.0), this_scale)
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        current = error(this_scale, this_min, codes)
        better = (D > 0) & (current < best)
        best = torch.where(better, current, best)
        scale = torch.where(better, this_scale, scale)
        low = torch.where(better, this_min, low)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale, -low


def _signed_max(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: the value of largest magnitude (its sign kept) and that magnitude."""
    index = x.abs().argmax(1, keepdim=True)
    peak = x.gather(1, index).squeeze(1)
    return peak, peak.abs()


def qx(x: Tensor, nmax: int, w: Tensor | None = None) -> Tensor:
    """``make_qx_quants`` with ``rmse_type=1`` (Q6_K; Q4_0 and Q5_0 with an importance matrix): the signed scale of
    ``x ~ scale * l``, l in -nmax..nmax-1, fitted with weights ``w`` (default ``x^2``) over the trial steps
    ``-(nmax + 0.1 i) / max``, i = -9..9.

    Returns:
        ``scale [N]``; 0 for an all-zero sub-block.
    """
    peak, amax = _signed_max(x)
    zero = amax < GROUP_MAX_EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)
    w = x * x if w is None else w

    def fit(iscale: Tensor) -> tuple[Tensor, Tensor]:
        codes = torch.round(iscale[:, None] * x).clamp_(-nmax, nmax - 1)
        return (w * x * codes).sum(1), (w * codes * codes).sum(1)

    sumlx, suml2 = fit(-nmax / peak)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, 1.0), torch.zeros_like(suml2))
    best = scale * sumlx
    for i in [i for i in range(-9, 10) if i]:
        sumlx, suml2 = fit(-(nmax + 0.1 * i) / peak)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = torch.where(better, sumlx / torch.where(suml2 > 0, suml2, 1.0), scale)
        best = torch.where(better, scale * sumlx, best)
    return torch.where(zero, torch.zeros_like(scale), scale)


def q3(x: Tensor, nmax: int = 4, tries: int = 5) -> Tensor:
    """``make_q3_quants`` with ``do_rmse`` (Q3_K): start from ``l = round(-nmax x / max)``, then move one code at a
    time, in order, to its best value given the others while the weighted (``x^2``) fit improves.

    Returns:
        ``scale [N]``; 0 for an all-zero sub-block.
    """
    peak, amax = _signed_max(x)
    zero = amax < GROUP_MAX_EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)
    codes = torch.round((-nmax / peak)[:, None] * x).clamp_(-nmax, nmax - 1)
    w = x * x
    sumlx, suml2 = _move_codes_(x, w, codes, -nmax, nmax - 1, tries)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, 1.0), torch.zeros_like(suml2))
    return torch.where(zero, torch.zeros_like(scale), scale)


def qp(x: Tensor, nmax: int, w: Tensor) -> tuple[Tensor, Tensor]:
    """``make_qp_quants``: per row of non-negative ``x [N, n]`` (a block's sub-block scales or minimums), the
    block's ``d`` and integers ``l`` in 0..nmax of ``x ~ d * l``, fitted with weights ``w [N, n]``: the best of the
    trial steps ``(nmax + 0.1 i) / max``, i = -4..4, then one integer at a time moved to its best value given the
    others while the fit improves (at most 5 passes), ``d`` the least-squares one for the integers.

    Returns:
        ``(d [N], l [N, n])`` float32; 0 and 0 for a row whose largest value is below ``GROUP_MAX_EPS``.
    """
    peak = x.amax(1)
    zero = peak < GROUP_MAX_EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)

    def mse(iscale: Tensor) -> Tensor:
        codes = torch.round(iscale[:, None] * x).clamp_(max=nmax)
        return (w * (x - (1 / iscale)[:, None] * codes).pow(2)).sum(1)

    iscale = nmax / peak
    best = mse(iscale)
    for i in [i for i in range(-4, 5) if i]:
        trial = (_f32(0.1) * i + nmax) / peak
        current = mse(trial)
        better = current < best
        best, iscale = torch.where(better, current, best), torch.where(better, trial, iscale)
    codes = torch.round(iscale[:, None] * x).clamp_(max=nmax)
    sumlx, suml2 = _move_codes_(x, w, codes, None, nmax, 5, positive_rest=True)
    d = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, 1.0), torch.zeros_like(suml2))
    return torch.where(zero, torch.zeros_like(d), d), torch.where(zero[:, None], torch.zeros_like(codes), codes)


def _move_codes_(x: Tensor, w: Tensor, codes: Tensor, lo: int | None, hi: int, tries: int,
                 positive_rest: bool = False) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The code-moving passes of ``make_q3_quants`` and ``make_qp_quants``: each code of a row, in order, moved to
    ``round(x sl2 / slx)`` (within ``lo..hi``) from the fit of the others (``slx = sum w x l``, ``sl2 = sum w l^2``
    without it, ``slx > 0``, and ``sl2 > 0`` with ``positive_rest``) where that improves the fit ``slx^2 / sl2``;
    at most ``tries`` passes (a row that changed nothing in a pass stays as it is in the next ones). ``codes``
    changes in place; returns the rows' final ``(sum w x l, sum w l^2)``."""
    sumlx, suml2 = (w * x * codes).sum(1), (w * codes * codes).sum(1)
    for _ in range(tries):
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], codes[:, i]
            slx, sl2 = sumlx - wi * xi * li, suml2 - wi * li * li
            live = (slx > 0) & (sl2 > 0) if positive_rest else slx > 0
            new = torch.round(xi * sl2 / torch.where(live, slx, 1.0)).clamp_(lo, hi)
            slx2, sl22 = slx + wi * xi * new, sl2 + wi * new * new
            take = live & (new != li) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            codes[:, i] = torch.where(take, new, li)
            sumlx, suml2 = torch.where(take, slx2, sumlx), torch.where(take, sl22, suml2)
    return sumlx, suml2


def _f32(value: float) -> Tensor:
    """``value`` as a float32 scalar, so that products with it round as ggml's ``0.1f * i``."""
    return torch.tensor(value, dtype=torch.float32)
