"""Block-wise qparams (one scale per ``[bh, bw]`` tile of ``W [out, in]``), pure tensor functions.

A weight whose sides are not multiples of the block is padded with zeros to whole blocks, as
compressed-tensors does (``maybe_pad_tensor_for_block_quant``): its scale is
``[ceil(out / bh), ceil(in / bw)]`` and the last row / column of blocks covers only the real rows and columns
(zeros never raise a block's maximum, which always includes 0).

Example:
    >>> block_amax(torch.ones(130, 64), (128, 128)).shape
    torch.Size([2, 1])
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def block_grid(shape: tuple[int, ...] | torch.Size, block: tuple[int, int]) -> tuple[int, int]:
    """Number of blocks along rows and columns of a ``[out, in]`` weight (partial blocks count)."""
    return math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1])


def _blocks(W: Tensor, block: tuple[int, int]) -> Tensor:
    """``W [out, in]`` zero-padded to whole blocks, viewed as ``[RB, CB, bh * bw]``."""
    bh, bw = block
    rb, cb = block_grid(W.shape, block)
    padded = torch.nn.functional.pad(W, (0, cb * bw - W.shape[1], 0, rb * bh - W.shape[0]))
    return padded.reshape(rb, bh, cb, bw).transpose(1, 2).reshape(rb, cb, bh * bw)


def block_minmax(W: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Minimum and maximum of each block, ``[RB, CB]`` each, in W's dtype (padding counts as 0).

    Example:
        >>> lo, hi = block_minmax(torch.arange(4.0).reshape(2, 2), (1, 2))
        >>> hi
        tensor([[1.],
                [3.]])
    """
    tiles = _blocks(W, block)
    return tiles.amin(dim=-1), tiles.amax(dim=-1)


def block_amax(W: Tensor, block: tuple[int, int]) -> Tensor:
    """Largest magnitude of each block, ``[RB, CB]``."""
    lo, hi = block_minmax(W, block)
    return torch.maximum(lo.abs(), hi.abs())


def expand_blocks(p: Tensor, shape: tuple[int, ...] | torch.Size, block: tuple[int, int]) -> Tensor:
    """Per-block values ``[RB, CB]`` repeated to one per element of a ``[out, in]`` weight (partial blocks cut).

    Example:
        >>> expand_blocks(torch.tensor([[1.0, 2.0]]), (2, 3), (2, 2))
        tensor([[1., 1., 2.],
                [1., 1., 2.]])
    """
    bh, bw = block
    return p.repeat_interleave(bh, dim=0)[: shape[-2]].repeat_interleave(bw, dim=1)[:, : shape[-1]]


def expand_block_rows(p: Tensor, rows: int, block_height: int) -> Tensor:
    """Per-block values ``[RB, CB]`` repeated over the rows of their blocks: ``[rows, CB]`` (for GPTQ, whose
    column loop looks a column's qparam up by its column block)."""
    return p.repeat_interleave(block_height, dim=0)[:rows]
