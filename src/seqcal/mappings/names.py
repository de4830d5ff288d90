"""The names a module or parameter has in memory and in the checkpoint, where transformers renames it.

transformers 5 renames some modules when it loads a checkpoint (Mixtral's ``block_sparse_moe`` becomes
``mlp``); it records each rename as a ``WeightRenaming`` in the model's checkpoint conversion mapping
(``transformers.conversion_mapping``) and reverses them when it saves. A recipe written for the checkpoint
(llm-compressor's Mixtral example ignores ``re:.*block_sparse_moe.gate``) names modules as the checkpoint does,
so every pattern (targets, ignore, mappings) is matched against both names; a checkpoint read tensor by tensor
is read under the parameters' checkpoint names. Converters that fuse tensors (the per-expert weights) are left out:
they map many tensors to one, not a name to a name.

Example:
    >>> checkpoint_names(mixtral)["model.layers.0.mlp.gate"]  # doctest: +SKIP
    'model.layers.0.block_sparse_moe.gate'
"""

from __future__ import annotations

from typing import Any

import torch

_PROBE = ".weight"  # renamings are written for parameter keys: a module's name gets a leaf to rename with it


def checkpoint_names(model: torch.nn.Module, parameters: bool = False) -> dict[str, str]:
    """In-memory module (or parameter) name -> its name in the checkpoint, for the names that differ.

    Args:
        model: a transformers model (anything else has no renames: the result is empty).
        parameters: map the parameters' names (``model.named_parameters()``) instead of the modules'.

    Returns:
        Only the renamed names; a name absent from the result is the same in both.

    Example:
        >>> checkpoint_names(torch.nn.Linear(2, 2))
        {}
    """
    renamings = _reverse_renamings(model)
    if not renamings:
        return {}
    from transformers.core_model_loading import apply_renamings

    out: dict[str, str] = {}
    if parameters:
        for name, _ in model.named_parameters(remove_duplicate=False):
            key = apply_renamings(name, renamings)
            if key != name:
                out[name] = key
        return out
    for name, _ in model.named_modules():
        if not name:
            continue
        key = apply_renamings(name + _PROBE, renamings)
        if key.endswith(_PROBE) and key[: -len(_PROBE)] != name:
            out[name] = key[: -len(_PROBE)]
    return out


def _reverse_renamings(model: torch.nn.Module) -> list[Any]:
    """The model's renamings from memory back to the checkpoint, in the order transformers' save applies them."""
    if not hasattr(model, "config"):
        return []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightRenaming
    except ImportError:  # transformers < 5: modules keep their checkpoint names
        return []
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # built from a config, not loaded: the mapping transformers would use for it
        conversions = [
            c
            for c in get_model_conversion_mapping(model, add_legacy=False)
            if not isinstance(c, PrefixChange)
        ]
    reverse = [c.reverse_transform() for c in reversed(conversions) if isinstance(c, WeightRenaming)]
    return [c for c in reverse if isinstance(c, WeightRenaming)]


def names_of(name: str, aliases: dict[str, str]) -> tuple[str, ...]:
    """``name`` and, when the checkpoint calls the module otherwise, that name too.

    Example:
        >>> names_of("m.mlp.gate", {"m.mlp.gate": "m.block_sparse_moe.gate"})
        ('m.mlp.gate', 'm.block_sparse_moe.gate')
    """
    other = aliases.get(name)
    return (name,) if other is None else (name, other)
