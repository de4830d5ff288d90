"""Mixture-of-experts models: fused experts taken apart into per-expert Linears for a run, and put back.

    handle = linearize_experts(model)          # model.layers.3.mlp.experts.17.down_proj is a Linear now
    ... resolve targets, calibrate, quantize, save (per-expert checkpoint names) ...
    handle.restore()                           # the fused parameters again, with the quantized values

``linearize_experts`` works on a model in RAM and on a model skeleton on meta (``load_offloaded``); for the
latter ``map_offloaded`` tells the weight store where each expert's tensors are in the checkpoint (per expert
under its original name, or a slice of a fused tensor).

Example:
    >>> handle = linearize_experts(model, calibrate_all=True)  # doctest: +SKIP
    >>> handle.count                                          # doctest: +SKIP
    48
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from seqcal.experts.layout import (
    ExpertsLayout,
    checkpoint_names,
    experts_layout,
    fused_modules,
    per_expert_on_disk,
    weight_conversions,
)
from seqcal.experts.modules import ExpertMLP, LinearExperts

logger = logging.getLogger("seqcal")

__all__ = [
    "ExpertsLayout",
    "LinearExperts",
    "Linearized",
    "every_token",
    "fused_modules",
    "linearize_experts",
    "routed_experts",
    "shared_expert_inputs",
]


@dataclass
class Linearized:
    """The experts modules ``linearize_experts`` replaced: qualified name -> the LinearExperts in its place."""

    model: nn.Module
    replaced: dict[str, LinearExperts] = field(default_factory=dict)

    @property
    def count(self) -> int:
        """Number of expert projections now exposed as Linear modules."""
        return sum(m.layout.num_experts * (3 if m.layout.has_gate else 2) for m in self.replaced.values())

    def restore(self) -> None:
        """Put the fused modules back, their 3-D parameters rebuilt from the (possibly quantized) Linears."""
        for name, linear in self.replaced.items():
            fused = linear.fused
            for pname, value in _fuse(linear).items():
                fused.register_parameter(pname, nn.Parameter(value, requires_grad=linear.requires_grad))
            _set_module(self.model, name, fused)
        self.replaced.clear()


def linearize_experts(model: nn.Module, calibrate_all: bool = True) -> Linearized:
    """Replace every fused experts module of ``model`` by per-expert Linears (see ``LinearExperts``).

    Parameters on meta stay on meta (an offloaded model); others are copied per expert and the fused
    tensors released, one module at a time, so memory does not grow. Modules already linearized keep their
    Linears and only take the new ``calibrate_all``.

    Args:
        model: a transformers model (or any module holding experts built by ``use_experts_implementation``).
        calibrate_all: every expert sees every token during calibration (routing still gives the output).

    Returns:
        The handle that restores the fused modules.

    Example:
        >>> linearize_experts(model).count  # doctest: +SKIP
        48
    """
    handle = Linearized(model)
    conversions = None  # transformers' weight conversions, read once (they walk every module)
    fused_on_disk = []
    for name, module in list(model.named_modules()):
        if isinstance(module, LinearExperts):
            module.calibrate_all = calibrate_all
            handle.replaced[name] = module
            continue
        layout = experts_layout(module)
        if layout is None:
            continue
        conversions = weight_conversions(model) if conversions is None else conversions
        if not per_expert_on_disk(conversions, name, layout.first):
            fused_on_disk.append(name)
        layout = experts_layout(module, checkpoint_names(conversions, name, layout.has_gate))
        linear = _linearize(module, layout, calibrate_all)  # type: ignore[arg-type]
        _set_module(model, name, linear)
        handle.replaced[name] = linear
    if fused_on_disk:
        first = f"{fused_on_disk[0]}.{{i}}.{handle.replaced[fused_on_disk[0]].layout.names[0]}"
        logger.warning(
            "seqcal: %s stores its experts fused in its own checkpoints; the quantized checkpoint stores them per "
            "expert (%s, ...), which transformers cannot load into this architecture's fused experts",
            type(model).__name__, first,
        )  # fmt: skip
    return handle


def _linearize(fused: nn.Module, layout: ExpertsLayout, calibrate_all: bool) -> LinearExperts:
    params = {n: fused.get_parameter(n) for n in layout.fused_parameters()}
    linear = LinearExperts(fused, layout, calibrate_all)
    linear.requires_grad = params[layout.first].requires_grad  # given back by restore()
    for e in range(layout.num_experts):
        views = layout.expert_weights(params, e)
        copies = {leaf: {kind: _own(v) for kind, v in tensors.items()} for leaf, tensors in views.items()}
        linear.add_module(str(e), ExpertMLP(copies))
    for pname in params:
        del fused._parameters[pname]  # released here; restore() rebuilds them from the Linears
    return linear


def _own(view: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of one expert's slice (a meta tensor stays a meta view: nothing to copy)."""
    return view.detach() if view.is_meta else view.detach().clone(memory_format=torch.contiguous_format)


