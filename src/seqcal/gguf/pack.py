"""Codes and stored scales -> GGUF blocks, byte for byte as ggml lays them out (``block_q4_K`` and the others).

gguf-py reads every type but writes only the legacy ones, and its writers quantize themselves; seqcal's codes
come from the calibration, so the blocks are assembled here from them (numpy, one vectorized pass per field).
``seqcal.gguf.check`` reads the bytes back with ``gguf.quants.dequantize``.

Example:
    >>> fmt = gguf_format("Q4_0"); W = torch.randn(2, 64); s, z = qparams(W, fmt)
    >>> pack(quantize(W, s, z, fmt), s, z, fmt).shape  # 2 blocks of 18 bytes per row
    (2, 36)
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from seqcal.gguf.grids import GGUFFormat


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    """float32 values already on the fp16 grid ``[nb]`` -> their fp16 bytes ``[nb, 2]``."""
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _nibbles(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return (low & 0x0F) | (high << 4)


def _high_bits(q: np.ndarray, shift: int) -> np.ndarray:
    """Bit ``shift`` of each code of ``q [nb, 32 * k]`` packed little-endian: ``[nb, 4 * k]`` bytes."""
    return np.packbits((q >> shift) & 1, axis=-1, bitorder="little")


def _crumbs(L: np.ndarray) -> np.ndarray:
    """2-bit codes ``[nb, 256]`` -> ``[nb, 64]``: byte ``j/4 + l`` holds codes ``j+l, +32, +64, +96`` (j = 0, 128)."""
    parts = L.reshape(-1, 2, 4, 32)  # [nb, half, quarter, l]
    packed = parts[:, :, 0] | (parts[:, :, 1] << 2) | (parts[:, :, 2] << 4) | (parts[:, :, 3] << 6)
    return packed.reshape(-1, 64)


def _k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: eight 6-bit scales and minimums ``[nb, 8]`` -> the 12 bytes ggml packs them in."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4], out[:, 4:8] = sc[:, :4], m[:, :4]
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    out[:, 0:4] |= (sc[:, 4:] >> 4) << 6
    out[:, 4:8] |= (m[:, 4:] >> 4) << 6
    return out


def _q3_scales(sc: np.ndarray) -> np.ndarray:
    """Q3_K: sixteen 6-bit scales (``sc + 32``) ``[nb, 16]`` -> 12 bytes."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:8] = (sc[:, :8] & 0x0F) | ((sc[:, 8:] & 0x0F) << 4)
    high = sc >> 4  # [nb, 16]: 2 bits each; scale j goes to byte 8 + j % 4 at bit 2 * (j // 4)
    for j in range(16):
        out[:, 8 + j % 4] |= high[:, j] << (2 * (j // 4))
    return out


def _blocks(
    L: np.ndarray, d: np.ndarray, sc: np.ndarray, dm: np.ndarray, m: np.ndarray, name: str
) -> np.ndarray:
    """One row of blocks per block: L [nb, block] unsigned codes, d / dm [nb] fp16 values, sc / m [nb, subs]."""
    if name in ("Q4_0", "Q4_1"):
        parts = [_fp16_bytes(d)] + ([_fp16_bytes(dm)] if name == "Q4_1" else [])
        return np.concatenate([*parts, _nibbles(L[:, :16], L[:, 16:])], axis=1)
    if name in ("Q5_0", "Q5_1"):
        parts = [_fp16_bytes(d)] + ([_fp16_bytes(dm)] if name == "Q5_1" else [])
        return np.concatenate([*parts, _high_bits(L, 4), _nibbles(L[:, :16], L[:, 16:])], axis=1)
    if name == "Q8_0":  # signed bytes
        return np.concatenate(
            [_fp16_bytes(d), (L.astype(np.int16) - 128).astype(np.int8).view(np.uint8)], axis=1
        )
    if name in ("Q4_K", "Q5_K"):
        low = L.reshape(-1, 4, 2, 32)
        qs = _nibbles(low[:, :, 0], low[:, :, 1]).reshape(-1, 128)
        qh = [_high_bits(L.reshape(-1, 8, 32).transpose(0, 2, 1).reshape(-1, 32, 8), 4).reshape(-1, 32)] \
            if name == "Q5_K" else []  # fmt: skip
        return np.concatenate([_fp16_bytes(d), _fp16_bytes(dm), _k4_scales(sc, m), *qh, qs], axis=1)
    if name == "Q6_K":
        parts = L.reshape(-1, 2, 4, 32)  # [nb, half, quarter, l]
        ql = np.concatenate([_nibbles(parts[:, :, 0], parts[:, :, 2]), _nibbles(parts[:, :, 1], parts[:, :, 3])],
                            axis=-1).reshape(-1, 128)  # fmt: skip
        hi = parts >> 4
        qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
        return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _fp16_bytes(d)], axis=1)
    if name == "Q3_K":
        hmask = _high_bits(L.reshape(-1, 8, 32).transpose(0, 2, 1).reshape(-1, 32, 8), 2).reshape(-1, 32)
        qs = _crumbs(L & 3)
        return np.concatenate([hmask, qs, _q3_scales((sc + 32).astype(np.uint8)), _fp16_bytes(d)], axis=1)
    if name == "Q2_K":
        return np.concatenate([sc | (m << 4), _crumbs(L), _fp16_bytes(d), _fp16_bytes(dm)], axis=1)
    raise ValueError(f"pack: unknown GGUF type {name!r}")


def pack(q: Tensor, scale: Tensor, zero: Tensor | None, fmt: GGUFFormat) -> np.ndarray:
    """The GGUF bytes of a weight: ``[out, in // block * type_size]`` uint8.

    Args:
        q: int8 codes ``[out, in]`` (``seqcal.gguf.grids``' range for the type).
        scale, zero: the stored scales ``[out, in // block, 1 + subs]`` (zero None for symmetric types).
        fmt: the format.
    """
    t = fmt.gtype
    out = q.shape[0]
    L = (q.to(torch.int16) - t.qmin).to(torch.uint8).reshape(-1, t.block).numpy()  # unsigned codes
    s = scale.float().reshape(-1, 1 + t.subs).numpy()
    z = zero.float().reshape(-1, 1 + t.subs).numpy() if zero is not None else np.zeros_like(s)
    ints = s[:, 1:].astype(np.int16)
    sc = ints if t.sub_signed else ints.astype(np.uint8)
    blocks = _blocks(L, s[:, 0], sc, z[:, 0], z[:, 1:].astype(np.uint8), t.name)
    return np.ascontiguousarray(blocks).reshape(out, -1)
