"""Where each expert's tensors are in a checkpoint, for a model whose weights stay on disk.

transformers fuses the per-expert tensors of a checkpoint (``experts.{i}.gate_proj.weight``) into 3-D
parameters at load time through its weight conversions; its ``revert_weight_conversion`` (what
``save_pretrained`` applies) gives the names back. After ``linearize_experts`` the model's expert parameters
are per expert again, so reverting their names (renamings only, e.g. Mixtral's ``mlp`` back to
``block_sparse_moe``) finds them in a per-expert checkpoint. A checkpoint that stores the experts fused
(GPT-OSS, GraniteMoE's ``input_linear``) is read one expert's slice at a time (``WeightStore.views``), so no
layer is ever read whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from seqcal.experts.layout import ExpertsLayout
from seqcal.experts.modules import LinearExperts

SliceReader = Callable[[object], torch.Tensor]  # safetensors slice of the fused tensor -> one expert's part


def checkpoint_keys(model: nn.Module, names: list[str]) -> dict[str, str]:
    """In-memory parameter name -> the name transformers' save would give it (renamings reverted)."""
    if not (hasattr(model, "config") and hasattr(model, "all_tied_weights_keys")):
        return {n: n for n in names}
    from transformers.core_model_loading import revert_weight_conversion

    tensors = {n: torch.empty(0, device="meta") for n in names}  # distinct objects: identity maps back
    by_id = {id(t): n for n, t in tensors.items()}
    reverted = revert_weight_conversion(model, dict(tensors))
    out = {by_id[id(t)]: key for key, t in reverted.items() if id(t) in by_id}
    return {n: out.get(n, n) for n in names}


def map_experts(
    model: nn.Module, has: Callable[[str], bool]
) -> tuple[dict[str, str], dict[str, tuple[str, SliceReader]]]:
    """Aliases and slice readers that make every parameter of ``model`` readable from the checkpoint.

    Args:
        model: the model with linearized experts (parameters on meta).
        has: whether the checkpoint holds a key.

    Returns:
        (aliases: parameter -> checkpoint key, for renamed ones; views: parameter -> (fused checkpoint key,
        reader of one expert's part)). Parameters found under neither are left to the caller's check.
    """
    names = [n for n, _ in model.named_parameters()]
    keys = checkpoint_keys(model, names)
    aliases = {n: k for n, k in keys.items() if k != n and not has(n) and has(k)}
    views: dict[str, tuple[str, SliceReader]] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, LinearExperts):
            continue
        own = [n for n in names if n.startswith(prefix + ".")]
        if all(has(n) or n in aliases for n in own):
            continue  # a per-expert checkpoint
        for name, (source, reader) in _fused_sources(model, prefix, module).items():
            if not has(name) and name not in aliases:
                found = next((s for s in source if has(s)), None)
                if found is not None:
                    views[name] = (found, reader)
    return aliases, views


def _fused_sources(
    model: nn.Module, prefix: str, module: LinearExperts
) -> dict[str, tuple[list[str], SliceReader]]:
    """Each expert parameter -> (candidate checkpoint keys of its fused tensor, reader of its slice)."""
    layout = module.layout
    gate, up, down = layout.names
    leaves = [gate, up] if layout.has_gate else [up]
    out = {}
    keys = {n: _fused_keys(model, f"{prefix}.{n}") for n in layout.fused_parameters()}
    for e in range(layout.num_experts):
        for kind in ("weight", "bias") if layout.has_bias else ("weight",):
            suffix = "" if kind == "weight" else "_bias"
            for part, leaf in enumerate(leaves):
                out[f"{prefix}.{e}.{leaf}.{kind}"] = (
                    keys[layout.first + suffix],
                    _reader(layout, e, part, kind),
                )
            out[f"{prefix}.{e}.{down}.{kind}"] = (keys["down_proj" + suffix], _reader(layout, e, None, kind))
    return out


def _fused_keys(model: nn.Module, fused_name: str) -> list[str]:
    """The fused parameter's own name and its single renamed checkpoint key (GraniteMoE: ``input_linear``)."""
    try:
        renamed = checkpoint_keys(model, [fused_name])[fused_name]
    except (
        RuntimeError
    ):  # a converter that splits it per expert (it cannot on an empty tensor): not fused on disk
        return [fused_name]
    return list(dict.fromkeys([fused_name, renamed]))


def _reader(layout: ExpertsLayout, e: int, part: int | None, kind: str) -> SliceReader:
    def read(fused_slice: object) -> torch.Tensor:
        t = fused_slice[e]  # type: ignore[index]  # only expert e's bytes are read
        if kind == "weight":
            t = layout.as_linear(t)
        if part is not None:
            t = layout.split_first(t)[part]
        return t.contiguous()

    return read
