"""Where a run's weights come from: a model skeleton on meta and a ``WeightStore`` over its safetensors files.

``load_offloaded`` builds the model with parameters on the meta device (buffers computed at init, such as
rotary tables, stay real) and a ``WeightStore`` that knows where each parameter lives in the checkpoint's
safetensors files (each tensor read into memory of its own when asked for: ``read_tensor``). A model given in
RAM is staged into a store the same way (``stage_in_memory``) and put back at the end (``restore_in_memory``).
Weights a modifier changed are kept in the store's overrides until they are written to the output checkpoint.

Fused MoE experts become per-expert Linears on meta first (``seqcal.experts``): the store then reads each
expert's tensors under its checkpoint name, or one expert's slice of a tensor the checkpoint stores fused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open

from seqcal.errors import ModelLoadError
from seqcal.sources.checkpoint import QuantizedCheckpoint, checkpoint_files, quantized_source
from seqcal.sources.files import owned_copy, read_stored_rows, read_tensor, stored_span


@dataclass
class WeightStore:
    """Parameter name -> where its value is: an override in RAM, else (file, key) in safetensors."""

    files: dict[str, str]  # parameter name -> safetensors file
    aliases: dict[str, str] = field(default_factory=dict)  # tied parameter -> the name stored on disk
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)
    dtype: torch.dtype | None = None
    # parameter -> (stored key, reader of its part): one expert of a tensor the checkpoint stores fused
    views: dict[str, tuple[str, Callable[[Any], torch.Tensor]]] = field(default_factory=dict)
    # a quantized checkpoint (FP8, MXFP4, compressed-tensors, ...): its weights are dequantized as they are read
    source: QuantizedCheckpoint | None = None

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: torch.dtype | None = None) -> WeightStore:
        path = Path(path)
        source = quantized_source(path, read=read_tensor)
        if source is not None:  # stored names -> the full-precision names, each read dequantized
            files = {name: source.file_of(name) for name in source.names()}
            return cls(files=files, dtype=dtype, source=source)
        files = checkpoint_files(path)  # every shard the index names checked first
        return cls(files=files, dtype=dtype)

    def has(self, name: str) -> bool:
        return name in self.overrides or name in self.views or self.aliases.get(name, name) in self.files

    def read(self, name: str) -> torch.Tensor:
        """The current value of parameter ``name`` on cpu (an override, else read from its file)."""
        stored = self.aliases.get(name, name)
        for key in (name, stored):
            if key in self.overrides:
                return self.overrides[key]
        dtype = self.dtype or torch.float32
        if name in self.views:
            stored, part = self.views[name]
            if self.source is not None and self.source.is_quantized(stored):  # one expert dequantized
                return owned_copy(part(self.source.experts(stored, dtype)))
            with safe_open(self.files[stored], framework="pt") as f:
                tensor = owned_copy(part(f.get_slice(stored)))  # memory of its own (read_tensor)
        elif stored not in self.files:
            raise KeyError(f"parameter {name!r} is not in the checkpoint (looked for {stored!r})")
        elif self.source is not None and self.source.is_quantized(stored):
            return owned_copy(self.source.read(stored, dtype))
        else:
            tensor = read_tensor(self.files[stored], stored)
        return tensor.to(self.dtype) if self.dtype is not None and tensor.is_floating_point() else tensor

    def stored_in_file(self, name: str) -> tuple[str, str] | None:
        """(file, key) of parameter ``name`` when it is read as stored there, one tensor of a known dtype: not an
        override, an expert's slice nor a quantized source's weight; else None."""
        stored = self.aliases.get(name, name)
        if {name, stored} & self.overrides.keys() or name in self.views or stored not in self.files:
            return None
        if self.source is not None and self.source.is_quantized(stored):
            return None
        file = self.files[stored]
        return (file, stored) if stored_span(file, stored) is not None else None

    def read_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (ascending, distinct) of parameter ``name`` on cpu, as ``read(name)[rows]`` gives them:
        from the file without the other rows where it is stored as it is read, else from the whole value."""
        where = self.stored_in_file(name)
        tensor = read_stored_rows(*where, rows) if where is not None else None
        if tensor is None:
            return self.read(name).index_select(0, rows)
        return tensor.to(self.dtype) if self.dtype is not None and tensor.is_floating_point() else tensor


