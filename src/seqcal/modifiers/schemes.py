"""Quantization schemes: compressed-tensors' presets and config groups, resolved to modules.

We reuse compressed-tensors' scheme classes and preset names (W4A16, W8A8, FP8_DYNAMIC, ...) so that the
names mean exactly what they mean in llm-compressor and in the saved ``quantization_config``.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

from seqcal.experts import fused_modules
from seqcal.gguf.scheme import GGUF_SCHEMES, GGUFScheme, check_gguf, gguf_preset, is_gguf, per_module
from seqcal.mappings.names import checkpoint_names
from seqcal.modifiers.activations import check_activations
from seqcal.modifiers.formats import strategy_of as strategy_of  # re-exported: it lives beside the formats
from seqcal.modifiers.observers import check_weight_observer

logger = logging.getLogger("seqcal")

# Presets whose math seqcal implements: int weights (tensor/channel/group), fp8 weights (also block-wise), fp4
# NVFP4 and MX (fp4/fp6/fp8 with e8m0 group scales) weights, dynamic activations (declared in the checkpoint,
# computed at inference), static activations calibrated by observers (FP8: per-tensor fp8 inputs,
# seqcal.modifiers.activations), and NVFP4's fp4 activations (group scales at inference under a calibrated
# global scale).
SUPPORTED_PRESETS = (
    "W4A16",
    "W4A16_ASYM",
    "W8A16",
    "W8A8",
    "FP8_DYNAMIC",
    "FP8",
    "W2A16",
    "W3A16",
    "W5A16",
    "W6A16",
    "W7A16",
    "FP8_BLOCK",
    "NVFP4A16",
    "NVFP4",
    "MXFP4A16",
    "MXFP4",
    "MXFP4XFP8",
    "MXFP6A16",
    "MXFP6A8",
    "MXFP8A16",
    "MXFP8",
    "INT8",
    "W2A4",
    "W2A8",
    "W3A4",
    "W3A8",
    "W4A4",
    "W4A8",
    "W4AFP8",
    "W5A8",
    "W6A8",
    "W7A8",
)


def resolve_schemes(
    scheme: str | dict[str, Any] | None,
    config_groups: dict[str, Any] | None,
    targets: str | Sequence[str],
    where: str,
) -> dict[str, QuantizationScheme]:
    """Turn a modifier's ``scheme`` / ``config_groups`` arguments into named QuantizationSchemes.

    Args:
        scheme: a preset name ("W4A16"), a dict preset -> targets, or a dict of QuantizationArgs fields.
        config_groups: compressed-tensors config groups: name -> {targets, weights, input_activations}.
        targets: default targets of a preset given as a plain name.
        where: the modifier's name, for error messages.

    Returns:
        group name -> QuantizationScheme.

    Raises:
        ValueError: neither or both given, an unknown preset, or unsupported arguments.
    """
    if (scheme is None) == (config_groups is None):
        raise ValueError(f"{where}: give exactly one of `scheme` (e.g. 'W4A16') or `config_groups`")
    target_list = [targets] if isinstance(targets, str) else list(targets)
    groups: dict[str, QuantizationScheme] = {}
    if isinstance(scheme, str):
        groups["group_0"] = _preset(scheme, target_list, where)
    elif isinstance(scheme, dict):
        for i, (preset, preset_targets) in enumerate(scheme.items()):
            preset_targets = [preset_targets] if isinstance(preset_targets, str) else list(preset_targets)
            groups[f"group_{i}"] = _preset(preset, preset_targets, where)
    else:
        for name, group in (config_groups or {}).items():
            try:
                groups[name] = QuantizationScheme.model_validate(group)
            except Exception as exc:  # pydantic's ValidationError lists the bad fields
                raise ValueError(f"{where}: config_groups[{name!r}] is not a valid scheme: {exc}") from exc
    for name, group in groups.items():
        check_supported(group, f"{where} group {name!r}")
    return groups


def _preset(name: str, targets: list[str], where: str) -> QuantizationScheme:
    key = name.upper()
    if is_gguf(key):  # llama.cpp's types and mixes (seqcal.gguf), written with output_format="gguf"
        return gguf_preset(key, targets)
    if key not in PRESET_SCHEMES:
        raise ValueError(
            f"{where}: unknown scheme {name!r}; valid presets: {', '.join(SUPPORTED_PRESETS)}; "
            f"GGUF: {', '.join(GGUF_SCHEMES)}"
        )
    scheme = preset_name_to_scheme(key, targets)
    if key not in SUPPORTED_PRESETS:
        check_supported(
            scheme, f"{where} preset {name!r}"
        )  # names the missing feature, e.g. static activations
        raise ValueError(
            f"{where}: scheme {name!r} is a compressed-tensors preset seqcal does not implement yet; "
            f"supported: {', '.join(SUPPORTED_PRESETS)}"
        )
    return scheme


def check_supported(scheme: QuantizationScheme, where: str) -> None:
    """Reject what the math in seqcal.algorithms does not implement, before any work starts."""
    if isinstance(scheme, GGUFScheme):
        return check_gguf(scheme, where)
    weights = scheme.weights
    if weights is None:
        raise ValueError(f"{where}: no weight quantization; seqcal quantizes weights (W*A16, W8A8, FP8)")
    strategy = strategy_of(weights)
    if strategy not in ("tensor", "channel", "group", "block", "tensor_group"):
        raise ValueError(
            f"{where}: weight strategy {strategy!r} is not supported; use tensor, channel, group, block or "
            "tensor_group"
        )
    check_weight_observer(weights, where)  # an unknown name or search setting, before any calibration
    _check_weight_format(weights, strategy, where)
    check_activations(scheme, where)  # observers and strategies of the activations


def _check_weight_format(weights: QuantizationArgs, strategy: str, where: str) -> None:
    """Weight formats compressed-tensors can write: fp8 (plain, block or MX), NVFP4, MXFP4, MXFP6, int."""
    kind, bits, group, scale_dtype = str(getattr(weights.type, "value", weights.type)), weights.num_bits, \
        weights.group_size, weights.scale_dtype  # fmt: skip
    mx = strategy == "group" and group == 32 and scale_dtype == torch.uint8
    if kind == "float" and bits == 4:
        nvfp4 = strategy == "tensor_group" and group == 16 and scale_dtype in (None, torch.float8_e4m3fn)
        if not (nvfp4 or mx):
            raise ValueError(
                f"{where}: fp4 weights are NVFP4 (strategy tensor_group, group_size 16, fp8 scales) or MXFP4 "
                f"(strategy group, group_size 32, scale_dtype uint8), got strategy {strategy!r}, group_size "
                f"{group}; use the NVFP4A16 or MXFP4A16 preset"
            )
    elif kind == "float" and bits == 6:
        if not mx:
            raise ValueError(
                f"{where}: fp6 weights are MXFP6 (group, group_size 32, scale_dtype uint8); use MXFP6A16"
            )
    elif kind == "float" and bits != 8:
        raise ValueError(f"{where}: float weights must be 4-, 6- or 8-bit (fp4 e2m1, fp6 e2m3, fp8 e4m3)")
    elif scale_dtype is not None and not (mx or (kind == "float" and strategy == "tensor_group")):
        raise ValueError(
            f"{where}: scale_dtype {scale_dtype} is only supported by MX (uint8) and NVFP4 (fp8) formats"
        )
    if strategy == "tensor_group" and not (kind == "float" and bits == 4):
        raise ValueError(f"{where}: strategy tensor_group (a global scale) is for fp4 weights (NVFP4) only")
    if strategy == "block" and not (kind == "float" and bits == 8):
        raise ValueError(
            f"{where}: the block strategy is for fp8 weights (FP8_BLOCK); use group for int weights"
        )
    new_format = (
        strategy in ("block", "tensor_group") or scale_dtype is not None or bits in (4, 6) and kind == "float"
    )
    if new_format and weights.observer not in (None, "minmax", "memoryless_minmax", "static_minmax"):
        raise ValueError(
            f"{where}: observer {weights.observer!r} is not supported for this format; use minmax"
        )


def matches_target(
    module: torch.nn.Module, name: str, patterns: Sequence[str], alias: str | None = None
) -> bool:
    """compressed-tensors' matching: a class name ("Linear"), an ``re:`` pattern or the qualified name itself.

    Names are tried as the model has them in memory and, when given, as the checkpoint has them (``alias``, from
    ``seqcal.mappings.names.checkpoint_names``: transformers 5 renames some modules at load).

    Example:
        >>> matches_target(torch.nn.Linear(1, 1), "m.mlp.gate", ["re:.*block_sparse_moe.gate"], "m.block_sparse_moe.gate")
        True
    """
    names = (name,) if alias is None else (name, alias)
    for pattern in patterns:
        if pattern.startswith("re:"):
            if any(re.match(pattern[3:], n) for n in names):
                return True
        elif pattern in names or type(module).__name__ == pattern:
            return True
    return False


def resolve_modules(
    model: torch.nn.Module,
    groups: dict[str, QuantizationScheme],
    ignore: Sequence[str],
    where: str = "recipe",
    warnings: list[str] | None = None,
) -> dict[str, QuantizationScheme]:
    """Module name -> scheme for every Linear matched by a group's targets and not ignored.

    The first group that matches wins, as in compressed-tensors. Only ``nn.Linear`` weights are quantized
    (embeddings and norms are not), whatever the target pattern.

    Args:
        model: the model the recipe is applied to.
        groups: the modifier's schemes, each with its ``targets``.
        ignore: class names or ``re:`` patterns of modules left in full precision.
        where: the modifier's name, for error messages.
        warnings: a list that gets one line per ignore entry that matches no module (for the run's report).

    Patterns match a module's in-memory name or its checkpoint name (``seqcal.mappings.names``).

    Returns:
        Qualified module name -> its scheme, in module order.

    Raises:
        ValueError: a target matches no module of the model; the message names the pattern and the close names.

    Example:
        >>> resolve_modules(model, resolve_schemes("W4A16", None, "Linear", "m"), ["lm_head"])  # doctest: +SKIP
    """
    modules = list(model.named_modules())
    aliases = checkpoint_names(model)
    missed = _check_patterns(
        model, modules, [t for g in groups.values() for t in g.targets], ignore, where, aliases
    )
    if warnings is not None:
        warnings += missed
    found: dict[str, QuantizationScheme] = {}
    for name, module in modules:
        if not isinstance(module, torch.nn.Linear) or matches_target(module, name, ignore, aliases.get(name)):
            continue
        for group in groups.values():
            if matches_target(module, name, group.targets, aliases.get(name)):
                found[name] = group
                break
    _refuse_fused(model, [t for g in groups.values() for t in g.targets], ignore, where, aliases)
    return per_module(model, found, where)  # a GGUF mix's type per module, llama.cpp's width fallbacks


def _refuse_fused(
    model: torch.nn.Module, targets: list[str], ignore: Sequence[str], where: str, aliases: dict[str, str]
) -> None:
    """DESIGN invariant 9: weights of 3+ dimensions the targets reach (fused experts seqcal could not take
    apart into Linears) would be saved in full precision; refuse before any work instead of saying nothing.

    The targets reach such a module when they select every Linear (its weights play that part), or when a
    class or ``re:`` pattern matches the module or one of its parameters.
    """

    reached = []
    for name, module in fused_modules(model):
        if matches_target(module, name, ignore, aliases.get(name)):
            continue
        params = [f"{name}.{p}" for p, t in module.named_parameters(recurse=False) if t.dim() >= 3]
        named = [(name, aliases.get(name)), *((p, None) for p in params)]
        if "Linear" in targets or any(matches_target(module, n, targets, a) for n, a in named):
            reached.append((name, module, params))
    if reached:
        name, module, params = reached[0]
        shapes = ", ".join(f"{p.rsplit('.', 1)[-1]} {list(model.get_parameter(p).shape)}" for p in params)
        pattern = re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name))
        raise ValueError(
            f"{where}: {len(reached)} module(s) hold fused weights of 3+ dimensions that seqcal cannot quantize, "
            f"e.g. {name} ({type(module).__name__}: {shapes}); the recipe's targets {targets} reach them and "
            f"they would be saved in full precision; to keep them so knowingly, add 're:{pattern}$' to ignore"
        )


def _check_patterns(
    model: torch.nn.Module,
    modules: list[tuple[str, torch.nn.Module]],
    targets: list[str],
    ignore: Sequence[str],
    where: str,
    aliases: dict[str, str] | None = None,
) -> list[str]:
    """Refuse a target that matches no module; warn about an ignore entry that matches none.

    "Linear" is left to the caller's "no Linear layer" check. An ignore entry that matches nothing changes
    nothing (a recipe shared across models names what this architecture does not have, or it is a typo): it is
    logged as a warning naming it, with the closest names, and returned for the run's report.

    Returns:
        The warnings (one per ignore entry that matches nothing), to be added to ``RunState.log``.
    """
    aliases = aliases if aliases is not None else checkpoint_names(model)
    warnings = []
    for kind, patterns in (("targets", [t for t in targets if t != "Linear"]), ("ignore", list(ignore))):
        for pattern in dict.fromkeys(patterns):
            if any(matches_target(m, n, [pattern], aliases.get(n)) for n, m in modules):
                continue
            hint = _near(pattern, modules)
            message = f"{where}: {kind} entry {pattern!r} matches no module of {type(model).__name__}{hint}"
            if kind == "targets":
                raise ValueError(message)
            logger.warning("seqcal: %s; it changes nothing here", message)
            warnings.append(f"{message}; it changes nothing here")
    return warnings


def _near(pattern: str, modules: list[tuple[str, torch.nn.Module]]) -> str:
    """A hint with the closest class names (for a class name) or module names (for an ``re:`` pattern)."""
    classes = sorted({type(m).__name__ for _, m in modules})
    if pattern.startswith("re:"):
        # Compare the pattern's literal tail ("q_prj" of "re:.*q_prj") with the modules' last name parts.
        tail = re.sub(r"[^\w.]", "", pattern[3:].split("*")[-1]).strip(".").rsplit(".", 1)[-1]
        leaves = sorted({n.rsplit(".", 1)[-1] for n, _ in modules if n})
        close = difflib.get_close_matches(tail, leaves, n=3, cutoff=0.6)
        valid = "an 're:' pattern is matched with re.match from the start of the qualified module name"
        hint = f" (close module names: {', '.join(close)}); {valid}" if close else f"; {valid}"
        return hint
    names = classes + [n for n, _ in modules if n]
    close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    valid = f"give a module class name (one of {', '.join(classes[:12])}) or an 're:' name pattern"
    return f"{hint}; {valid}"
