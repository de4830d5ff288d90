"""Round to nearest: a weight's codes and qparams under a scheme, the quantizers' shared first step.

``QuantizationModifier`` quantizes every module with it, GPTQ and GPTAQ the modules they do not solve; AWQ's
scale search rounds its candidate weights with ``fake_quantized``; model-free quantization writes the codes
without the fake-quantized weight (``rtn_quantize_weight``). A scheme's weights go through
``seqcal.algorithms``: its integer grid (``quant_kwargs``: the scheme as their keyword arguments) or, for block
fp8, NVFP4 and MX, its format (``seqcal.modifiers.formats.weight_format``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationScheme

from seqcal.algorithms import dequantize, fake_quantize, formats, quantize, weight_qparams
from seqcal.modifiers.formats import weight_format
from seqcal.modifiers.schemes import strategy_of
from seqcal.records import QuantizedWeight


def quant_kwargs(scheme: QuantizationScheme) -> dict[str, Any]:
    """The weight arguments of ``scheme`` as keyword arguments of seqcal.algorithms."""
    w = scheme.weights
    return {
        "num_bits": w.num_bits,
        "symmetric": w.symmetric,
        "strategy": strategy_of(w),
        "group_size": w.group_size if strategy_of(w) == "group" else None,
        "type": str(w.type.value if hasattr(w.type, "value") else w.type),
        "observer": w.observer or "minmax",
        "observer_kwargs": dict(w.observer_kwargs or {}),
    }


def rtn_quantize_module(
    module: torch.nn.Module,
    scheme: QuantizationScheme,
    global_scale: torch.Tensor | None = None,
    *,
    importance: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Round-to-nearest quantize ``module.weight`` in place (fake-quantized) and return its compressed form.

    Args:
        module: the Linear.
        scheme: its scheme.
        global_scale: NVFP4's float32 [1] global scale (shared by a fused group); computed from this weight
            alone when None.
        importance: ``[in]`` mean squared input per column for the ``imatrix_mse`` observer (None: uniform).
    """
    qw, dequantized = _round_to_nearest(module.weight.data, scheme, global_scale, importance)
    module.weight.data = dequantized()
    return qw


def rtn_quantize_weight(
    W: torch.Tensor, scheme: QuantizationScheme, global_scale: torch.Tensor | None = None
) -> QuantizedWeight:
    """``rtn_quantize_module``'s compressed form of ``W [out, in]``, without the fake-quantized weight (for
    ``seqcal.modelfree``, which writes the codes only): the same codes, the dequantization skipped."""
    return _round_to_nearest(W, scheme, global_scale, None)[0]


def _round_to_nearest(
    W: torch.Tensor,
    scheme: QuantizationScheme,
    global_scale: torch.Tensor | None,
    importance: torch.Tensor | None,
) -> tuple[QuantizedWeight, Callable[[], torch.Tensor]]:
    """The compressed form of ``W`` and how to compute its fake-quantized values (``rtn_quantize_module``)."""
    fmt = weight_format(scheme)
    if fmt is not None:  # block fp8, NVFP4, MX: seqcal.algorithms.formats
        if fmt.needs_global_scale and global_scale is None:
            global_scale = formats.global_scale_of(W)
        scale, zero_point = formats.qparams(W, fmt, global_scale)
        q = formats.quantize(W, scale, zero_point, fmt, global_scale)
        qw = QuantizedWeight(q=q, scale=scale, zero_point=zero_point, g_idx=None, scheme=scheme,
                             global_scale=global_scale if fmt.needs_global_scale else None)  # fmt: skip
        return qw, lambda: formats.dequantize(q, scale, zero_point, fmt, global_scale, dtype=W.dtype)
    kw = quant_kwargs(scheme)
    scale, zero_point = weight_qparams(W, **kw, importance=importance)
    qargs = {"num_bits": kw["num_bits"], "type": kw["type"], "group_size": kw["group_size"]}
    # a symmetric int scheme's zero point is 0: adding it changes no code (-0.0 and 0.0 both round to 0) and costs a
    # pass over the weight; fp8 codes keep it (it turns -0.0 into 0.0, as compressed-tensors' quantize does)
    shift = None if kw["symmetric"] and kw["type"] == "int" else zero_point
    q = quantize(W, scale, shift, **qargs)
    qw = QuantizedWeight(
        q=q, scale=scale, zero_point=None if kw["symmetric"] else zero_point, g_idx=None, scheme=scheme
    )
    return qw, lambda: dequantize(q, scale, zero_point, group_size=kw["group_size"], dtype=W.dtype)


def rounded(W: torch.Tensor, scheme: QuantizationScheme, importance: torch.Tensor | None = None) -> torch.Tensor:
    """``W`` rounded to nearest as ``rtn_quantize_module`` rounds it (the scheme's observer: ``mse`` searches the
    range, ``imatrix_mse`` with ``importance``), without touching a module or keeping the codes. Mixed precision
    predicts each candidate's error with it."""
    return _round_to_nearest(W, scheme, None, importance)[1]()


def fake_quantized(W: torch.Tensor, scheme: QuantizationScheme) -> torch.Tensor:
    """``W`` rounded to nearest with ``scheme``'s weights and min-max qparams (no module touched, no codes kept).

    AWQ's scale search quantizes candidate weights with it, as llm-compressor's search does (min-max whatever
    the scheme's observer).
    """
    fmt = weight_format(scheme)
    if fmt is not None:  # block fp8, NVFP4, MX
        g = formats.global_scale_of(W) if fmt.needs_global_scale else None
        scale, zp = formats.qparams(W, fmt, g)
        return formats.dequantize(formats.quantize(W, scale, zp, fmt, g), scale, zp, fmt, g, dtype=W.dtype)
    kw = quant_kwargs(scheme)
    scale, zp = weight_qparams(W, num_bits=kw["num_bits"], symmetric=kw["symmetric"], strategy=kw["strategy"],
                               group_size=kw["group_size"], type=kw["type"])  # fmt: skip
    return fake_quantize(W, scale, zp, num_bits=kw["num_bits"], type=kw["type"], group_size=kw["group_size"])
