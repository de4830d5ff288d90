"""Schemes as weight formats, the modules vLLM fuses, and the width checks a format needs before any work.

``weight_format`` turns a compressed-tensors scheme into a ``seqcal.algorithms.formats.WeightFormat`` for the
formats beyond plain int / fp8 scales (FP8_BLOCK, NVFP4A16, MX). ``fused_groups`` finds the sibling Linears
vLLM loads as one merged weight (q/k/v, gate/up, per-expert gate/up): their NVFP4 global scales must be one
value, and block-FP8 blocks must not straddle two of them. ``check_bits`` refuses code widths the quantizers
cannot produce when the modifier is built (so a recipe names its line); ``check_widths`` refuses, before
calibration, modules whose widths the format cannot hold.

Example:
    >>> weight_format(preset_name_to_scheme("NVFP4A16", ["Linear"])).strategy  # doctest: +SKIP
    'tensor_group'
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from seqcal.algorithms.formats import WeightFormat, global_scale_of
from seqcal.experts import LinearExperts
from seqcal.gguf.grids import gguf_format
from seqcal.gguf.scheme import GGUFScheme

# Sibling Linears that vLLM loads as one merged weight (its models' ``packed_modules_mapping``), by leaf name:
# matched under any parent module, so any architecture using these names is covered.
FUSED_SIBLINGS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "w13": ("w1", "w3"),  # Mixtral-style expert and MLP projections
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),  # multi-head latent attention (DeepSeek V2/V3)
}


def strategy_of(args: QuantizationArgs) -> str:
    """The strategy of ``args`` as a plain string ("tensor", "channel", "group", ...)."""
    return str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)


def _value(x: object) -> object:
    return getattr(x, "value", x)


def weight_format(scheme: QuantizationScheme) -> WeightFormat | None:
    """The scheme's weight format when it needs ``seqcal.algorithms.formats`` (block, NVFP4, MX, fp4/fp6),
    else None (plain tensor / channel / group int or fp8, which ``seqcal.algorithms.quant`` handles).

    Args:
        scheme: a compressed-tensors scheme with weights.

    Returns:
        The format, or None.
    """
    if isinstance(scheme, GGUFScheme):  # a GGUF type's own grid and scales (seqcal.gguf)
        return gguf_format(scheme.gguf_type)
    w = scheme.weights
    strategy, kind = str(_value(w.strategy)), str(_value(w.type))
    scale = "e8m0" if w.scale_dtype == torch.uint8 else "fp8" if strategy == "tensor_group" else "float"
    if strategy in ("tensor", "channel", "group") and scale == "float" and (kind == "int" or w.num_bits == 8):
        return None
    block = tuple(w.block_structure) if w.block_structure else None
    return WeightFormat(
        num_bits=w.num_bits, type=kind, strategy=strategy, symmetric=w.symmetric,
        group_size=w.group_size, block=block, scale=scale,  # type: ignore[arg-type]
    )  # fmt: skip


def fused_groups(model: torch.nn.Module, names: Iterable[str]) -> list[tuple[str, ...]]:
    """Groups of ``names`` (quantized modules) that vLLM merges into one weight, in merged order.

    A group is a set of sibling Linears named as in ``FUSED_SIBLINGS`` (or as the gate and up projections of
    linearized experts), all in ``names`` and reading inputs of one width.

    Args:
        model: the model.
        names: qualified names of the quantized Linears.

    Returns:
        Tuples of qualified names, e.g. ``("model.layers.0.self_attn.q_proj", ..k_proj, ..v_proj)``.
    """

    selected = set(names)
    leaf_sets = set(FUSED_SIBLINGS.values())
    for module in model.modules():
        if isinstance(module, LinearExperts) and module.layout.has_gate:
            leaf_sets.add(tuple(module.layout.names[:2]))
    groups = []
    for parent_name, parent in model.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        for leaves in leaf_sets:
            members = [f"{prefix}{leaf}" for leaf in leaves]
            children = [getattr(parent, leaf, None) for leaf in leaves]
            if not all(isinstance(c, torch.nn.Linear) for c in children) or not selected.issuperset(members):
                continue
            if len({c.in_features for c in children}) == 1:  # type: ignore[union-attr]
                groups.append(tuple(members))
    return groups


def shared_global_scales(
    model: torch.nn.Module, names: list[str], groups: list[tuple[str, ...]], done: dict[str, torch.Tensor]
) -> None:
    """Fill ``done`` with the NVFP4 global scale of each of ``names`` not in it yet: the minimum over its fused
    group (the group's largest magnitude), computed from the weights before any member is quantized.

    Args:
        model: the model (the group members' weights must be loaded).
        names: modules about to be quantized with a ``tensor_group`` format.
        groups: from :func:`fused_groups`.
        done: module name -> float32 [1] global scale; updated in place.
    """
    group_of = {m: g for g in groups for m in g}
    for name in names:
        if name in done:
            continue
        members = group_of.get(name, (name,))
        weights = [model.get_submodule(m).weight for m in members]
        if any(w.is_meta for w in weights):
            raise RuntimeError(
                f"NVFP4 global scale of {name}: the weights of {', '.join(members)} (one vLLM weight) must be "
                "loaded together; they are in different subgraphs of this run"
            )
        scale = torch.stack([global_scale_of(w.detach()) for w in weights]).amin().reshape(1)
        done.update({m: scale.clone() for m in members})  # own tensors: safetensors refuses shared memory


# Code widths the quantizers produce (``seqcal.algorithms.quant.quant_range`` for int codes; fp4 / fp6 / fp8 grids
# in ``seqcal.algorithms.formats``), by the scheme part and its type.
CODE_BITS: dict[str, range | tuple[int, ...]] = {"int": range(1, 9), "float": (4, 6, 8)}
_ACTIVATION_FLOAT_BITS = (4, 8)  # fp8 inputs, NVFP4 inputs


def check_bits(scheme: QuantizationScheme, where: str) -> None:
    """Refuse a ``num_bits`` the quantizers cannot produce, when the modifier is built (before any model is read).

    Args:
        scheme: a modifier's config group.
        where: the modifier and group, for the message.

    Raises:
        ValueError: one sentence naming the part (weights, input_activations), its ``num_bits`` and the widths
            that work.

    Example:
        >>> check_bits(QuantizationScheme(targets=["Linear"], weights={"num_bits": 16}), "m")  # doctest: +SKIP
        ValueError: m: weights num_bits 16 is not supported for int codes; ...
    """
    for part in ("weights", "input_activations"):
        args = getattr(scheme, part)
        if args is None:
            continue
        kind = str(_value(args.type))
        allowed = _ACTIVATION_FLOAT_BITS if part != "weights" and kind == "float" else CODE_BITS.get(kind, ())
        if args.num_bits not in allowed:
            widths = (
                f"{allowed[0]} to {allowed[-1]}"
                if isinstance(allowed, range)
                else "/".join(map(str, allowed))
            )
            raise ValueError(
                f"{where}: {part} num_bits {args.num_bits} is not supported for {kind} codes (seqcal quantizes "
                f"{kind} {part} to {widths} bits); use one of those widths, or leave the modules in full "
                "precision by adding them to ignore"
            )


def check_widths(model: torch.nn.Module, modules: dict[str, QuantizationScheme], where: str) -> None:
    """Refuse, before any calibration, modules whose widths their format cannot hold.

    Checks: weight groups (and fp4 / fp6 packing) dividing the inputs, dynamic activation groups dividing the
    inputs (FP8_BLOCK's 128, MXFP4's 32), and block heights fitting the modules vLLM merges (all but the last
    of q/k/v or gate/up must have a multiple of the block height as output rows).

    Raises:
        ValueError: one sentence naming the module(s), the reason and the fix.
    """
    ragged: dict[tuple[str, int], list[str]] = {}  # (what, size) -> "name (N inputs)"
    for name, scheme in modules.items():
        inputs = model.get_submodule(name).weight.shape[-1]
        w, acts = scheme.weights, scheme.input_activations
        sizes = []
        if str(_value(w.strategy)) in ("group", "tensor_group"):
            sizes.append(("weight group_size", w.group_size))
        if str(_value(w.type)) == "float" and w.num_bits in (4, 6):
            sizes.append((f"fp{w.num_bits} packing", 2 if w.num_bits == 4 else 4))
        if acts is not None and str(_value(acts.strategy)) in ("group", "tensor_group") and acts.group_size:
            sizes.append(("activation group_size", acts.group_size))
        for what, size in sizes:
            if inputs % size:
                ragged.setdefault((what, size), []).append(f"{name} ({inputs} inputs)")
    for (what, size), names in ragged.items():
        raise ValueError(
            f"{where}: {what} {size} does not divide the inputs of {len(names)} module(s): "
            f"{', '.join(names[:5])}; choose a scheme whose group size divides them, or add them to ignore"
        )
    _check_block_fits(model, modules, where)


def _check_block_fits(model: torch.nn.Module, modules: dict[str, QuantizationScheme], where: str) -> None:
    """vLLM merges q/k/v (gate/up) into one block-quantized weight whose blocks may not straddle two of them."""
    for group in fused_groups(
        model, [n for n, s in modules.items() if str(_value(s.weights.strategy)) == "block"]
    ):
        height = modules[group[0]].weights.block_structure[0]
        for name in group[:-1]:
            rows = model.get_submodule(name).weight.shape[0]
            if rows % height:
                raise ValueError(
                    f"{where}: block {modules[name].weights.block_structure} does not fit {name}, whose {rows} "
                    f"output rows are not a multiple of the block height {height}, and vLLM merges it with "
                    f"{', '.join(n.rsplit('.', 1)[-1] for n in group if n != name)} into one weight; use a block "
                    "height dividing every merged part but the last, or add them to ignore"
                )
