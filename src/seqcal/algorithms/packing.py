"""Dense int32 packing of low-bit integer codes (compressed-tensors ``pack-quantized``), pure tensor functions.

Codes are the signed int8 codes of ``seqcal.algorithms.quant.quantize``; ``pack_int32`` offsets them to
unsigned and packs ``num_bits`` bits each into a little-endian bit stream per row, ``unpack_int32`` undoes it.
Bit for bit what compressed-tensors' ``pack_to_int32`` writes.

Example:
    >>> q = torch.randint(-8, 8, (3, 40), dtype=torch.int8)
    >>> pack_int32(q, 4).shape
    torch.Size([3, 5])
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor


def _check_pack_args(num_bits: int, dim: int, ndim: int) -> int:
    if not 1 <= num_bits <= 8:
        raise ValueError(f"packing supports num_bits in 1..8, got {num_bits}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} is out of range for a {ndim}-D tensor")
    return dim % ndim


def pack_int32(q: Tensor, num_bits: int, dim: int = -1) -> Tensor:
    """Pack signed ``num_bits`` codes densely into int32 words (compressed-tensors ``pack-quantized``).

    Codes are offset to unsigned (``q + 2^(b-1)``); element ``i`` of a row occupies bits
    ``[i*b, i*b + b)`` of the row's little-endian bit stream, so codes can straddle words. For int4
    this is 8 nibbles per word, element ``8k + j`` in bits ``4j..4j+3`` of word ``k``.

    Args:
        q: int8 codes, e.g. ``[out, in]``.
        num_bits: 1..8.
        dim: dimension to pack along: -1 (1 in compressed-tensors) for weights, 0 for the
            zero points of asymmetric channel/group schemes.

    Returns:
        int32 tensor with ``ceil(q.shape[dim] * num_bits / 32)`` entries along ``dim``.

    Example:
        >>> pack_int32(torch.zeros(2, 8, dtype=torch.int8), 4)
        tensor([[-2004318072],
                [-2004318072]], dtype=torch.int32)
    """
    if q.dtype != torch.int8:
        raise ValueError(f"pack_int32 expects int8 codes (from quantize), got {q.dtype}")
    dim = _check_pack_args(num_bits, dim, q.ndim)
    u = q.movedim(dim, -1)
    lead = u.shape[:-1]
    u = u.reshape(-1, u.shape[-1])  # [R, C] signed codes
    R, C = u.shape
    packed = torch.empty(R, math.ceil(C * num_bits / 32), dtype=torch.int32, device=q.device)
    step = max(1, PACK_CODES // max(C, 1))
    # rows are packed on their own: a few MiB of int32 temporaries, not 12 bytes a code
    for r in range(0, R, step):
        packed[r : r + step] = _pack_rows(u[r : r + step], num_bits)
    return packed.reshape(*lead, -1).movedim(-1, dim).contiguous()


# Codes per chunk of rows that pack_int32 widens to int32 at once (4 MiB of each temporary)
PACK_CODES = 1 << 20


def _pack_rows(q: Tensor, num_bits: int) -> Tensor:
    """:func:`pack_int32` of the rows of ``q [R, C]`` (int8): ``[R, ceil(C * num_bits / 32)]`` int32."""
    if 8 % num_bits == 0 and sys.byteorder == "little":
        return _pack_bytes(q, num_bits)
    u = q.to(torch.int32) + (1 << (num_bits - 1))  # [R, C] unsigned codes
    R, C = u.shape
    if 32 % num_bits == 0:  # whole codes per word (1, 2, 4, 8 bits on a big-endian machine): one shift per position
        return _pack_whole(u, num_bits)
    chunks = math.ceil(C / 32)
    u = torch.nn.functional.pad(u, (0, chunks * 32 - C)).view(R, chunks, 32)  # 32 codes fill b words
    words = torch.zeros(R, chunks, num_bits, dtype=torch.int32, device=q.device)
    for i in range(32):
        w, off = divmod(i * num_bits, 32)
        words[:, :, w] |= u[:, :, i] << off  # bits past 31 wrap away; the carry goes to the next word
        if off + num_bits > 32:
            words[:, :, w + 1] |= u[:, :, i] >> (32 - off)
    return words.view(R, -1)[:, : math.ceil(C * num_bits / 32)]


def _pack_bytes(q: Tensor, num_bits: int) -> Tensor:
    """``_pack_rows`` for widths dividing 8 on a little-endian machine: the codes packed into bytes (code ``j`` of
    a byte in bits ``j*b..``), the bytes read as int32 words. Word ``k``'s byte ``m`` is its bits ``8m..8m+7``, so
    these are the same words as ``_pack_whole``'s, for a quarter of the memory traffic (int4: 3.6x faster)."""
    per_byte, per_word = 8 // num_bits, 32 // num_bits
    R, C = q.shape
    words = math.ceil(C / per_word)
    # the unsigned codes, in uint8: q + 2^(b-1), which for 8 bits is q's bits with the top one flipped
    u = q.view(torch.uint8) ^ 0x80 if num_bits == 8 else (q + (1 << (num_bits - 1))).view(torch.uint8)
    u = torch.nn.functional.pad(u, (0, words * per_word - C)).view(R, words * 4, per_byte)
    packed = u[..., 0].clone(memory_format=torch.contiguous_format)  # the words' bytes, in order
    for j in range(1, per_byte):
        packed |= u[..., j] << (j * num_bits)
    return packed.view(torch.int32)  # [R, words]


