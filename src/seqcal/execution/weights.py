"""Weights stay where they are: a model skeleton on meta, values read from safetensors per subgraph.

``load_offloaded`` builds the model with parameters on the meta device (buffers computed at init, such as
rotary tables, stay real) and a ``WeightStore`` that knows where each parameter lives in the checkpoint's
safetensors files (memory-mapped reads: only what is asked for is paged in). The executor onloads one
subgraph's parameters to the execution device, runs it, and releases them again. Weights a modifier changed
are kept in the store's overrides until they are written to the output checkpoint.

Fused MoE experts become per-expert Linears on meta first (``seqcal.experts``): the store then reads each
expert's tensors under its checkpoint name, or one expert's slice of a tensor the checkpoint stores fused.

A per-module safety hook onloads, for the duration of one call, any parameter still on meta when a module
runs (e.g. from code run opaquely that the partitioner could not attribute to a subgraph), so a missed
attribution costs time, never correctness; a module whose forward reads its children's parameters without
calling them (``nn.MultiheadAttention`` and its ``out_proj``, listed in ``READS_CHILDREN``) is onloaded whole.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open

from seqcal.backend.host import trim_host_memory
from seqcal.errors import ModelLoadError


@dataclass
class WeightStore:
    """Parameter name -> where its value is: an override in RAM, else (file, key) in safetensors."""

    files: dict[str, str]  # parameter name -> safetensors file
    aliases: dict[str, str] = field(default_factory=dict)  # tied parameter -> the name stored on disk
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)
    dtype: torch.dtype | None = None
    # parameter -> (stored key, reader of its part): one expert of a tensor the checkpoint stores fused
    views: dict[str, tuple[str, Callable[[Any], torch.Tensor]]] = field(default_factory=dict)

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: torch.dtype | None = None) -> WeightStore:
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: str(path / file) for name, file in weight_map.items()}
        elif (path / "model.safetensors").is_file():
            with safe_open(str(path / "model.safetensors"), framework="pt") as f:
                files = dict.fromkeys(f.keys(), str(path / "model.safetensors"))
        else:
            raise FileNotFoundError(
                f"{path} has no model.safetensors(.index.json); seqcal reads weights with safetensors only "
                "(convert .bin checkpoints with transformers' save_pretrained first)"
            )
        return cls(files=files, dtype=dtype)

    def has(self, name: str) -> bool:
        return name in self.overrides or name in self.views or self.aliases.get(name, name) in self.files

    def read(self, name: str) -> torch.Tensor:
        """The current value of parameter ``name`` on cpu (an override, else read from its file)."""
        stored = self.aliases.get(name, name)
        for key in (name, stored):
            if key in self.overrides:
                return self.overrides[key]
        if name in self.views:
            stored, part = self.views[name]
            with safe_open(self.files[stored], framework="pt") as f:
                tensor = part(f.get_slice(stored))
        elif stored not in self.files:
            raise KeyError(f"parameter {name!r} is not in the checkpoint (looked for {stored!r})")
        else:
            with safe_open(self.files[stored], framework="pt") as f:
                tensor = f.get_tensor(stored)
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
            f"{path}: {type(model).__name__} builds {merged[0]} from several checkpoint tensors ({merged[1]}) "
            "that transformers merges as it loads, which seqcal's offloaded loader does not do yet; pass the model "
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
    (Kimi-Linear's ``conv1d`` from ``q/k/v_conv1d``): (its name, the converter's sources), else None."""
    import re

    from seqcal.experts.layout import weight_conversions

    for conv in weight_conversions(model) if missing else ():
        sources = list(conv.source_patterns)
        if len(sources) < 2:
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
            made[stored] = torch.nn.Parameter(value.to("cpu"), requires_grad=param.requires_grad)
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = made[stored]
    store.overrides.clear()


