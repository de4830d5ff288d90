"""The module tree of a source checkpoint, on the meta device: what a recipe's targets and ignore patterns match.

A model-free run never loads the model, but ``targets: [Linear]`` and ``ignore: [re:.*mlp.gate$]`` are patterns
on modules and their classes. Two ways to get the modules, with no weight read:

* transformers knows the architecture: its model, built on meta as ``oneshot`` builds it (fused experts taken
  apart into per-expert Linears, ``seqcal.experts``). Targets, ignore, the fused groups, the tensors' order in
  the files and ``config.json`` are then exactly ``oneshot``'s: the checkpoint is the same bytes.
* it does not (an architecture newer than the installed transformers, or code the checkpoint ships that is not
  trusted): a tree built from the tensor names. A module whose own tensors are a 2-D ``weight`` (and a 1-D
  ``bias``) is a ``Linear``; its name decides the exceptions a model's classes would show: embeddings (``embed``,
  ``wte``, ``wpe``) and MoE routers (a ``gate`` or ``router`` beside ``experts``), which ``Linear`` does not match.

Example:
    >>> skeleton = build_skeleton(SourceCheckpoint.open("llama"))  # doctest: +SKIP
    >>> skeleton.known, type(skeleton.model.get_submodule("lm_head")).__name__  # doctest: +SKIP
    (True, 'Linear')
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from seqcal.checkpoint.config import ModelLayout
from seqcal.checkpoint.tensors import _module_tensors
from seqcal.modelfree.source import SourceCheckpoint

logger = logging.getLogger("seqcal")

# safetensors dtype names -> torch dtypes, for the stand-in parameters of a tree built from names
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_EMBEDDING = re.compile(r"(embed|^wte$|^wpe$)")  # leaf names of embedding tables
_ROUTER = ("gate", "router")  # leaf names of MoE routers, beside an `experts` module


class Router(nn.Module):
    """An MoE router in a tree built from names: not a Linear (transformers' routers are their own classes), but
    vLLM builds it as one, so ``config.json`` lists it among the ignored modules, as ``oneshot`` does."""


@dataclass
class Skeleton:
    """A model's modules on meta and how their tensors are named in the checkpoint.

    Attributes:
        model: the module tree (parameters on meta).
        layout: tied keys and key conversions, as ``oneshot``'s checkpoint writer uses them.
        known: the tree is transformers' model (True) or was built from the tensor names (False).
    """

    model: nn.Module
    layout: ModelLayout
    known: bool

    def module_keys(self) -> list[tuple[str, list[str]]]:
        """(module name, its own tensors' checkpoint keys, sorted) for every module in the model's order: the
        order ``oneshot``'s writer adds them to its files (``CheckpointWriter.module_tensors``)."""
        own = []
        for name, module in self.model.named_modules():
            tensors = _module_tensors(name, module, None)
            own.append((name, {k: v for k, v in tensors.items() if k not in self.layout.skip}))
        renamed = self._renamed([k for _, tensors in own for k in tensors])
        out = []
        for name, tensors in own:
            if all(k in renamed for k in tensors):
                keys = [renamed[k] for k in tensors]
            else:  # a conversion joins this module's tensors: reverted as the writer does, module by module
                keys = list(self.layout.revert(tensors)) if self.layout.revert else list(tensors)  # type: ignore[arg-type]
            out.append((name, sorted(keys)))
        return out

    def dtypes(self) -> dict[str, torch.dtype]:
        """Checkpoint key -> the dtype transformers' model holds the tensor in, which ``oneshot`` writes (float32
        for a router a model keeps in float32, the model's dtype for a norm stored in float32), for the keys
        renamed one to one; empty for a tree built from names, whose tensors are written as stored."""
        if not self.known:
            return {}
        tensors: dict[str, torch.Tensor] = {}
        for name, module in self.model.named_modules():
            tensors.update(_module_tensors(name, module, None))
        renamed = self._renamed([k for k in tensors if k not in self.layout.skip])
        return {renamed[k]: tensors[k].dtype for k in renamed}

    def weight_key(self, name: str) -> str:
        """The checkpoint key of module ``name``'s weight."""
        key = f"{name}.weight"
        return self._renamed([key]).get(key, key)

    def _renamed(self, keys: list[str]) -> dict[str, str]:
        """In-memory key -> checkpoint key, for the keys that are renamed one to one, in one call of the
        reversion (each call costs as much as one over every key): each key gets a tensor object of its own, and
        the object a reverted key holds says where it came from."""
        if self.layout.revert is None:
            return {k: k for k in keys}
        tagged = {k: torch.empty(0, device="meta") for k in keys}
        origin = {id(t): k for k, t in tagged.items()}
        return {origin[id(t)]: new for new, t in self.layout.revert(tagged).items() if id(t) in origin}


def build_skeleton(source: SourceCheckpoint, trust_remote_code: bool = False) -> Skeleton:
    """transformers' model on meta when it knows the architecture, else the tree the tensor names describe.

    Args:
        source: the checkpoint.
        trust_remote_code: let transformers build a class the checkpoint's own code defines.

    Returns:
        The skeleton.
    """
    model = _transformers_model(source, trust_remote_code)
    if model is None:
        return Skeleton(names_tree(source), ModelLayout(), known=False)
    layout = ModelLayout.from_model(model)
    if layout.revert is not None and not _cache_conversions(model):
        layout = replace(layout, revert=None)  # nothing to revert: every key is written as it is
    return Skeleton(model, layout, known=True)


def _cache_conversions(model: nn.Module) -> bool:
    """Compute the model's weight conversions once; whether there are any.

    ``revert_weight_conversion`` recomputes them (a walk over every module) at each call when the model has none
    attached, as a model built from its config has not: a call per module is quadratic, hours for DeepSeek-V3's
    60,000 modules. Attached, they are the ones it would compute (those of a model not loaded by
    ``from_pretrained``: no prefix changes).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    conversions = [
        c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)
    ]
    model._weight_conversions = conversions or None
    return bool(conversions)


def _transformers_model(source: SourceCheckpoint, trust_remote_code: bool) -> nn.Module | None:
    """transformers' model of the checkpoint on meta (experts as per-expert Linears), or None (logged why)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from seqcal.experts import linearize_experts
    from seqcal.multimodal.classes import build

    try:
        config = AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)
        dtype = getattr(config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        with init_empty_weights(include_buffers=False):
            model = build(config, dtype, trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any failure means: no class for it here, read the names instead
        logger.info("seqcal: model-free: transformers cannot build %s (%s); modules taken from the tensor names",
                    source.path, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)  # fmt: skip
        return None
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    linearize_experts(model)
    return model.eval()


def names_tree(source: SourceCheckpoint) -> nn.Module:
    """The module tree the tensor names describe, parameters on meta, modules in natural order of their names.

    Example:
        >>> type(names_tree(source).get_submodule("model.layers.0.mlp.down_proj")).__name__  # doctest: +SKIP
        'Linear'
    """
    own: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for key in sorted(source.info, key=natural_key):
        module, _, param = key.rpartition(".")
        own.setdefault(module, {})[param] = (source.info[key].dtype, source.info[key].shape)
    root = nn.Module()
    for name in sorted(own, key=natural_key):
        _place(root, name, _leaf(name, own[name], own))
    return root


def natural_key(name: str) -> list[str | int]:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _leaf(name: str, params: dict[str, tuple[str, tuple[int, ...]]], own: dict[str, dict]) -> nn.Module:
    """The module holding ``params``: a Linear, an Embedding, a Router or a plain module."""
    leaf = name.rpartition(".")[2]
    weight = params.get("weight")
    bias = params.get("bias")
    plain = set(params) <= {"weight", "bias"} and weight is not None and len(weight[1]) == 2
    plain = plain and (bias is None or bias[1] == weight[1][:1])  # type: ignore[index]
    dtype = TORCH_DTYPES.get(weight[0], torch.float32) if weight else torch.float32
    if plain and _EMBEDDING.search(leaf):
        module: nn.Module = nn.Embedding(*weight[1], device="meta", dtype=dtype)  # type: ignore[index]
    elif plain and leaf in _ROUTER and any(k.startswith(name.rpartition(".")[0] + ".experts.") for k in own):
        module = Router()
    elif plain:
        out_features, in_features = weight[1]  # type: ignore[index]
        return nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=dtype)
    else:
        module = nn.Module()
    for param, (kind, shape) in params.items():
        if param not in module._parameters:
            module.register_parameter(
                param,
                nn.Parameter(
                    torch.empty(shape, dtype=TORCH_DTYPES.get(kind, torch.uint8), device="meta"),
                    requires_grad=False,
                ),  # fmt: skip
            )
    return module


def _place(root: nn.Module, name: str, leaf: nn.Module) -> None:
    """Put ``leaf`` at ``name`` under ``root``, creating plain parents, keeping tensors already placed."""
    parent = root
    parts = name.split(".") if name else []
    for part in parts[:-1]:
        if part not in parent._modules:
            parent.add_module(part, nn.Module())
        parent = parent._modules[part]  # type: ignore[assignment]
    if not parts:  # tensors of the root itself
        for param, value in leaf._parameters.items():
            root.register_parameter(param, value)
        return
    existing = parent._modules.get(parts[-1])
    if existing is not None:  # a parent created earlier for a deeper name: move its children under the leaf
        for child, module in existing._modules.items():
            leaf.add_module(child, module)
    parent.add_module(parts[-1], leaf)