def _fuse(linear: LinearExperts) -> dict[str, torch.Tensor]:
    """The fused parameters of ``linear.fused`` from the per-expert Linears (meta when they are on meta)."""
    layout = linear.layout
    gate, up, down = layout.names
    leaves = [gate, up] if layout.has_gate else [up]
    experts = linear.experts

    def stack(parts: list[torch.Tensor], transpose: bool) -> torch.Tensor:
        if any(p.is_meta for p in parts):
            shape = (len(parts), *(parts[0].shape[::-1] if transpose else parts[0].shape))
            return torch.empty(shape, dtype=parts[0].dtype, device="meta")
        return torch.stack([p.transpose(-1, -2) if transpose else p for p in parts]).contiguous()

    tr = layout.is_transposed
    out = {
        layout.first: stack([_joined(layout, e, leaves, "weight") for e in experts], tr),
        "down_proj": stack([getattr(e, down).weight.detach() for e in experts], tr),
    }
    if layout.has_bias:
        out[f"{layout.first}_bias"] = stack([_joined(layout, e, leaves, "bias") for e in experts], False)
        out["down_proj_bias"] = stack([getattr(e, down).bias.detach() for e in experts], False)
    return out


def _joined(layout: ExpertsLayout, expert: nn.Module, leaves: list[str], kind: str) -> torch.Tensor:
    parts = [getattr(getattr(expert, leaf), kind).detach() for leaf in leaves]
    if any(p.is_meta for p in parts):
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        return torch.empty(shape, dtype=parts[0].dtype, device="meta")
    return layout.join_first(parts)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, module)


def routed_experts(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The modules among ``names`` that are projections of a ``LinearExperts`` (run in a routing loop)."""
    prefixes = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, LinearExperts))
    return [n for n in names if n.startswith(prefixes)] if prefixes else []


def shared_expert_inputs(model: nn.Module) -> dict[str, str]:
    """Expert projections reading the layer's tokens in all-experts mode -> their experts module.

    With ``calibrate_all`` every expert's gate and up projections read the same input, so they share one
    Hessian (and one stacked solve); down projections read each expert's own activations.

    Example:
        >>> shared_expert_inputs(model)["model.layers.0.mlp.experts.3.gate_proj"]  # doctest: +SKIP
        'model.layers.0.mlp.experts'
    """
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearExperts) and module.calibrate_all:
            gate, up, _ = module.layout.names
            leaves = (gate, up) if module.layout.has_gate else (up,)
            out.update(
                {f"{name}.{e}.{leaf}": name for e in range(module.layout.num_experts) for leaf in leaves}
            )
    return out


@contextlib.contextmanager
def every_token(model: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """All-experts calibration for the block: the ``LinearExperts`` (with ``calibrate_all``) whose expert
    projections are among ``names`` run every expert on every token, as a modifier accumulating those
    projections' inputs needs; outside it they run each expert on its routed tokens only (same output).

    Why: the propagation pass after the solve only needs the layer's output, and running every expert on
    every token costs ``num_experts / top_k`` times the routed compute and its activations.

    Example:
        >>> with every_token(model, ["model.layers.0.mlp.experts.3.gate_proj"]):  # doctest: +SKIP
        ...     model(**batch)  # expert 3 (and the others of layer 0) see every token
    """
    switched = []
    for owner in {n.rsplit(".", 2)[0] for n in names if n.count(".") >= 2}:  # experts.{e}.{projection}
        try:
            module = model.get_submodule(owner)
        except AttributeError:  # a name not that deep in the model
            continue
        if isinstance(module, LinearExperts) and module.calibrate_all and not module.observed:
            module.observed = True
            switched.append(module)
    try:
        yield
    finally:
        for module in switched:
            module.observed = False
