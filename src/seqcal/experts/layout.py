"""Where a fused experts module keeps each expert's projections, and what the checkpoint calls them.

transformers 5 stores the routed experts of a mixture-of-experts layer as 3-D parameters of one module
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and runs them through the implementation that
``config._experts_implementation`` selects (eager loop, batched or grouped matmuls). Every class built with
transformers' ``use_experts_implementation`` decorator records its layout on the instance (``has_gate``,
``has_bias``, ``is_transposed``, ``is_concatenated``, ``has_post_expert_norm``): that is all this module
needs, so one mechanism covers every architecture, with no class named.

The per-expert names come from transformers' own weight conversions (the rules that fuse the original
checkpoint's ``experts.{i}.gate_proj.weight`` at load time): Mixtral's checkpoints say ``w1``/``w3``/``w2``,
Qwen's ``gate_proj``/``up_proj``/``down_proj``; a model whose checkpoint is fused already (GPT-OSS,
GraniteMoE) gets the latter, as llm-compressor writes them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# Leaf names of an expert's projections when the model's conversions do not name them.
DEFAULT_NAMES = ("gate_proj", "up_proj", "down_proj")
_PROJECTION_WORDS = ("proj", "linear", "w1", "w2", "w3", "fc")
_LAYOUT_ATTRS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


@dataclass(frozen=True)
class ExpertsLayout:
    """How one fused experts module stores its experts (transformers' ``use_experts_implementation`` flags).

    Attributes:
        num_experts: E, the first dimension of every 3-D parameter.
        has_gate: ``gate_up_proj`` holds gate and up (else ``up_proj`` alone, activation only).
        has_bias: per-expert biases ``{gate_up,up,down}_proj_bias`` [E, out].
        is_transposed: weights stored [E, in, out] instead of Linear's [E, out, in].
        is_concatenated: gate and up rows are [gate; up] (else interleaved gate0, up0, gate1, ...).
        has_post_expert_norm: the module's ``post_expert_norm`` runs on each expert's output.
        names: leaf names of (gate, up, down) in the original checkpoint.
    """

    num_experts: int
    has_gate: bool
    has_bias: bool
    is_transposed: bool
    is_concatenated: bool
    has_post_expert_norm: bool
    names: tuple[str, str, str] = DEFAULT_NAMES

    @property
    def first(self) -> str:
        """The fused parameter holding the first projection (gate and up, or up alone)."""
        return "gate_up_proj" if self.has_gate else "up_proj"

    def fused_parameters(self) -> list[str]:
        names = [self.first, "down_proj"]
        return names + [f"{n}_bias" for n in names] if self.has_bias else names

    def split_first(self, W: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One expert's first projection ([2I, H] as Linear sees it) -> (gate, up), or (up,) without gate."""
        if not self.has_gate:
            return (W,)
        if self.is_concatenated:
            return tuple(W.chunk(2, dim=0))
        return W[0::2], W[1::2]

    def join_first(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of ``split_first``: (gate, up) rows back into the fused order."""
        if len(parts) == 1:
            return parts[0]
        if self.is_concatenated:
            return torch.cat(parts, dim=0)
        return torch.stack(parts, dim=1).flatten(0, 1)

    def join_outputs(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Gate and up outputs ([T, I] each) in the fused module's order along the last dimension."""
        if self.is_concatenated:
            return torch.cat(parts, dim=-1)
        return torch.stack(parts, dim=-1).flatten(-2)

    def as_linear(self, W: torch.Tensor) -> torch.Tensor:
        """One expert's stored weight as Linear's [out, in] (a view)."""
        return W.transpose(-1, -2) if self.is_transposed and W.dim() >= 2 else W

    def expert_weights(self, fused: dict[str, torch.Tensor], e: int) -> dict[str, torch.Tensor]:
        """Expert ``e``'s projections, leaf name -> {"weight": [out, in], "bias": [out]}, as views of ``fused``."""
        gate, up, down = self.names
        leaves = [gate, up] if self.has_gate else [up]
        out: dict[str, dict[str, torch.Tensor]] = {}
        for leaf, W in zip(leaves, self.split_first(self.as_linear(fused[self.first][e]))):
            out[leaf] = {"weight": W}
        out[down] = {"weight": self.as_linear(fused["down_proj"][e])}
        if self.has_bias:
            for leaf, b in zip(leaves, self.split_first(fused[f"{self.first}_bias"][e])):
                out[leaf]["bias"] = b
            out[down]["bias"] = fused["down_proj_bias"][e]
        return out  # type: ignore[return-value]


def experts_layout(
    module: torch.nn.Module, names: tuple[str, str, str] = DEFAULT_NAMES
) -> ExpertsLayout | None:
    """The layout of a fused experts module, or None when ``module`` is not one seqcal can split.

    A module qualifies when transformers' ``use_experts_implementation`` built it (its layout flags are set)
    and its parameters are exactly the fused ones that the flags imply, all with E experts first.

    Example:
        >>> experts_layout(model.model.layers[0].mlp.experts).num_experts  # doctest: +SKIP
        8
    """
    if not all(isinstance(getattr(module, a, None), bool) for a in _LAYOUT_ATTRS):
        return None
    first = "gate_up_proj" if module.has_gate else "up_proj"
    params = dict(module.named_parameters(recurse=False))
    if first not in params or "down_proj" not in params or params[first].dim() != 3:
        return None
    layout = ExpertsLayout(
        num_experts=params[first].shape[0], has_gate=module.has_gate, has_bias=module.has_bias,
        is_transposed=module.is_transposed, is_concatenated=module.is_concatenated,
        has_post_expert_norm=bool(getattr(module, "has_post_expert_norm", False)), names=names,
    )  # fmt: skip
    if set(params) != set(layout.fused_parameters()):
        return None  # parameters the layout does not explain (scales of a pre-quantized model, ...)
    if any(p.shape[0] != layout.num_experts for p in params.values()):
        return None
    norm = getattr(module, "post_expert_norm", None)
    if layout.has_post_expert_norm and not isinstance(norm, torch.nn.Module):
        return None
    return layout


def weight_conversions(model: torch.nn.Module) -> list:
    """transformers' weight converters of ``model`` (the rules that fuse per-expert checkpoint tensors)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # older transformers: no conversions, the default names
        return []
    if not hasattr(model, "config"):
        return []
    return [
        c for c in get_model_conversion_mapping(model, add_legacy=False) if isinstance(c, WeightConverter)
    ]


def checkpoint_names(conversions: list, module_name: str, has_gate: bool) -> tuple[str, str, str]:
    """Leaf names of an expert's (gate, up, down) in the original checkpoint, from transformers' conversions.

    The converter that fuses ``{module_name}.gate_up_proj`` lists its sources in order, gate first
    (``.experts.*.w1.weight``, ``.experts.*.w3.weight`` for Mixtral); the one for ``down_proj`` names down.

    Args:
        conversions: ``weight_conversions(model)``.
        module_name: qualified name of the experts module.
        has_gate: whether it has gate and up projections (else up only).
    """
    names = list(DEFAULT_NAMES)
    first = "gate_up_proj" if has_gate else "up_proj"
    for conv in conversions:
        targets = [t.lstrip(".^") for t in conv.target_patterns]
        leaves = [m.group(1) for s in conv.source_patterns if (m := re.search(r"\*\.(\w+)\.weight", s))]
        if len(leaves) != len(conv.source_patterns):
            continue
        for target in targets:
            if f"{module_name}.{first}".endswith(target) and len(leaves) == (2 if has_gate else 1):
                names[0 if has_gate else 1 : 2] = leaves
            elif f"{module_name}.down_proj".endswith(target) and len(leaves) == 1:
                names[2] = leaves[0]
    return names[0], names[1], names[2]


def per_expert_on_disk(conversions: list, module_name: str, first: str) -> bool:
    """Whether transformers fuses ``{module_name}.{first}`` from per-expert checkpoint tensors when loading
    (then it also reads a per-expert quantized checkpoint back); False: its checkpoints store it fused."""
    return any(
        f"{module_name}.{first}".endswith(t.lstrip(".^"))
        for conv in conversions
        for t in conv.target_patterns
    )


def fused_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules holding stacked projection weights ([E, out, in]) that are not torch's own (convolutions).

    Those are fused experts (or another stacked layout seqcal's Linear-based quantization cannot reach).
    A 3-D parameter counts when it stacks more than one matrix and its module or its name says experts or
    projection; position embeddings ([1, N, D]) and the like do not.
    """
    found = []
    for name, module in model.named_modules():
        if type(module).__module__.startswith("torch.nn"):
            continue
        expert = "expert" in f"{name}.{type(module).__name__}".lower() or hasattr(module, "num_experts")
        for pname, p in module.named_parameters(recurse=False):
            stacked = p.dim() >= 3 and p.shape[0] > 1 and p.is_floating_point()
            if stacked and (expert or any(k in pname for k in _PROJECTION_WORDS)):
                found.append((name, module))
                break
    return found
