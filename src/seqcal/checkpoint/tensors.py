"""The tensors compressed-tensors stores for one module, and the checks that they are the model in memory.

``_module_tensors`` gives a module's own state-dict entries with its quantized weight replaced by the
tensors of its format (``weight_packed``/``weight``, ``weight_scale``, ``weight_zero_point``,
``weight_shape``, for static activations ``input_scale`` / ``input_zero_point``, for NVFP4 activations
``input_global_scale``; see
``seqcal.checkpoint.writer``); the codes are checked first and the in-memory weight must equal
their dequantization exactly. ``seqcal.checkpoint.writer.CheckpointWriter`` writes what it returns.

Example:
    >>> sorted(_module_tensors("model.layers.0.mlp.down_proj", module, qw))  # doctest: +SKIP
    ['model.layers.0.mlp.down_proj.weight_packed', ..., 'model.layers.0.mlp.down_proj.weight_shape']
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from seqcal.algorithms import code_dtype, dequantize, formats, pack_int32, quant_range
from seqcal.checkpoint.config import _format
from seqcal.checkpoint.minifloat import format_tensors
from seqcal.modifiers.formats import weight_format
from seqcal.modifiers.schemes import strategy_of
from seqcal.records import QuantizedWeight


def _check_quantized(name: str, qw: QuantizedWeight, shape: tuple[int, ...]) -> None:
    """Reject what would load as a different model than the one in memory."""
    w = qw.scheme.weights
    where = f"save: module {name!r}"
    _check_input_qparams(where, qw)
    fmt = weight_format(qw.scheme)
    expected = code_dtype(w.type) if fmt is None else fmt.code_dtype
    if tuple(qw.q.shape) != shape or qw.q.dtype != expected:
        raise ValueError(
            f"{where}: codes are {qw.q.dtype} {list(qw.q.shape)}, expected {expected} {list(shape)} "
            "(the module's weight shape); the quantized state does not belong to this model"
        )
    if (qw.zero_point is None) != w.symmetric:
        raise ValueError(f"{where}: zero_point must be None exactly when the scheme is symmetric")
    if (qw.global_scale is None) != (fmt is None or not fmt.needs_global_scale):
        raise ValueError(f"{where}: a global scale must be given exactly for NVFP4 (tensor_group) weights")
    if qw.g_idx is not None and not torch.equal(
        qw.g_idx.cpu().long(), torch.arange(shape[1]) // (w.group_size or shape[1])
    ):
        raise ValueError(
            f"{where}: activation-ordered groups (GPTQ actorder='group', a g_idx) cannot be saved: "
            "compressed-tensors >= 0.20 and vLLM removed g_idx support (a checkpoint with it would load "
            "wrong or not at all); quantize with actorder='weight' (alias 'static'), same format, no g_idx"
        )
    if w.type == "int":
        qmin, qmax = quant_range(w.num_bits)
        if qw.q.min() < qmin or qw.q.max() > qmax:
            raise ValueError(f"{where}: codes leave the {w.num_bits}-bit range [{qmin:g}, {qmax:g}]")


def _check_input_qparams(where: str, qw: QuantizedWeight) -> None:
    """Static input activations need their calibrated scale (and zero point exactly when asymmetric)."""
    inputs, outputs = qw.scheme.input_activations, qw.scheme.output_activations
    if outputs is not None:
        raise ValueError(
            f"{where}: output activation quantization is not supported; remove output_activations"
        )
    static = inputs is not None and inputs.dynamic is False
    nvfp4 = inputs is not None and str(getattr(inputs.dynamic, "value", inputs.dynamic)) == "local"
    if nvfp4 != (qw.input_global_scale is not None):
        raise ValueError(
            f"{where}: input_global_scale must be given exactly for NVFP4 input activations (dynamic 'local'); "
            "quantize it with a modifier given calibration data (QuantizationModifier or GPTQModifier)"
        )
    if static and qw.input_scale is None:
        raise ValueError(
            f"{where}: the scheme has static input activations but no calibrated input_scale; quantize it "
            "with a modifier given calibration data (QuantizationModifier or GPTQModifier with a dataset)"
        )
    if not static and (qw.input_scale is not None or qw.input_zero_point is not None):
        raise ValueError(f"{where}: input_scale is set but the scheme's input activations are not static")
    if static and (qw.input_zero_point is None) != inputs.symmetric:
        raise ValueError(
            f"{where}: input_zero_point must be None exactly when the input activations are symmetric"
        )


def _compressed(name: str, qw: QuantizedWeight, shape: tuple[int, ...]) -> dict[str, Tensor]:
    """The tensors compressed-tensors stores for one quantized weight (local names, module docstring)."""
    _check_quantized(name, qw, shape)
    w = qw.scheme.weights
    fmt = weight_format(qw.scheme)
    if fmt is not None:  # block fp8, NVFP4, MX
        out = format_tensors(_format(qw.scheme), fmt, qw.q, qw.scale, qw.zero_point, qw.global_scale)
        if qw.input_global_scale is not None:  # NVFP4 activations: compressed-tensors' float32 [1]
            out["input_global_scale"] = qw.input_global_scale.to(torch.float32).reshape(1)
        return out
    out = {"weight_scale": qw.scale}
    zp = qw.zero_point
    if _format(qw.scheme) == "pack-quantized":
        out["weight_packed"] = pack_int32(qw.q, w.num_bits, dim=-1)  # [out, ceil(in * b / 32)]
        out["weight_shape"] = torch.tensor(shape)  # int64, as compressed-tensors' compressor writes it
        if zp is not None:  # channel/group zero points are packed across output rows, [ceil(out * b / 32), G]
            packed = strategy_of(w) in ("channel", "group")
            out["weight_zero_point"] = pack_int32(zp, w.num_bits, dim=0) if packed else zp
    else:
        out["weight"] = qw.q
        if zp is not None:
            out["weight_zero_point"] = zp
    if qw.input_scale is not None:  # static activations: compressed-tensors' input_scale [1] / [groups]
        out["input_scale"] = qw.input_scale
        if qw.input_zero_point is not None:
            out["input_zero_point"] = qw.input_zero_point
    return out


def _check_fake_quantized(name: str, weight: Tensor, qw: QuantizedWeight) -> None:
    """The weight in memory must be exactly what the checkpoint dequantizes to (integer codes with a scale per
    row compared a chunk of rows at a time: a float32 copy of a 8192-wide weight is 64 MiB)."""
    rows = weight.shape[0]
    per_row = weight_format(qw.scheme) is None and weight.dim() == 2 and qw.scale.dim() == 2
    per_row = per_row and qw.scale.shape[0] == rows
    step = max(1, CHECK_VALUES // max(weight[0].numel(), 1)) if per_row else rows
    for r in range(0, rows, step):
        part = slice(r, r + step)
        expected = _dequantized(qw, part if per_row else None, weight.dtype)
        actual = weight[part].to(expected.device)
        if not torch.equal(expected, actual):
            diff = (expected.float() - actual.float()).abs().max().item()
            raise ValueError(
                f"save: module {name!r}: its weight differs from the dequantized codes in state.results.quantized "
                f"(max |diff| {diff:.3g}); something changed the weight after it was quantized, so the checkpoint "
                "would not be the model in memory. Quantize after every weight-changing modifier"
            )


def _dequantized(qw: QuantizedWeight, rows: slice | None, dtype: torch.dtype) -> Tensor:
    """What ``qw``'s codes dequantize to in ``dtype``: the ``rows`` of integer codes with a scale per row, or all."""
    w, fmt = qw.scheme.weights, weight_format(qw.scheme)
    if fmt is not None:
        return formats.dequantize(qw.q, qw.scale, qw.zero_point, fmt, qw.global_scale, dtype=dtype)
    q, scale, zp = qw.q, qw.scale, qw.zero_point
    if rows is not None:
        q, scale, zp = q[rows], scale[rows], None if zp is None else zp[rows]
    group_size = w.group_size if strategy_of(w) == "group" else None
    return dequantize(q, scale, zp, group_size=group_size, dtype=dtype)


# Weights per chunk of rows compared by _check_fake_quantized
CHECK_VALUES = 1 << 20


def _module_tensors(
    name: str, module: torch.nn.Module, quantized: QuantizedWeight | None
) -> dict[str, Tensor]:
    """The module's own state-dict entries (no children), its weight replaced by the compressed tensors."""
    local: dict[str, Any] = {}
    module._save_to_state_dict(local, "", keep_vars=True)  # honours persistent buffers and overrides
    if quantized is not None:
        weight = local.pop("weight", None)
        if not isinstance(weight, Tensor):
            raise ValueError(f"save: module {name!r} is in state.results.quantized but has no weight")
        local.update(_compressed(name, quantized, tuple(weight.shape)))  # checks the codes first
        if weight.device.type != "meta":
            _check_fake_quantized(name, weight, quantized)
    prefix = f"{name}." if name else ""
    return {prefix + k: v for k, v in local.items()}
