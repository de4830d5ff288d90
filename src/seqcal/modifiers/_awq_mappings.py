"""AWQ's mappings (which producer's output is scaled for which consumers) and the fold of the scales.

Private to ``seqcal.modifiers.awq`` and temporary: ``seqcal.mappings`` (graph-derived (producer, consumers)
mappings, explicit-mapping resolution with ``resolve_mappings``, the ``Mapping`` dataclass, and the fold
service that also transforms cached inputs and Hessians) replaces this whole module. The modifier uses only
``AWQMapping``, ``resolve`` and ``fold_scales`` from here, so the swap touches those three names.

Resolution follows llm-compressor 0.14: a mapping is ``{smooth_layer: pattern, balance_layers: [patterns]}``;
patterns are ``re:`` regexes (``re.match`` on the module name) or exact module names / class names. For each
module the smooth pattern matches, each balance pattern takes the matching modules that share the longest
dotted prefix with it (``model.layers.3.input_layernorm`` -> ``model.layers.3.self_attn.q_proj``). The
"parent" whose output the loss compares is the balance layers' lowest common ancestor that is not a
ModuleList (a single balance layer is its own parent). A Linear producer whose output width differs from
its consumers' input width (``v_proj -> o_proj`` with grouped-query attention) is skipped, as llm-compressor
does; a fused producer three times as wide (``qkv_proj -> o_proj``) scales its last rows.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# llm-compressor's default_mappings (Llama-like decoders), used when a recipe gives none.
DEFAULT_MAPPINGS: tuple[dict[str, Any], ...] = (
    {"smooth_layer": "re:.*input_layernorm$", "balance_layers": ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]},
    {"smooth_layer": "re:.*v_proj$", "balance_layers": ["re:.*o_proj$"]},
    {"smooth_layer": "re:.*post_attention_layernorm$", "balance_layers": ["re:.*gate_proj$", "re:.*up_proj$"]},
    {"smooth_layer": "re:.*up_proj$", "balance_layers": ["re:.*down_proj$"]},
)  # fmt: skip


@dataclass
class AWQMapping:
    """One resolved mapping: ``smooth`` produces the activation that every module of ``balance`` reads.

    ``parent`` is the module whose output the grid search compares (e.g. self_attn for q/k/v, the Linear
    itself for a single consumer); ``width`` is the number of scaled channels (the balance layers' inputs).
    """

    smooth: str
    balance: list[str]
    parent: str
    width: int


def _matches(pattern: str, name: str, module: torch.nn.Module) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or pattern == type(module).__name__


def _common_depth(a: str, b: str) -> int:
    depth = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        depth += 1
    return depth


def _parent(model: torch.nn.Module, names: list[str]) -> str:
    """The lowest common ancestor of ``names`` that is not a ModuleList (its forward is never called)."""
    parts = names[0].split(".")
    depth = min(_common_depth(names[0], n) for n in names) if len(names) > 1 else len(parts)
    while depth > 0 and isinstance(model.get_submodule(".".join(parts[:depth])), torch.nn.ModuleList):
        depth -= 1
    return ".".join(parts[:depth])


def _check_entry(entry: Any, i: int, where: str) -> tuple[str, list[str]]:
    if isinstance(entry, (list, tuple)) and len(entry) == 2:  # llm-compressor's AWQMapping(smooth, balance)
        entry = {"smooth_layer": entry[0], "balance_layers": entry[1]}
    if hasattr(entry, "smooth_layer"):
        entry = {"smooth_layer": entry.smooth_layer, "balance_layers": entry.balance_layers}
    if not isinstance(entry, dict) or not isinstance(entry.get("smooth_layer"), str) or not isinstance(
        entry.get("balance_layers"), (list, tuple)
    ):  # fmt: skip
        raise ValueError(
            f"{where}: mappings[{i}] must be {{smooth_layer: 're:...', balance_layers: ['re:...', ...]}}, "
            f"got {entry!r}"
        )
    return entry["smooth_layer"], list(entry["balance_layers"])


def resolve(
    model: torch.nn.Module, mappings: Sequence[Any] | None, where: str = "AWQModifier"
) -> tuple[list[AWQMapping], list[str]]:
    """Resolve ``mappings`` (None: ``DEFAULT_MAPPINGS``) against ``model``'s module names.

    Args:
        model: the model (parameters may be on meta: only names and shapes are read).
        mappings: llm-compressor's ``mappings`` argument, or None for the Llama-like defaults.
        where: the modifier's name, for messages.

    Returns:
        ``(resolved mappings in model order per mapping, skipped "smooth -> balance: why" lines)``.

    Raises:
        ValueError: an explicit pattern matches nothing, or balance layers of one mapping differ in input width
            (one sentence naming the mapping and the fix).
    """
    explicit = mappings is not None
    modules = dict(model.named_modules())
    resolved: list[AWQMapping] = []
    skipped: list[str] = []
    for i, entry in enumerate(mappings if explicit else DEFAULT_MAPPINGS):
        smooth_pat, balance_pats = _check_entry(entry, i, where)
        smooths = [n for n, m in modules.items() if n and _matches(smooth_pat, n, m)]
        if not smooths and explicit:
            raise ValueError(f"{where}: mappings[{i}].smooth_layer {smooth_pat!r} matches no module of the "
                             "model; use a 're:' pattern on module names such as 're:.*input_layernorm$'")  # fmt: skip
        for smooth in smooths:
            balance: list[str] = []
            for pat in balance_pats:
                found = [n for n, m in modules.items() if n and n != smooth and _matches(pat, n, m)]
                if not found:
                    if explicit:
                        raise ValueError(f"{where}: mappings[{i}].balance_layers pattern {pat!r} matches no "
                                         f"module of the model (smooth layer {smooth}); fix the pattern")  # fmt: skip
                    continue
                depth = max(_common_depth(smooth, n) for n in found)
                balance += [n for n in found if _common_depth(smooth, n) == depth and n not in balance]
            if not balance:
                continue
            mapping = _mapping(model, smooth, balance, i, where)
            if isinstance(mapping, str):
                skipped.append(mapping)
            else:
                resolved.append(mapping)
    if not resolved and not skipped:
        raise ValueError(f"{where}: no AWQ mapping applies to this model (the default mappings are Llama's: "
                         "input_layernorm -> q/k/v_proj, ...); give `mappings` that name its modules")  # fmt: skip
    return resolved, skipped


def _mapping(model: torch.nn.Module, smooth: str, balance: list[str], i: int, where: str) -> AWQMapping | str:
    widths = {n: getattr(model.get_submodule(n), "in_features", None) for n in balance}
    if None in widths.values():
        bad = next(n for n, w in widths.items() if w is None)
        raise ValueError(f"{where}: mappings[{i}] balance layer {bad} is a {type(model.get_submodule(bad)).__name__}, "
                         "not a Linear; balance_layers must name the Linear layers that read the smooth layer's output")  # fmt: skip
    if len(set(widths.values())) > 1:
        raise ValueError(f"{where}: mappings[{i}] balances layers of different input widths ({widths}) for smooth "
                         f"layer {smooth}; all balance layers must read the same activation")  # fmt: skip
    width = next(iter(widths.values()))
    producer = model.get_submodule(smooth)
    if isinstance(producer, torch.nn.Linear):
        if producer.out_features not in (width, 3 * width):
            return f"{smooth} -> {', '.join(balance)}: output width {producer.out_features} != input width {width}"
    else:
        weight = getattr(producer, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] != width:
            raise ValueError(f"{where}: mappings[{i}] smooth layer {smooth} ({type(producer).__name__}) has no "
                             f"per-channel weight of width {width} to fold the scales into; choose a norm or a "
                             "Linear whose output the balance layers read")  # fmt: skip
    return AWQMapping(smooth, balance, _parent(model, balance), width)


@torch.no_grad()
def fold_scales(model: torch.nn.Module, mapping: AWQMapping, s: torch.Tensor) -> None:
    """Divide ``mapping.smooth``'s output by ``s`` and multiply the balance weights' columns by ``s``.

    The float model computes the same function afterwards: the balance layers see ``X / s`` and have ``W s``.
    For a norm producer the division goes into its weight (and bias); that it scales the output is checked
    on a probe, so a norm that computes ``x * (1 + weight)`` (Gemma) is refused instead of folded wrongly.

    Args:
        model: the model, the mapping's modules onloaded.
        mapping: from ``resolve``.
        s: ``[width]`` positive scales.

    Raises:
        ValueError: the producer's output is not scaled by its weight.
    """
    producer = model.get_submodule(mapping.smooth)
    weight = producer.weight
    s = s.to(weight.device)
    if isinstance(producer, torch.nn.Linear):  # rows of the producer (the last ones of a fused qkv)
        rows = weight.data[-s.shape[0] :]
        rows.div_(s.view(-1, 1).to(rows.dtype))
        if producer.bias is not None:
            producer.bias.data[-s.shape[0] :].div_(s.to(producer.bias.dtype))
    else:
        probe = torch.randn(2, s.shape[0], device=weight.device, dtype=weight.dtype)
        before = producer(probe).float()
        weight.data.div_(s.to(weight.dtype))
        if getattr(producer, "bias", None) is not None:
            producer.bias.data.div_(s.to(producer.bias.dtype))
        after = producer(probe).float()
        if not torch.allclose(after * s.float(), before, rtol=1e-2, atol=1e-3 * float(before.abs().max())):
            weight.data.mul_(s.to(weight.dtype))
            if getattr(producer, "bias", None) is not None:
                producer.bias.data.mul_(s.to(producer.bias.dtype))
            raise ValueError(f"AWQModifier: {mapping.smooth} ({type(producer).__name__}) does not scale its output "
                             "by its weight, so the AWQ scales cannot be folded into it; leave it out of `mappings`")  # fmt: skip
    for name in mapping.balance:
        W = model.get_submodule(name).weight
        W.data.mul_(s.to(W.device, W.dtype).view(1, -1))
