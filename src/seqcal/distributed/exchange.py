"""What the processes of a run exchange: the modifiers' partial statistics by recipe position, and a solved
subgraph's weights and results packed into one message.

A quantized module travels whole: its codes and scales with the scheme they follow (``QuantizedWeight.scheme``,
which a modifier may choose per module), so the receiving processes hold what the solver holds and the checkpoint
they write does not depend on which process solved a module."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from seqcal.distributed.reduce import Partial, named_from_bytes, named_to_bytes, tensors_of
from seqcal.modifiers import contract
from seqcal.modifiers.state import RunState
from seqcal.records import QuantizedWeight, scheme_from_record, scheme_record

_FIELDS = (
    "q", "scale", "zero_point", "g_idx", "global_scale", "input_scale", "input_zero_point", "input_global_scale"
)  # fmt: skip


def partials_of(modifiers: Sequence[Any]) -> Partial:
    """Every modifier's ``partial_statistics()``, keyed by its position in the recipe."""
    partial: Partial = {}
    for i, m in enumerate(modifiers):
        partial.update({f"{i}/{key}": stats for key, stats in contract.partial_statistics(m).items()})
    return partial


def load_statistics(modifiers: Sequence[Any], total: Partial | None) -> None:
    """Hand every modifier its part of the folded statistics (``partials_of``' keys)."""
    values = tensors_of(total or {})
    for i, m in enumerate(modifiers):
        prefix = f"{i}/"
        contract.load_statistics(m, {k[len(prefix) :]: v for k, v in values.items() if k.startswith(prefix)})


def pack(
    names: Sequence[str], model: torch.nn.Module, state: RunState, results: dict[int, dict[str, torch.Tensor]]
) -> bytes:
    """The modules ``names`` of a solved subgraph as one message: each one's quantized weight (codes, scales and
    scheme), its parameters and buffers and its records, with the modifiers' ``results`` by recipe position."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"log": [], "modules": {}}
    for name in names:  # quantized, pruned, folded into, or with calibrated buffers
        qw = state.results.quantized.get(name)
        for f in _FIELDS if qw is not None else ():
            if getattr(qw, f) is not None:
                tensors[f"{name}|{f}"] = getattr(qw, f)
        module = model.get_submodule(name)
        if hasattr(module, "weight"):
            tensors[f"{name}|weight"] = module.weight.data
        # the module's other tensors a modifier may have changed (a folded bias, k_scale / v_scale buffers)
        for key, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if key != "weight" and tensor is not None:
                tensors[f"{name}|.{key}"] = tensor.data
        meta["modules"][name] = {"quantized": qw is not None, "loss": qw.loss if qw is not None else None,
                                 "scheme": scheme_record(qw.scheme, name) if qw is not None else None,
                                 "sparsity": state.results.sparsity.get(name), "errors": state.results.module_errors.get(name, {}),
                                 "edited": name in state.ledger.edited, "changed": name in state.ledger.changed}  # fmt: skip
    for i, named in results.items():  # a modifier's results: "@<its position>|<name>"
        tensors.update({f"@{i}|{key}": tensor for key, tensor in named.items()})
    meta["log"] = [line for line in state.results.log if any(line.startswith(n) for n in names)]
    return named_to_bytes(tensors, {"seqcal": json.dumps(meta)})


def unpack(data: bytes, model: torch.nn.Module, state: RunState, modifiers: Sequence[Any] = (),
           subgraph: Any = None) -> list[str]:  # fmt: skip
    """Put what ``pack`` sent into ``model`` and ``state`` (each quantized weight with the scheme its solver
    quantized it with) and hand the ``modifiers`` their results; returns the names received."""
    tensors, raw = named_from_bytes(data)
    meta = json.loads(raw["seqcal"])
    for name, info in meta["modules"].items():
        module = model.get_submodule(name)
        for key in [k for k in tensors if k.startswith(f"{name}|")]:
            local = key.partition("|")[2]
            if local == "weight" or local.startswith("."):
                target = getattr(module, local.lstrip("."))
                target.data = tensors[key].to(target.device)
        if info.get("edited"):
            state.ledger.edited.add(name)
        if info.get("changed"):
            state.ledger.changed.add(name)
        if info["quantized"]:
            fields = {f: tensors.get(f"{name}|{f}") for f in _FIELDS}
            scheme = scheme_from_record(info["scheme"])
            state.results.quantized[name] = QuantizedWeight(**fields, scheme=scheme, loss=info["loss"])
        if info["sparsity"] is not None:
            state.results.sparsity[name] = info["sparsity"]
        state.results.module_errors.setdefault(name, {}).update(info["errors"])
    state.results.log.extend(line for line in meta["log"] if line not in state.results.log)
    results = [k for k in tensors if k.startswith("@")]
    for i, m in enumerate(modifiers):
        named = {k.partition("|")[2]: tensors[k] for k in results if k.partition("|")[0] == f"@{i}"}
        if named:
            m.load_results(subgraph, named, model)
    return [*meta["modules"], *results]
