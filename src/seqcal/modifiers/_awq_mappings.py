"""AWQ's mappings in llm-compressor's format: which producer's output is scaled for which consumers.

A recipe's ``mappings`` are ``{smooth_layer: pattern, balance_layers: [patterns]}`` (or llm-compressor's
``AWQMapping(smooth, balance)`` pairs), matched by ``seqcal.mappings.matches``; for each module the smooth
pattern matches, each balance pattern takes the matching modules that share the longest dotted prefix with
it (``model.layers.3.input_layernorm`` -> ``model.layers.3.self_attn.q_proj``). Without ``mappings`` the
modifier derives them from the traced graph (``seqcal.mappings``, :func:`from_mapping`) and falls back to
llm-compressor's Llama defaults (:data:`DEFAULT_MAPPINGS`) only when the model cannot be traced with its
Linears as nodes. Beyond the shared mapping, AWQ needs the "parent" whose output its loss compares: the
balance layers' lowest common ancestor that is not a ModuleList (a single balance layer is its own parent).
A Linear producer whose output width differs from its consumers' input width (``v_proj -> o_proj`` with
grouped-query attention) is skipped, as llm-compressor does; a fused producer three times as wide
(``qkv_proj -> o_proj``) scales its last rows. The scales fold through ``RunState.fold``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from seqcal.mappings import Mapping, common_depth, matches, norm_fold_reason
from seqcal.mappings.names import checkpoint_names

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
    kind: str = "norm"  # seqcal.mappings.KINDS: how the scales fold into ``smooth``

    def mapping(self) -> Mapping:
        """The mapping ``RunState.fold`` folds (``seqcal.mappings``)."""
        return Mapping(self.smooth, tuple(self.balance), self.kind)


def _parent(model: torch.nn.Module, names: list[str]) -> str:
    """The lowest common ancestor of ``names`` that is not a ModuleList (its forward is never called)."""
    parts = names[0].split(".")
    depth = min(common_depth(names[0], n) for n in names) if len(names) > 1 else len(parts)
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
    if entry.get("activation_hook_target") is not None:  # llm-compressor 0.14 writes it, null by default
        raise ValueError(f"{where}: mappings[{i}].activation_hook_target is not supported: seqcal takes the "
                         "activations from the balance layers' own inputs; remove it")  # fmt: skip
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
    modules, aliases = dict(model.named_modules()), checkpoint_names(model)
    resolved: list[AWQMapping] = []
    skipped: list[str] = []
    for i, entry in enumerate(mappings if explicit else DEFAULT_MAPPINGS):
        smooth_pat, balance_pats = _check_entry(entry, i, where)
        smooths = [n for n, m in modules.items() if n and matches(smooth_pat, n, m, aliases.get(n))]
        if not smooths and explicit:
            raise ValueError(f"{where}: mappings[{i}].smooth_layer {smooth_pat!r} matches no module of the "
                             "model; use a 're:' pattern on module names such as 're:.*input_layernorm$'")  # fmt: skip
        for smooth in smooths:
            balance: list[str] = []
            for pat in balance_pats:
                found = [
                    n for n, m in modules.items() if n and n != smooth and matches(pat, n, m, aliases.get(n))
                ]
                if not found:
                    if explicit:
                        raise ValueError(f"{where}: mappings[{i}].balance_layers pattern {pat!r} matches no "
                                         f"module of the model (smooth layer {smooth}); fix the pattern")  # fmt: skip
                    continue
                depth = max(common_depth(smooth, n) for n in found)
                balance += [n for n in found if common_depth(smooth, n) == depth and n not in balance]
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
        if reason := norm_fold_reason(producer):
            raise ValueError(
                f"{where}: mappings[{i}] smooth layer {smooth}: {reason}; leave it out of `mappings`"
            )
    kind = "linear" if isinstance(producer, torch.nn.Linear) else "norm"
    return AWQMapping(smooth, balance, _parent(model, balance), width, kind)


def from_mapping(model: torch.nn.Module, mapping: Mapping) -> AWQMapping:
    """A mapping derived from the traced graph, with the parent and width AWQ's search needs."""
    consumers = list(mapping.consumers)
    width = model.get_submodule(consumers[0]).in_features
    return AWQMapping(mapping.producer, consumers, _parent(model, consumers), width, mapping.kind)
