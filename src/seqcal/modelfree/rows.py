"""Round to nearest a chunk of rows at a time: the codes of ``rtn_quantize_weight``, the temporaries of a chunk.

Rounding a weight to nearest holds several float32 temporaries the weight's size (NVFP4's fp4 search: about 8
bytes per element above the weight; an 18432 x 7168 bfloat16 weight, DeepSeek-V3's dense MLP, peaked 2.1 GB
above itself). Where the scheme's scales are per row (a group, a channel, a block of rows, NVFP4's groups under
a global scale fixed before), each row's codes and scales depend on that row alone, so rounding ``ROW_CHUNK``
elements' worth of whole rows at a time and stacking the results gives the same bytes with the temporaries of a
chunk. A scale per tensor (the whole weight's range) is rounded whole.

Example:
    >>> qw = rtn_by_rows(W, preset_name_to_scheme("NVFP4A16", ["Linear"]))  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationScheme
from torch import Tensor

from seqcal.algorithms import formats
from seqcal.modifiers.formats import weight_format
from seqcal.modifiers.round_to_nearest import quant_kwargs, rtn_quantize_weight
from seqcal.records import QuantizedWeight

# elements rounded at once (whole rows): NVFP4's temporaries for this many are about 0.35 GB
ROW_CHUNK = 16 << 20


def rtn_by_rows(W: Tensor, scheme: QuantizationScheme, global_scale: Tensor | None = None) -> QuantizedWeight:
    """``rtn_quantize_weight(W, scheme, global_scale)``, rounded ``ROW_CHUNK`` elements of whole rows at a time
    where the scheme's scales allow it (module docstring)."""
    step = rows_per_chunk(W.shape, scheme)
    if step >= W.shape[0]:
        return rtn_quantize_weight(W, scheme, global_scale)
    fmt = weight_format(scheme)
    if fmt is not None and fmt.needs_global_scale and global_scale is None:  # the whole weight's, fixed first
        global_scale = formats.global_scale_of(W)
    parts = [rtn_quantize_weight(W[r : r + step], scheme, global_scale) for r in range(0, W.shape[0], step)]
    first = parts[0]
    return QuantizedWeight(
        q=torch.cat([p.q for p in parts]),
        scale=torch.cat([p.scale for p in parts]),
        zero_point=None if first.zero_point is None else torch.cat([p.zero_point for p in parts]),  # type: ignore[misc]
        g_idx=None,
        scheme=scheme,
        global_scale=first.global_scale,
    )


def rows_per_chunk(shape: tuple[int, ...] | torch.Size, scheme: QuantizationScheme) -> int:
    """Rows rounded at once: whole blocks of rows near ``ROW_CHUNK`` elements, or every row where the scales
    span the rows (a scale per tensor)."""
    rows, columns = shape[0], max(1, shape[-1])
    fmt = weight_format(scheme)
    if fmt is not None:
        if fmt.strategy == "tensor":
            return rows
        unit = fmt.block[0] if fmt.strategy == "block" and fmt.block else 1
    else:
        if quant_kwargs(scheme)["strategy"] not in ("channel", "group"):
            return rows
        unit = 1
    return max(unit, ROW_CHUNK // columns // unit * unit)