def params_under(model: torch.nn.Module, modules: Iterable[str]) -> list[str]:
    """Names of the parameters held by ``modules`` (qualified module names) and their children; a parameter's
    own name in ``modules`` stands for itself (``tracing.partition``: a container's direct parameter)."""
    modules = set(modules)
    prefixes = tuple(m + "." for m in modules if m)
    names = [n for n, _ in model.named_parameters()]
    return [n for n in names if n.startswith(prefixes) or n in modules] if "" not in modules else names


def onload(model: torch.nn.Module, store: WeightStore, names: Iterable[str], device: torch.device) -> None:
    """Materialise parameters ``names`` on ``device`` from the store."""
    for name in names:
        set_module_tensor_to_device(model, name, device, value=store.read(name))


def offload(model: torch.nn.Module, names: Iterable[str]) -> None:
    """Release parameters ``names`` back to meta (their values stay in the store or its overrides)."""
    for name in names:
        set_module_tensor_to_device(model, name, "meta")


# Modules whose forward reads parameters of their children without calling them (class name -> what it
# reads): the safety hooks onload all their parameters as one unit when they run.
READS_CHILDREN: dict[str, str] = {
    "MultiheadAttention": "out_proj.weight and out_proj.bias, passed to F.multi_head_attention_forward",
}


def _hooked_params(module: torch.nn.Module) -> list[str]:
    """The parameters a module's forward reads (relative names): its own, or all for ``READS_CHILDREN``."""
    whole = any(cls.__name__ in READS_CHILDREN for cls in type(module).__mro__)
    return [n for n, _ in module.named_parameters(recurse=whole)]


def _tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    """``module``'s tensor at the relative ``name``: a Parameter, or the plain tensor a caller put in its place
    for one call (``torch.func.functional_call``, as the span services' re-runs do)."""
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, leaf)


