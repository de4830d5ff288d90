"""Smoothing (SmoothQuant, Xiao et al., 2022): move activation outliers into the weights, per input channel.

Notation: ``X [tokens, in]`` the input of a group of Linears (q/k/v, gate/up), ``W [out, in]`` one of their
weights, ``s [in]`` the smoothing scales. The producer of ``X`` (a norm, or the Linear before) is divided by
``s`` and the consumers' columns multiplied by it, so ``(X diag(s)^-1) (W diag(s))^T = X W^T``:

    X' = X S^-1,   W' = W S,   H' = 2/n X'^T X' = S^-1 H S^-1

The scales follow llm-compressor's SmoothQuantModifier exactly (the activation statistic is the per-channel
dynamic range max - min of X, the weight statistic twice the per-column max |W| over the consumers):

    s_j = range_j^alpha / (2 max_i |W_ij|)^(1 - alpha)   (range_j where the weight column is 0), s_j >= 1e-5
"""

from __future__ import annotations

import torch
from torch import Tensor

MINIMUM_SMOOTHING_SCALE = 1e-5  # llm-compressor's lower clamp: a dead channel must not divide by zero

ChannelRange = tuple[Tensor, Tensor]


def update_channel_range(past: ChannelRange | None, X: Tensor) -> ChannelRange:
    """Running per-channel (min, max) of ``X [tokens, in]`` over batches, in float32.

    Example:
        >>> lo, hi = update_channel_range(None, torch.tensor([[1.0, -2.0], [3.0, 0.0]]))
        >>> lo.tolist(), hi.tolist()
        ([1.0, -2.0], [3.0, 0.0])
    """
    X = X.reshape(-1, X.shape[-1]).float()  # [tokens, in]
    lo, hi = X.amin(dim=0), X.amax(dim=0)  # [in]
    if past is None:
        return lo, hi
    return torch.minimum(past[0], lo.to(past[0].device)), torch.maximum(past[1], hi.to(past[1].device))


def smoothing_scales(channel_range: ChannelRange, weights: list[Tensor], alpha: float) -> Tensor:
    """The SmoothQuant scales ``s [in]`` of one group (llm-compressor's formula, see the module docstring).

    Args:
        channel_range: per-channel (min, max) of the group's input, ``[in]`` each.
        weights: the consumers' weights ``[out_k, in]`` (all read the same input).
        alpha: migration strength in [0, 1] (``smoothing_strength``).

    Returns:
        ``s [in]`` float32, each >= ``MINIMUM_SMOOTHING_SCALE``.

    Example:
        >>> s = smoothing_scales((torch.zeros(2), torch.tensor([4.0, 1.0])), [torch.ones(3, 2) / 2], 0.5)
        >>> s.tolist()
        [2.0, 1.0]
    """
    lo, hi = channel_range
    act = (hi - lo).float()  # [in] dynamic range of each input channel
    w_max = torch.stack([W.detach().abs().amax(dim=0).float().to(act.device) for W in weights]).amax(dim=0)
    w_scale = 2.0 * w_max  # [in]
    s = act.pow(alpha) / w_scale.pow(1.0 - alpha)
    s = torch.where(w_scale > 0.0, s, act)
    return s.clamp_min(MINIMUM_SMOOTHING_SCALE)


def smoothed_hessian(H: Tensor, s: Tensor) -> Tensor:
    """``H' = S^-1 H S^-1``: the Hessian of the inputs ``X / s`` from the Hessian of ``X`` (exact).

    Example:
        >>> X, s = torch.randn(16, 4), torch.rand(4) + 0.5
        >>> torch.allclose(smoothed_hessian(2 * X.T @ X, s), 2 * (X / s).T @ (X / s), atol=1e-5)
        True
    """
    inv = 1.0 / s.to(H.device, H.dtype)  # [in]
    return H * inv[:, None] * inv[None, :]


def divide_producer(weight: Tensor, bias: Tensor | None, s: Tensor) -> tuple[Tensor, Tensor | None]:
    """The producer's new weight and bias: a norm's ``w [in]`` / s, or a Linear's rows ``W [in, k]`` / s.

    Computed in float32 and returned in the parameters' dtype.
    """
    s = s.to(weight.device, torch.float32)
    scale = s if weight.dim() == 1 else s.reshape(-1, *([1] * (weight.dim() - 1)))  # [in] or [in, 1]
    new_w = (weight.float() / scale).to(weight.dtype)
    new_b = None if bias is None else (bias.float() / s.to(bias.device)).to(bias.dtype)
    return new_w, new_b


def multiply_consumer(weight: Tensor, s: Tensor) -> Tensor:
    """A consumer's new weight ``W S`` (columns times s), in the weight's dtype."""
    return (weight.float() * s.to(weight.device, torch.float32)[None, :]).to(weight.dtype)
