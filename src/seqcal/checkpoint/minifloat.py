"""The tensors compressed-tensors stores for block fp8, NVFP4 and MX weights (its compressors' layout).

    float-quantized / naive-quantized (FP8_BLOCK)  weight fp8 [out, in], weight_scale [ceil(out/bh), ceil(in/bw)]
    nvfp4-pack-quantized (NVFP4A16)                weight_packed uint8 [out, in/2], weight_scale fp8 [out, in/16],
                                                   weight_global_scale float32 [1]; NVFP4 (W4A4) adds
                                                   input_global_scale float32 [1] (seqcal.checkpoint.tensors)
    mxfp4-pack-quantized (MXFP4*)                  weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/32]
    mxfp6-pack-quantized (MXFP6*)                  weight_packed uint8 [out, 3*in/4], weight_scale uint8
    mxfp8-quantized (MXFP8*)                       weight fp8 [out, in], weight_scale uint8 [out, in/32]

MX scales are stored as e8m0 biased exponents; NVFP4 dequantizes as ``value * scale / global``.

Example:
    >>> sorted(format_tensors("nvfp4-pack-quantized", fmt, q, scale, None, g))  # doctest: +SKIP
    ['weight_global_scale', 'weight_packed', 'weight_scale']
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqcal.algorithms.formats import WeightFormat
from seqcal.algorithms.fp4 import e8m0_encode, pack_fp4, pack_fp6


def format_tensors(
    name: str,
    fmt: WeightFormat,
    q: Tensor,
    scale: Tensor,
    zero_point: Tensor | None,
    global_scale: Tensor | None,
) -> dict[str, Tensor]:
    """Local tensor names -> tensors for one weight in compressed-tensors format ``name``.

    Args:
        name: the compressed-tensors format (``_format(scheme)``).
        fmt: the weight format.
        q: codes ``[out, in]`` (fp8, or uint8 minifloat codes).
        scale: as from ``seqcal.algorithms.formats.qparams``.
        zero_point: None (these formats are symmetric).
        global_scale: NVFP4's float32 [1].

    Returns:
        ``weight`` / ``weight_packed``, ``weight_scale`` and, for NVFP4, ``weight_global_scale``.

    Raises:
        ValueError: a format this function does not write.
    """
    if zero_point is not None:
        raise ValueError(f"save: {name} weights are symmetric; got a zero point")
    if name == "nvfp4-pack-quantized":
        return {
            "weight_packed": pack_fp4(q),
            "weight_scale": scale.to(torch.float8_e4m3fn),
            "weight_global_scale": global_scale.to(torch.float32).reshape(1),
        }
    if name == "mxfp4-pack-quantized":
        return {"weight_packed": pack_fp4(q), "weight_scale": e8m0_encode(scale)}
    if name == "mxfp6-pack-quantized":
        return {"weight_packed": pack_fp6(q), "weight_scale": e8m0_encode(scale)}
    if name == "mxfp8-quantized":
        return {"weight": q, "weight_scale": e8m0_encode(scale)}
    if name in ("float-quantized", "naive-quantized") and fmt.strategy == "block":
        return {"weight": q, "weight_scale": scale}
    raise ValueError(f"save: seqcal cannot write {fmt} weights in format {name!r}")
