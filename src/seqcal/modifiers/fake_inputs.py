"""Input activations fake-quantized as the runtime quantizes them: static scales, dynamic per token, NVFP4.

``quantized_inputs`` (``modifiers.activations``) applies ``input_fake_quantize`` to every quantized Linear's
input during a run, so that later modules calibrate on what inference will compute.
"""

from __future__ import annotations

from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs
from torch import Tensor

from seqcal.algorithms import compute_qparams, quant_range
from seqcal.algorithms.fp4 import nvfp4_fake_quantize_groups
from seqcal.algorithms.quant import round_fp8


def qdq(x: Tensor, scale: Tensor, zero: Tensor | None, args: QuantizationArgs) -> Tensor:
    """Quantize-dequantize in one pass, as compressed-tensors' fused ``_quantize_dequantize``: the codes stay
    in x's dtype (no int8 / fp8 tensor in between), the result is in the scale's dtype.

    Args:
        x: activations; ``scale`` / ``zero`` broadcast against it.
        args: the activation format (num_bits, type).

    Returns:
        ``(round(clamp(x / scale + zero)) - zero) * scale``.
    """
    qmin, qmax = quant_range(args.num_bits, enum_value(args.type))
    scaled = x / scale
    if zero is not None:
        scaled = scaled + zero.to(x.dtype)
    scaled = scaled.clamp(qmin, qmax)  # a new tensor: fp8 rounds it in place
    codes = round_fp8(scaled, out_of_place=False) if enum_value(args.type) == "float" else torch.round(scaled)
    codes = codes.to(scale.dtype)
    if zero is not None:
        codes = codes - zero.to(scale.dtype)
    return codes * scale


def dynamic_fake_quantize(x: Tensor, args: QuantizationArgs) -> Tensor:
    """Fake-quantize ``x`` with qparams computed from it, as compressed-tensors' dynamic forward does.

    ``token``: one scale per token for ``[batch, seq, in]`` (per tensor for other ranks, as there);
    ``tensor``: one scale; ``group``: one per token and group of ``group_size`` columns.

    Example:
        >>> y = dynamic_fake_quantize(torch.randn(2, 5, 16), QuantizationArgs(strategy="token", dynamic=True))
    """
    strategy, kind = enum_value(args.strategy), enum_value(args.type)
    if strategy == "token" and x.dim() == 3:
        lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)  # [batch, seq, 1]
    elif strategy == "group":
        grouped = x.unflatten(-1, (x.shape[-1] // args.group_size, args.group_size))
        lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)  # [..., groups]
        scale, zero = compute_qparams(lo, hi, num_bits=args.num_bits, symmetric=args.symmetric, type=kind)
        zero = None if args.symmetric else zero.unsqueeze(-1)
        return qdq(grouped, scale.unsqueeze(-1), zero, args).flatten(-2).to(x.dtype)
    else:
        lo, hi = x.amin(), x.amax()
    scale, zero = compute_qparams(lo, hi, num_bits=args.num_bits, symmetric=args.symmetric, type=kind)
    return qdq(x, scale, None if args.symmetric else zero, args)


def input_fake_quantize(x: Tensor, qw: Any) -> Tensor:
    """The input ``x`` of a quantized module as its runtime sees it (``qw``: its QuantizedWeight).

    Returns ``x`` unchanged for weight-only schemes, and for static ones not calibrated yet.
    """
    args = qw.scheme.input_activations
    if args is None or x.numel() == 0:
        return x
    if nvfp4_inputs(args):  # fp4 with per-token group scales under the calibrated global scale
        if qw.input_global_scale is None:
            return x
        return nvfp4_fake_quantize_groups(x, qw.input_global_scale, args.group_size)
    if args.dynamic is not False:
        if (
            enum_value(args.type) == "float"
            and args.num_bits != 8
            or getattr(args, "scale_dtype", None) is not None
        ):
            # MX activations (fp4/fp6/fp8 with e8m0 group scales) are computed at inference and not emulated
            # here: downstream modules calibrate on the unquantized inputs, as for every scheme before.
            return x
        return dynamic_fake_quantize(x, args)
    if qw.input_scale is None:
        return x
    scale = qw.input_scale.to(x.device)
    zero = None if qw.input_zero_point is None else qw.input_zero_point.to(x.device)
    if enum_value(args.strategy) == "group":  # [..., groups, group_size] against [groups, 1]
        grouped = x.unflatten(-1, (scale.shape[-1], args.group_size))
        zero = None if zero is None else zero.unsqueeze(-1)
        return qdq(grouped, scale.unsqueeze(-1), zero, args).flatten(-2).to(x.dtype)
    # x / scale in the promoted dtype, dequantized in the scale's dtype, as compressed-tensors' forward
    return qdq(x, scale, zero, args)


def enum_value(enum_or_str: object) -> str:
    return str(getattr(enum_or_str, "value", enum_or_str))


def nvfp4_inputs(args: QuantizationArgs | None) -> bool:
    """Whether input activations are NVFP4's: fp4, ``tensor_group``, group scales computed at inference
    (``dynamic: local``) from a calibrated global scale."""
    return (
        args is not None
        and enum_value(args.dynamic) == "local"
        and enum_value(args.strategy) == "tensor_group"
    )
