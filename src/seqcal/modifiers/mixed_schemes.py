"""What a mixed-precision allocation chooses from and what each choice costs.

``candidate_scheme`` reads a candidate: a compressed-tensors preset (``"W4A16"``, ``"NVFP4A16"``,
``"MXFP4A16"``, ``"FP8_DYNAMIC"``), optionally with its group changed (``"W3A16:g64"``, ``"W8A16:channel"``),
its weights' range searched (``OBSERVER``), or a dict of QuantizationScheme fields (its observer its own).
``stored_bits`` is what a module's weight takes in the checkpoint under a scheme, as ``seqcal.checkpoint``
writes it: packed codes, scales in the weight's dtype (fp8 for NVFP4, e8m0 for MX), zero points packed along
the outputs, NVFP4's global scale and the packed weights' shape. ``allocation_units`` groups the modules that
must share one scheme because a serving engine loads them as one weight (q/k/v, gate/up:
``modifiers.formats.fused_groups``; the experts of one MoE layer, one tensor).

Example:
    >>> candidate_scheme("W3A16:g64", ["Linear"], "m").weights.group_size
    64
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationScheme

from seqcal.modifiers.activations import calibrated_inputs
from seqcal.modifiers.formats import fused_groups, strategy_of
from seqcal.modifiers.schemes import SUPPORTED_PRESETS, check_supported, resolve_schemes

_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")  # "model.layers.3.mlp.experts.17.down_proj" -> its MoE layer
_SUFFIX = re.compile(r"^g(\d+)$|^channel$")
# the weight observer of a candidate or pin named by a preset: a range search below min-max weighted by the inputs'
# E[x^2] (at 2 and 3 bits the presets' min-max ranges cost more than the allocation wins, and an unweighted search
# half of what this one gains: benchmarks/RESULTS.md); a dict candidate keeps its own
OBSERVER = "imatrix_mse"


def candidate_scheme(spec: str | dict[str, Any], targets: list[str], where: str) -> QuantizationScheme:
    """The scheme a candidate names, with ``targets``.

    Args:
        spec: a preset, ``PRESET:g<N>`` / ``PRESET:channel`` (its weights' group changed), or scheme fields.
        targets: the scheme's targets (the modifier's, or a pin's pattern).
        where: the modifier's name, for errors.

    Raises:
        ValueError: one sentence naming the candidate, why it is not one, and the valid forms.
    """
    valid = (f"a candidate is a preset ({', '.join(p for p in SUPPORTED_PRESETS if 'A16' in p or 'FP8' in p)}), "
             "a preset with ':g<group size>' or ':channel' (e.g. 'W3A16:g64'), or a dict of scheme fields")  # fmt: skip
    if isinstance(spec, dict):
        fields = {k: v for k, v in spec.items() if k != "targets"}
        try:
            scheme = resolve_schemes(None, {"c": {**fields, "targets": targets}}, targets, where)["c"]
        except ValueError as exc:
            raise ValueError(
                f"{where}: candidate {spec!r} is not a scheme seqcal can quantize ({exc}); {valid}"
            ) from None
    elif isinstance(spec, str):
        preset, _, suffix = spec.partition(":")
        if suffix and not _SUFFIX.match(suffix):
            raise ValueError(
                f"{where}: candidate {spec!r} has suffix {suffix!r}, not 'g<N>' or 'channel'; {valid}"
            )
        try:
            scheme = resolve_schemes({preset: targets}, None, targets, where)["group_0"]
        except ValueError:
            raise ValueError(f"{where}: candidate {spec!r} is not a scheme seqcal knows; {valid}") from None
        if suffix:
            scheme = _regrouped(scheme, suffix, spec, where)
        scheme = _searched(scheme)
    else:
        raise ValueError(f"{where}: candidate {spec!r} is a {type(spec).__name__}; {valid}")
    if calibrated_inputs(scheme) is not None:
        raise ValueError(
            f"{where}: candidate {spec!r} has input activations calibrated on data (static or NVFP4 scales), which "
            "an allocation chosen after calibration cannot give; use a weight-only or dynamic candidate"
        )
    return scheme


def _searched(scheme: QuantizationScheme) -> QuantizationScheme:
    """An integer preset's scheme with the ``OBSERVER`` range search in place of its min-max range (the fp4, MX and
    block fp8 formats take min-max ranges only: ``schemes.check_supported``)."""
    w = scheme.weights
    if w is not None and str(getattr(w.type, "value", w.type)) == "int" and w.observer in (None, "minmax"):
        scheme = scheme.model_copy(deep=True)
        scheme.weights.observer = OBSERVER
    return scheme


def _regrouped(scheme: QuantizationScheme, suffix: str, spec: str, where: str) -> QuantizationScheme:
    """``scheme`` with integer weights per group of ``g<N>`` or per channel."""
    w = scheme.weights
    if str(getattr(w.type, "value", w.type)) != "int" or strategy_of(w) not in ("group", "channel"):
        raise ValueError(f"{where}: candidate {spec!r}: only integer group or channel presets take a group "
                         f"suffix; use {spec.partition(':')[0]!r} as it is")  # fmt: skip
    update = {"strategy": "channel", "group_size": None} if suffix == "channel" else \
        {"strategy": "group", "group_size": int(suffix[1:])}  # fmt: skip
    scheme = scheme.model_copy(update={"weights": w.model_copy(update=update)}, deep=True)
    scheme = QuantizationScheme.model_validate(scheme.model_dump())  # checked again by its own validators
    check_supported(scheme, f"{where} candidate {spec!r}")
    return scheme


def stored_bits(scheme: QuantizationScheme, shape: tuple[int, int], scale_bits: int) -> float:
    """Bits the checkpoint stores for a ``[out, in]`` weight under ``scheme`` (codes, scales, zero points).

    Args:
        scheme: the weight's scheme.
        shape: ``(out, in)``.
        scale_bits: bits of a float scale (the weight's dtype: 32 for float32 models, 16 for bfloat16).

    Example:
        >>> stored_bits(candidate_scheme("W4A16", ["Linear"], "m"), (128, 256), 32) / (128 * 256)
        4.25390625
    """
    w, (out, n_in) = scheme.weights, shape
    kind, bits, strategy = str(getattr(w.type, "value", w.type)), w.num_bits, strategy_of(w)
    if strategy == "tensor_group":  # NVFP4: fp4 codes, an fp8 scale per 16, one float32 global scale
        return out * n_in * bits + out * (n_in // w.group_size) * 8 + 32
    if w.scale_dtype == torch.uint8:  # MX: e8m0 scales per group of 32
        return out * n_in * bits + out * (n_in // w.group_size) * 8
    groups = {"tensor": 1, "channel": out, "group": out * (n_in // (w.group_size or n_in))}.get(strategy, 0)
    if strategy == "block":
        groups = math.ceil(out / w.block_structure[0]) * math.ceil(n_in / w.block_structure[1])
    if kind == "float":  # fp8 codes as they are, float scales
        return out * n_in * bits + groups * scale_bits
    codes = out * math.ceil(n_in * bits / 32) * 32  # int32 words per row
    zeros = 0 if w.symmetric else math.ceil(out * bits / 32) * 32 * max(groups // out, 1)
    return codes + groups * scale_bits + zeros + 2 * 64  # weight_shape: two int64


def holds(model: torch.nn.Module, name: str, scheme: QuantizationScheme) -> bool:
    """Whether ``scheme`` can quantize module ``name``: its weight groups and fp4 / fp6 packing divide the
    inputs (``formats.check_widths`` without its fused-block check, which looks at every module)."""
    w, inputs = scheme.weights, model.get_submodule(name).weight.shape[-1]
    sizes = [w.group_size] if strategy_of(w) in ("group", "tensor_group") and w.group_size else []
    if str(getattr(w.type, "value", w.type)) == "float" and w.num_bits in (4, 6):
        sizes.append(2 if w.num_bits == 4 else 4)
    return all(inputs % size == 0 for size in sizes)


def allocation_units(model: torch.nn.Module, names: list[str]) -> list[tuple[str, ...]]:
    """``names`` grouped into the units that take one scheme together, in module order.

    A unit is a group vLLM fuses into one weight (q/k/v, gate/up, an expert's gate/up), or every expert
    projection of one MoE layer (its experts are one tensor in the engine), or a module alone.
    """
    parent = {n: n for n in names}

    def root(n: str) -> str:
        while parent[n] != n:
            n = parent[n]
        return n

    def join(members: list[str]) -> None:
        for m in members[1:]:
            parent[root(m)] = root(members[0])

    for group in fused_groups(model, names):
        join(list(group))
    layers: dict[str, list[str]] = {}
    for n in names:
        if match := _EXPERT.match(n):
            layers.setdefault(match.group(1), []).append(n)
    for members in layers.values():
        join(members)
    units: dict[str, list[str]] = {}
    for n in names:
        units.setdefault(root(n), []).append(n)
    return [tuple(m) for m in units.values()]


def unit_key(members: tuple[str, ...]) -> str:
    """A unit's name: its module's, or the experts' layer (``...mlp.experts``), or the fused names joined."""
    if len(members) == 1:
        return members[0]
    if match := _EXPERT.match(members[0]):
        return match.group(1)
    prefix = members[0].rsplit(".", 1)[0]
    return f"{prefix}.{'+'.join(m.rsplit('.', 1)[-1] for m in members)}"
