"""The steps of a learned-rounding search (AutoRound's): its loss over the real tokens, its learning rate decayed
to 0, reproducible batches of the recorded rows, and the kernels its differentiable re-runs take.

The block runs under :class:`TrainingKernels` during the search: float32 products on the CPU take oneDNN's kernels
in the backward pass too (``seqcal.backend.onednn``: MKL's AVX2 path on AMD CPUs is about half as fast). The
parameters the search learns and their step are in ``seqcal.algorithms.autoround``.

Example:
    >>> [linear_lr(0.01, step, 4) for step in range(4)]
    [0.01, 0.0075, 0.005, 0.0025]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from seqcal.backend import linear, onednn_for

__all__ = ["TrainingKernels", "batches_of", "linear_lr", "masked_mse"]


def masked_mse(y: Tensor, target: Tensor, mask: Tensor | None) -> Tensor:
    """Mean squared error of ``y`` against ``target`` ``[rows, seq, hidden]`` over the real tokens.

    Args:
        mask: ``[rows, seq]`` True for real tokens (None: every token).
    """
    err = (y.float() - target.float()).pow(2)  # [rows, seq, hidden]
    if mask is None:
        return err.mean()
    m = mask.to(err.device, err.dtype).unsqueeze(-1)
    return (err * m).sum() / (m.sum() * err.shape[-1]).clamp(min=1)


def linear_lr(lr: float, step: int, steps: int) -> float:
    """The learning rate of ``step`` (0-based) decayed linearly from ``lr`` to 0 over ``steps`` steps."""
    return lr * (1.0 - step / steps)


class _OneDNNLinear(torch.autograd.Function):
    """``x @ w.T + b`` whose forward and backward products take oneDNN's float32 kernels (``seqcal.backend.linear``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return linear(x, w.contiguous(), b)

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        gx = gw = gb = None
        g2 = gy.reshape(-1, gy.shape[-1])  # [tokens, out]
        if ctx.needs_input_grad[0]:
            gx = linear(gy, w.t().contiguous())  # [..., in]
        if ctx.needs_input_grad[1]:
            # [out, in] = gy^T x, as linear(gy^T, x^T)
            gw = linear(g2.t().contiguous(), x.reshape(-1, x.shape[-1]).t().contiguous())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


class TrainingKernels(TorchFunctionMode):
    """Kernels for the search's differentiable re-runs: with ``linears``, float32 ``linear`` calls on the CPU run on
    oneDNN in both directions (where ``products`` sends the forward-only ones: AMD CPUs with MKL). Everything else
    runs as it is.

    Args:
        linears: route float32 Linears to oneDNN (off under autocast, which must see them).

    Example:
        >>> w = torch.randn(4, 8, requires_grad=True)
        >>> with TrainingKernels():
        ...     F.linear(torch.randn(64, 8), w).sum().backward()
        >>> w.grad.shape
        torch.Size([4, 8])
    """

    def __init__(self, linears: bool = True) -> None:
        super().__init__()
        self.linears = linears

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.linears and func is F.linear and args and _takes_onednn(*args, *kwargs.values()):
            x, w, b = (*args, *kwargs.values(), None)[:3]  # F.linear(x, w) leaves the bias out
            return _OneDNNLinear.apply(x, w, b)
        return func(*args, **kwargs)


def _takes_onednn(x: Any, w: Any = None, b: Any = None) -> bool:
    tensors = [t for t in (x, w, b) if t is not None]
    return (
        all(type(t) is Tensor and t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
        and w is not None
        and w.dim() == 2
        and torch.is_grad_enabled()
        and onednn_for(x.device, x.numel() // max(x.shape[-1], 1))
    )


def batches_of(rows: int, size: int, steps: int, seed: int) -> Iterator[Tensor]:
    """``steps`` batches of ``min(size, rows)`` row indices, reproducible: consecutive slices of a shuffled order of
    the rows, shuffled again when fewer than a batch remain (auto-round's sampler), so that every row is learned
    from as often as the others.

    Example:
        >>> [b.tolist() for b in batches_of(4, 2, 3, seed=0)]
        [[0, 1], [2, 3], [0, 2]]
    """
    gen, size = torch.Generator().manual_seed(seed), min(size, rows)
    order, start = torch.randperm(rows, generator=gen), 0
    for _ in range(steps):
        if start + size > rows:
            order, start = torch.randperm(rows, generator=gen), 0
        yield order[start : start + size].sort().values
        start += size