def load_offloaded(path: str | Path, dtype: torch.dtype | None = None, trust_remote_code: bool = False) -> tuple[
    torch.nn.Module, WeightStore
]:  # fmt: skip
    """A model whose parameters are on meta, plus the store that holds their values.

    Args:
        path: a transformers checkpoint directory with safetensors weights.
        dtype: compute dtype (None: the config's torch_dtype, else float32).
        trust_remote_code: passed to transformers.

    Returns:
        (model in eval mode with meta parameters, WeightStore).
    """
    from transformers import AutoConfig

    from seqcal.mappings.names import checkpoint_names
    from seqcal.multimodal.classes import build

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):  # a quantized source: the store dequantizes (seqcal.sources)
        del config.quantization_config
    # `dtype` since transformers 4.56; reading `torch_dtype` there logs a deprecation warning on every run
    dtype = dtype or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with init_empty_weights(include_buffers=False):
        model = build(config, dtype, trust_remote_code)  # the class the checkpoint was saved from
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # tied parameters become one object, found below under the name on disk
    store = WeightStore.from_checkpoint(path, dtype=dtype)
    _map_experts(model, store)
    renamed = checkpoint_names(model, parameters=True)  # modules transformers renames as it loads
    store.aliases.update({n: key for n, key in renamed.items() if not store.has(n) and store.has(key)})
    params = dict(model.named_parameters(remove_duplicate=False))
    # tied parameters share one object; a name absent from the files reads it under the stored name
    store.aliases.update({n: first for n, first in _tied_names(model).items() if not store.has(n)})
    store.aliases = {
        n: store.aliases.get(key, key) for n, key in store.aliases.items()
    }  # tied to a renamed one
    missing = [n for n in params if not store.has(n)]
    merged = _merged_on_load(model, missing)
    if merged:
        raise ModelLoadError(
            f"{path}: {type(model).__name__} builds {merged[0]} from checkpoint tensors ({merged[1]}) that "
            "transformers merges or splits as it loads, which seqcal's offloaded loader does not do yet; pass the model "
            "loaded in memory to oneshot (model=AutoModelForCausalLM.from_pretrained(path)), which holds all its "
            "weights in RAM"
        )
    if missing:
        raise KeyError(
            f"{path}: checkpoint lacks parameters {missing[:5]}; is it the model's own checkpoint?"
        )
    return model.eval(), store


def _merged_on_load(model: torch.nn.Module, missing: list[str]) -> tuple[str, str] | None:
    """A missing parameter that one of transformers' weight converters builds from several checkpoint tensors
    (Kimi-Linear's ``conv1d`` from ``q/k/v_conv1d``) or from a part of one (HRM's ``q_proj`` from ``gqkv_proj``):
    (its name, the converter's sources), else None."""
    import re

    from seqcal.experts.layout import weight_conversions

    for conv in weight_conversions(model) if missing else ():
        sources = list(conv.source_patterns)
        if len(sources) < 2 and len(conv.target_patterns) < 2:  # a renaming: not a merge or a split
            continue
        for target in conv.target_patterns:
            hit = next((n for n in missing if re.search(target, n)), None)
            if hit is not None:
                return hit, ", ".join(sources)
    return None


def _map_experts(model: torch.nn.Module, store: WeightStore) -> None:
    """Fused experts become per-expert Linears on meta, read per expert (seqcal.experts.store)."""
    from seqcal.experts import linearize_experts
    from seqcal.experts.store import map_experts

    if linearize_experts(model).replaced:
        aliases, views = map_experts(model, lambda key: key in store.files)
        store.aliases.update(aliases)
        store.views.update(views)


def stage_in_memory(model: torch.nn.Module) -> WeightStore:
    """Take a model held in RAM apart like ``load_offloaded``: its values into a store, meta in their place.

    The store holds the parameters' own tensors (no copy), so the pipeline can onload each subgraph to the
    execution device (a GPU) and release it, as for a model read from disk; ``restore_in_memory`` puts
    them, quantized ones included, back. Tied parameters are stored once (``aliases``).

    Example:
        >>> store = stage_in_memory(model)  # doctest: +SKIP
        >>> restore_in_memory(model, store)  # doctest: +SKIP
    """
    tied = _tied_names(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    store = WeightStore(files={}, aliases=tied)
    store.overrides.update({n: p.detach() for n, p in params.items() if n not in tied})
    offload(model, params)
    return store


def _tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Name of each parameter that is another one's object (a tied weight) -> that parameter's first name."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        first.setdefault(id(param), name)
    return tied


def restore_in_memory(model: torch.nn.Module, store: WeightStore) -> None:
    """Put the store's values back into ``model``'s parameters on cpu; tied ones become one object again."""
    made: dict[str, torch.nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        stored = store.aliases.get(name, name)
        if stored not in made:
            value = param.detach() if param.device.type != "meta" else store.read(stored)
            if param.device.type == "meta" and value.is_floating_point():  # as onload: the model's dtype
                value = value.to(param.dtype)  # (transformers keeps some in float32: DeepSeek's router)
            made[stored] = torch.nn.Parameter(value.to("cpu"), requires_grad=param.requires_grad)
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = made[stored]
    store.overrides.clear()


def offload(model: torch.nn.Module, names: Iterable[str]) -> None:
    """Release parameters ``names`` back to meta (their values stay in the store or its overrides)."""
    for name in names:
        set_module_tensor_to_device(model, name, "meta")
