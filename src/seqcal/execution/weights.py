"""Weights stay where they are: the executor onloads one subgraph's parameters from the ``WeightStore``
(``seqcal.execution.store``) to the execution device, runs it, and releases them again.

A per-module safety hook onloads, for the duration of one call, any parameter still on meta when a module
runs (e.g. from code run opaquely that the partitioner could not attribute to a subgraph), so a missed
attribution costs time, never correctness; a module whose forward reads its children's parameters without
calling them (``nn.MultiheadAttention`` and its ``out_proj``, listed in ``READS_CHILDREN``) is onloaded whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from accelerate.utils import set_module_tensor_to_device

from seqcal.backend.host import trim_host_memory
from seqcal.execution.embedding_rows import lookup, reads_rows
from seqcal.execution.head_rows import chunked_heads
from seqcal.execution.store import WeightStore, offload


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


# Modules whose forward reads parameters of their children without calling them (class name -> what it
# reads): the safety hooks onload all their parameters as one unit when they run.
READS_CHILDREN: dict[str, str] = {
    "MultiheadAttention": "out_proj.weight and out_proj.bias, passed to F.multi_head_attention_forward",
    "MllamaVisionModel": "patch_embedding.weight's device, read before patch_embedding runs",
    "Qwen2AudioEncoder": "conv1.weight's device and embed_positions.weight, read without calling them",
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


# Bytes of weights the safety hooks release on the host between two trims of the heap. Measured on Qwen2.5-VL's
# vision tower run module by module (Linears of 3-10 MB, 32 blocks): without a trim RSS grew ~17 MB a block.
TRIM_EVERY = 64 * 1024**2


@contextlib.contextmanager
def safety_hooks(model: torch.nn.Module, store: WeightStore, device: torch.device) -> Iterator[None]:
    """Onload, for one call, the parameters a module reads (its direct ones, all of a ``READS_CHILDREN``
    module's) whenever it runs while they are on meta; an embedding read by rows gets only the rows its input names
    (``embedding_rows.lookup``), and a large Linear reads its weight a chunk of rows at a time (``head_rows``)."""
    handles = []
    owned: dict[int, tuple[str, list[str]]] = {}  # module id -> (its name, the relative names it reads)
    onloaded: dict[int, list[str]] = {}  # module id -> parameters this hook onloaded for the running call
    restores: dict[int, Callable[[], None]] = {}  # module id -> what puts an embedding read by rows back
    stack = contextlib.ExitStack()
    freed = [0]  # host bytes released since the heap was last trimmed

    def pre(module: torch.nn.Module, args: Any) -> tuple | None:
        prefix, names = owned[id(module)]
        local = [n for n in names if _tensor(module, n).device.type == "meta"]
        if local == ["weight"] and reads_rows(module):  # an embedding: the rows its input names
            looked_up = lookup(module, prefix, store, device, args)
            if looked_up is not None:
                onloaded[id(module)], restores[id(module)] = [], looked_up[1]
                return looked_up[0]
        onloaded[id(module)] = local
        for name in local:
            full = f"{prefix}.{name}" if prefix else name
            set_module_tensor_to_device(module, name, device, value=store.read(full))
        return None

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        if (restore := restores.pop(id(module), None)) is not None:
            restore()
        for name in onloaded.pop(id(module), []):
            tensor = _tensor(module, name)
            freed[0] += tensor.nbytes if tensor.device.type == "cpu" else 0
            set_module_tensor_to_device(module, name, "meta")
        # weights under the mmap threshold leave holes in the heap when freed: see trim_host_memory
        if freed[0] > TRIM_EVERY:
            trim_host_memory()
            freed[0] = 0

    try:
        heads = set(
            stack.enter_context(chunked_heads(model, store, device))
        )  # read by chunks of rows instead
        for prefix, module in model.named_modules():
            names = _hooked_params(module) if prefix not in heads else []
            if names:
                owned[id(module)] = (prefix, names)
                handles.append(module.register_forward_pre_hook(pre))
                handles.append(module.register_forward_hook(post))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for restore in restores.values():  # a call that raised: its table goes, the weight is meta again
            restore()
        stack.close()


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
def reports_device(model: torch.nn.Module, device: torch.device | None) -> Iterator[None]:
    """Every transformers model in ``model`` (itself, its vision tower, ...) says ``device`` is its ``.device``
    while the block runs; nothing changes for ``device`` None.

    Why: transformers' ``PreTrainedModel.device`` is its first parameter's device, which is meta while the
    weights are offloaded, and some forwards move what they compute there (Idefics3's token embeddings go
    ``.to(self.device)``). The weights of a running module are on ``device``, so that is the true answer. Each
    such module gets, for the block, a subclass of its own class (same name) that only adds the property.

    Example:
        >>> with reports_device(model, torch.device("cpu")):  # doctest: +SKIP
        ...     model(**batch)
    """
    swapped = []
    if device is not None:
        for module in model.modules():
            cls = type(module)
            if isinstance(getattr(cls, "device", None), property) and hasattr(module, "config"):
                module.__class__ = _reporting(cls, device)
                swapped.append((module, cls))
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


_REPORTING: dict[tuple[type, torch.device], type] = {}


def _reporting(cls: type, device: torch.device) -> type:
    """``cls`` with ``device`` as its ``.device`` (one subclass per class and device)."""
    key = (cls, device)
    if key not in _REPORTING:
        attrs = {
            "device": property(lambda self: device),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        _REPORTING[key] = type(cls.__name__, (cls,), attrs)
    return _REPORTING[key]


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
