"""Memory plan: before any weight is read, predict each subgraph's device peak, host RAM and disk.

The model is built on the meta device and traced (no weights needed), then per subgraph:

    device  = its weights + GPTQ Hessians of its Linear layers (fp32, one per shared input)
              + activations of one batch: the values it reads and writes, and a layer's widest intermediate
    host    = process baseline + activation cache (values alive after the subgraph, for every batch)
              + the compressed weights waiting to be written
    disk    = the checkpoint (quantized widths) and, with the disk cache tier, the activation cache

Activations are sized from the config (hidden, intermediate, heads, vocabulary) because shapes are only
known at run time; the plan says so. Given ``max_device_memory``, a subgraph that would not fit makes the
plan retry with finer targets (the children of the layer class: attention, MLP) and report the switch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from seqcal.offload import params_under
from seqcal.partition import Subgraph

# Resident memory of a Python process with torch and transformers imported (measured on this machine).
PROCESS_BASELINE = 450 * 1024**2


@dataclass
class SubgraphPlan:
    index: int
    targets: list[str]
    weights: int
    hessians: int
    activations: int
    host_cache: int

    @property
    def device_peak(self) -> int:
        return self.weights + self.hessians + self.activations


@dataclass
class MemoryPlan:
    """Predicted memory per subgraph and for the whole run (bytes)."""

    rows: list[SubgraphPlan]
    host_peak: int
    disk: int
    notes: list[str] = field(default_factory=list)
    targets: list[str] | None = None  # the sequential targets the plan settled on

    @property
    def device_peak(self) -> int:
        return max(r.device_peak for r in self.rows) if self.rows else 0

    def table(self) -> str:
        gb = 1024**3
        lines = [
            f"{'#':>3}  {'target':<28} {'weights':>9} {'hessians':>9} {'activ.':>9} {'device':>9} {'cache':>9}"
        ]
        for r in self.rows:
            target = (r.targets[0] if r.targets else "-")[:28]
            lines.append(
                f"{r.index:>3}  {target:<28} {r.weights / gb:>8.3f}G {r.hessians / gb:>8.3f}G "
                f"{r.activations / gb:>8.3f}G {r.device_peak / gb:>8.3f}G {r.host_cache / gb:>8.3f}G"
            )
        lines.append(
            f"peak: device {self.device_peak / gb:.3f} GB, host {self.host_peak / gb:.3f} GB, "
            f"disk {self.disk / gb:.3f} GB"
        )
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def _hessian_bytes(model: torch.nn.Module, sg: Subgraph, quantized: set[str]) -> int:
    """fp32 Hessians: one per (parent, in_features), as q/k/v and gate/up share theirs."""
    seen: set[tuple[str, int]] = set()
    total = 0
    prefixes = tuple(m + "." for m in sg.modules)
    for name, module in model.named_modules():
        if name in quantized and (name in sg.modules or name.startswith(prefixes)):
            key = (name.rpartition(".")[0], module.in_features)
            if key not in seen:
                seen.add(key)
                total += module.in_features**2 * 4
    return total


def plan_memory(
    model: torch.nn.Module,
    subgraphs: list[Subgraph],
    quantized: set[str],
    *,
    num_samples: int,
    seq_len: int,
    batch_size: int,
    dtype_bytes: int,
    quant_bits: int = 4,
    disk_cache: bool = False,
) -> MemoryPlan:
    """Predict the run's memory (see the module docstring). ``model`` may be on meta."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", 0) or 0
    inter = getattr(text, "intermediate_size", 0) or 4 * hidden
    tokens = batch_size * seq_len
    batches = -(-num_samples // batch_size)
    hidden_bytes = tokens * hidden * dtype_bytes
    rows, alive = [], 0
    for sg in subgraphs:
        weights = sum(model.get_parameter(n).numel() * dtype_bytes for n in params_under(model, sg.modules))
        crossing = len(sg.inputs) + len(sg.outputs)
        # values read and written (hidden-sized), the widest intermediate (MLP up projection, x3 for gate/up/act),
        # and the fp32 copy of one layer's inputs the Hessian update makes
        activations = (
            crossing * hidden_bytes + 3 * tokens * inter * dtype_bytes + tokens * max(hidden, inter) * 4
        )
        alive = alive + len(sg.outputs) - len(sg.frees)
        host_cache = max(alive, 1) * hidden_bytes * batches
        rows.append(SubgraphPlan(sg.index, sg.targets, weights, _hessian_bytes(model, sg, quantized),
                                 activations, host_cache))  # fmt: skip
    params = sum(p.numel() for p in model.parameters())
    q_params = sum(model.get_submodule(n).weight.numel() for n in quantized)
    disk = (params - q_params) * dtype_bytes + q_params * quant_bits // 8 + q_params * dtype_bytes // 32
    host_peak = PROCESS_BASELINE + max((r.host_cache + r.weights for r in rows), default=0)
    if disk_cache:
        disk += max((r.host_cache for r in rows), default=0)
    notes = ["activation sizes come from the config (shapes are only known at run time)"]
    return MemoryPlan(rows, host_peak, disk, notes)


def finer_targets(model: torch.nn.Module, subgraphs: list[Subgraph]) -> list[str] | None:
    """Class names of the children (attention, MLP, ...) of the current target layers, or None."""
    names = [t for sg in subgraphs for t in sg.targets]
    if not names:
        return None
    layer = model.get_submodule(names[0])
    children = sorted({type(c).__name__ for c in layer.children() if any(True for _ in c.parameters())})
    return children or None


def make_plan(
    model: torch.nn.Module,
    modifiers: list[Any],
    *,
    num_samples: int,
    seq_len: int,
    batch_size: int,
    sequential_targets: list[str] | None,
    tracing_ignore: list[str],
    disk_cache: bool = False,
    max_device_memory: int | None = None,
) -> MemoryPlan:
    """Trace on a synthetic batch (no weights read) and plan; with ``max_device_memory``, refine targets."""
    from seqcal.subgraphs import trace_subgraphs

    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    quantized = {n for m in modifiers for n in getattr(m, "modules", {})}
    bits = max(
        (s.weights.num_bits for m in modifiers for s in getattr(m, "modules", {}).values()), default=16
    )
    dtype_bytes = next((p.element_size() for p in model.parameters()), 4)
    targets, notes = sequential_targets, []
    for _ in range(2):
        subgraphs = list(trace_subgraphs(model, sample, targets, tracing_ignore))
        plan = plan_memory(model, subgraphs, quantized, num_samples=num_samples, seq_len=seq_len,
                           batch_size=batch_size, dtype_bytes=dtype_bytes, quant_bits=bits,
                           disk_cache=disk_cache)  # fmt: skip
        plan.targets = targets
        if max_device_memory is None or plan.device_peak <= max_device_memory:
            break
        finer = finer_targets(model, subgraphs)
        if finer is None or finer == targets:
            notes.append(f"the largest subgraph needs {plan.device_peak / 1024**3:.2f} GB of device memory, more "
                         f"than max_device_memory; no finer targets exist")  # fmt: skip
            break
        notes.append(f"subgraphs of {targets or 'the inferred layers'} need {plan.device_peak / 1024**3:.2f} GB "
                     f"> max_device_memory: using finer targets {finer}")  # fmt: skip
        targets = finer
    plan.notes = notes + plan.notes
    return plan