def _pack_whole(u: Tensor, num_bits: int) -> Tensor:
    """``_pack_rows`` for widths dividing 32: code ``j`` of each word in bits ``j*b..`` (the same words, two to
    three times faster: each code position is a contiguous plane, not a strided column read 32 times)."""
    per_word = 32 // num_bits
    R, C = u.shape
    words = math.ceil(C / per_word)
    planes = torch.nn.functional.pad(u, (0, words * per_word - C)).view(R, words, per_word)
    planes = planes.permute(2, 0, 1).contiguous()  # [per_word, R, words]
    out = planes[0].clone()
    for j in range(1, per_word):
        out |= planes[j] << (j * num_bits)  # bits past 31 wrap into the sign, as compressed-tensors' words
    return out


def unpack_int32(packed: Tensor, num_bits: int, shape: tuple[int, ...] | torch.Size, dim: int = -1) -> Tensor:
    """Inverse of :func:`pack_int32`.

    Args:
        packed: int32 words.
        num_bits: 1..8.
        shape: shape of the codes before packing.
        dim: the dimension that was packed.

    Returns:
        int8 codes of ``shape``.

    Example:
        >>> q = torch.randint(-8, 8, (3, 40), dtype=torch.int8)
        >>> torch.equal(unpack_int32(pack_int32(q, 4), 4, q.shape), q)
        True
    """
    if packed.dtype != torch.int32:
        raise ValueError(f"unpack_int32 expects int32 words, got {packed.dtype}")
    shape = tuple(shape)
    dim = _check_pack_args(num_bits, dim, len(shape))
    words = packed.movedim(dim, -1)
    lead = words.shape[:-1]
    words = words.reshape(-1, words.shape[-1])  # [R, W]
    R, C = words.shape[0], shape[dim]
    chunks = math.ceil(C / 32)
    words = torch.nn.functional.pad(words, (0, chunks * num_bits - words.shape[1])).view(R, chunks, num_bits)
    mask = (1 << num_bits) - 1
    u = torch.empty(R, chunks, 32, dtype=torch.int32, device=packed.device)
    for i in range(32):
        w, off = divmod(i * num_bits, 32)
        # arithmetic shift drags the sign bit down: keep only the bits this word holds
        code = (words[:, :, w] >> off) & ((1 << min(num_bits, 32 - off)) - 1)
        if off + num_bits > 32:
            code |= (words[:, :, w + 1] << (32 - off)) & mask
        u[:, :, i] = code
    q = (u.view(R, -1)[:, :C] - (1 << (num_bits - 1))).to(torch.int8)
    return q.reshape(*lead, C).movedim(-1, dim).contiguous()