@contextlib.contextmanager
def safety_hooks(model: torch.nn.Module, store: WeightStore, device: torch.device) -> Iterator[None]:
    """Onload, for one call, the parameters a module reads (its direct ones, all of a ``READS_CHILDREN``
    module's) whenever it runs while they are on meta."""
    handles = []
    owned: dict[int, tuple[str, list[str]]] = {}  # module id -> (its name, the relative names it reads)
    onloaded: dict[int, list[str]] = {}  # module id -> parameters this hook onloaded for the running call

    def pre(module: torch.nn.Module, args: Any) -> None:
        prefix, names = owned[id(module)]
        local = [n for n in names if _tensor(module, n).device.type == "meta"]
        onloaded[id(module)] = local
        for name in local:
            full = f"{prefix}.{name}" if prefix else name
            set_module_tensor_to_device(module, name, device, value=store.read(full))

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        for name in onloaded.pop(id(module), []):
            set_module_tensor_to_device(module, name, "meta")

    try:
        for prefix, module in model.named_modules():
            names = _hooked_params(module)
            if names:
                owned[id(module)] = (prefix, names)
                handles.append(module.register_forward_pre_hook(pre))
                handles.append(module.register_forward_hook(post))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def targets_onloaded(
    model: torch.nn.Module, store: WeightStore, targets: Iterable[str], device: torch.device
) -> Iterator[None]:
    """Onload, for one call, every parameter of each target module (a decoder layer) while it runs.

    ``safety_hooks`` onloads a module's own parameters when it runs; a forward that reads a child's
    parameter without calling the child (Mamba's mixer passes ``dt_proj.bias`` to its scan) would see it on
    meta. Onloading the whole target around its call covers those, one layer at a time as calibration does.

    Example:
        >>> with targets_onloaded(model, store, ["model.layers.0"], torch.device("cpu")):  # doctest: +SKIP
        ...     model(**batch)
    """
    onloaded: dict[int, list[str]] = {}

    def pre(prefix: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            names = [f"{prefix}.{n}" for n, p in module.named_parameters() if p.device.type == "meta"]
            onloaded[id(module)] = names
            onload(model, store, names, device)

        return hook

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        offload(model, onloaded.pop(id(module), []))

    handles = []
    try:
        for name in targets:
            module = model.get_submodule(name)
            handles += [module.register_forward_pre_hook(pre(name)), module.register_forward_hook(post)]
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def buffers_on(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Move the model's materialised buffers (rotary tables, position ids) to ``device`` for the run.

    An offloaded model keeps its buffers real on cpu (``load_offloaded``); they are small and every subgraph
    may read them, so they go to the execution device once and come back to cpu at the end.
    """
    moved = [(m, n, b.device) for m in model.modules() for n, b in m._buffers.items()
             if b is not None and b.device.type != "meta" and b.device != device]  # fmt: skip
    for module, name, _ in moved:
        module._buffers[name] = module._buffers[name].to(device)
    try:
        yield
    finally:
        for module, name, home in moved:
            module._buffers[name] = module._buffers[name].to(home)


class SubgraphWeights:
    """Onloads each subgraph's parameters before it runs and releases them after it is saved.

    A parameter is released to meta after the last subgraph that uses it; one that a modifier changed and
    that a later subgraph still reads (a tied weight, say) is kept in the store's overrides meanwhile.

    Args:
        model: the model with parameters on meta (``load_offloaded``, ``stage_in_memory``).
        store: where the parameters' values are.
        subgraphs: the run's subgraphs.
        device: the execution device.
        keep_changed: keep every changed parameter in the store's overrides (a staged in-memory model,
            whose quantized weights go back into it), not only those a later subgraph reads.
        read: the modules of a subgraph that ``onload`` brings (None: all of ``Subgraph.modules``); the others
            are onloaded only for a moment, on the cpu, when the checkpoint writes them (``modules_onloaded``).
    """

    def __init__(self, model: torch.nn.Module, store: WeightStore, subgraphs: Iterable[Any],
                 device: torch.device, keep_changed: bool = False,
                 read: Callable[[Any], Iterable[str]] | None = None) -> None:  # fmt: skip
        self.model, self.store, self.device = model, store, device
        self.keep_changed = keep_changed  # a staged in-memory model gets every changed weight back
        subgraphs = list(subgraphs)
        self.params = {sg.index: params_under(model, sg.modules) for sg in subgraphs}
        # what onload() brings: the modules the run reads (``read``, cuts.onloaded_modules), else all of them
        self.reads = {sg.index: params_under(model, read(sg)) for sg in subgraphs} if read else self.params
        self.last_use: dict[str, int] = {}
        for index, names in self.params.items():
            for name in names:
                self.last_use[name] = max(index, self.last_use.get(name, -1))

    def _on_meta(self, names: Iterable[str]) -> list[str]:
        return [n for n in names if self.model.get_parameter(n).device.type == "meta"]

    def onload(self, sg: Any) -> int:
        """Onload ``sg``'s parameters that are not on the device yet; returns the bytes moved."""
        names = self._on_meta(self.reads[sg.index])
        onload(self.model, self.store, names, self.device)
        return sum(self.model.get_parameter(n).nbytes for n in names)

    def release(self, sg: Any, changed: Iterable[str] = ()) -> int:
        """Release ``sg``'s parameters; ``changed`` (module names) were modified and are kept if still used.

        Returns:
            The bytes copied back to the host (changed weights kept for later).
        """
        changed = tuple(c + "." for c in changed)
        present = dict(self.model.named_parameters())  # a modifier may have removed some (REAP's experts)
        names = [n for n in self.params[sg.index] if n in present and present[n].device.type != "meta"]
        kept = 0
        for name in names:
            if (self.keep_changed or self.last_use[name] > sg.index) and name.startswith(changed):
                self.store.overrides[name] = self.model.get_parameter(name).detach().to("cpu", copy=True)
                kept += self.store.overrides[name].nbytes
        offload(self.model, names)
        trim_host_memory()  # the subgraph's transients are freed now; see trim_host_memory for why
        return kept

    @contextlib.contextmanager
    def modules_onloaded(self, modules: Iterable[str]) -> Iterator[None]:
        """Onload the parameters of ``modules`` on cpu for a moment (e.g. to write them to the checkpoint)."""
        names = self._on_meta(params_under(self.model, modules))
        onload(self.model, self.store, names, torch.device("cpu"))
        try:
            yield
        finally:
            offload(self.model, names)
