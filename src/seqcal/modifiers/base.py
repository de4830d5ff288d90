"""The modifier lifecycle: what the executor calls, in order, for every subgraph.

A modifier is a typed dataclass (its fields are the recipe's arguments, with llm-compressor's names).
The executor owns hooks and state and passes them down; a modifier keeps nothing global:

    modifier.validate(model)                     once, before any weight is touched
    modifier.initialize(model, state)            once: resolve targets, data-free work
    for each subgraph:
        with modifier.calibrate(subgraph, model, state):   hooks live only inside this block
            calibration pass over all batches
            (or, for subgraphs cut before their modules: modifier.observe(names, x, state) per batch)
            (after each virtual shard of the batches: modifier.partial_statistics(), folded in shard order
             across shards and processes, then modifier.load_statistics(reduced); seqcal.distributed)
        changed = modifier.compress(subgraph, model, state)
        (propagation pass when any modifier changed weights)
    modifier.finalize(model, state)              once
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from seqcal.tracing.partition import Subgraph


@dataclass
class QuantizedWeight:
    """The compressed form of one Linear weight, produced by a modifier and written by ``save``.

    Attributes:
        q: integer codes (int8 storage; fp8 for float schemes) in the original column order, [out, in].
        scale: per tensor [1], channel [out, 1] or group [out, in // group_size].
        zero_point: same shape as scale (None for symmetric schemes).
        g_idx: group index of each input column ([in], int32) for activation ordering "group", else None.
        scheme: the compressed-tensors QuantizationScheme the weight follows (weights and activations).
        loss: the solver's objective (GPTQ loss), None for round-to-nearest.
        global_scale: float32 [1] NVFP4 global scale (``tensor_group`` schemes; scale is then fp8-valued and
            the effective scale is ``scale / global_scale``), else None.
        input_scale: calibrated static input scale ([1] per tensor, [in // group_size] per group) for schemes
            with static input activations, else None.
        input_zero_point: its zero point (int8 codes) when those activations are asymmetric, else None.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    g_idx: torch.Tensor | None
    scheme: Any  # compressed_tensors.quantization.QuantizationScheme
    loss: float | None = None
    global_scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    input_zero_point: torch.Tensor | None = None


# How partial statistics of virtual shards combine (seqcal.distributed.reduce): elementwise, in shard order.
REDUCTIONS = ("sum", "max", "min")


@dataclass
class Statistic:
    """One partial statistic a modifier accumulated over a virtual shard of the calibration batches.

    Attributes:
        tensor: the shard's partial value (a sum, or a running max / min).
        reduce: how partials of several shards combine, elementwise: "sum", "max" or "min".
    """

    tensor: torch.Tensor
    reduce: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"Statistic.reduce={self.reduce!r} is not one of {REDUCTIONS}")


@dataclass
class RunState:
    """Everything one calibration run accumulates; owned by the executor, passed to modifiers."""

    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)  # module name -> compressed weight
    module_errors: dict[str, dict[str, float]] = field(default_factory=dict)  # module name -> metrics
    log: list[str] = field(default_factory=list)  # human-readable events (fallbacks, warnings)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    report: dict[str, Any] = field(default_factory=dict)  # per-subgraph/per-module numbers, saved as JSON
    token_mask: torch.Tensor | None = None
    compute_dtype: torch.dtype | None = (
        None  # autocast dtype of the forward passes (None: the weights' dtype)  # [batch, seq] bool of the batch being run (False = padding)
    )
    # Bytes of device memory the run may use (max_device_memory), or None: modifiers size their working
    # memory from it (GPTQ's stacked solves, modifiers.solve_chunks).
    device_budget: int | None = None
    # Virtual shards of the batches and the processes they run on (seqcal.distributed.ShardedRun), or None:
    # the executor then accumulates over all batches at once.
    sharding: Any = None


class Modifier:
    """Base class of every modifier; subclasses are dataclasses whose fields are the recipe arguments."""

    name: ClassVar[str] = "Modifier"
    needs_calibration: ClassVar[bool] = False  # False: data-free, the executor may skip calibration passes
    # True: calibration needs only the inputs of the modifier's own modules (``observe``), so the pipeline
    # may cut subgraphs before those modules and run each subgraph once instead of twice.
    input_only: ClassVar[bool] = False

    @classmethod
    def argument_names(cls) -> list[str]:
        return [f.name for f in fields(cls)] if hasattr(cls, "__dataclass_fields__") else []

    def validate(self, model: torch.nn.Module) -> None:
        """Check the arguments against the model before any work; raise ValueError naming the fix."""

    def initialize(self, model: torch.nn.Module, state: RunState) -> None:
        """Resolve targets; data-free modifiers may do all their work here."""

    @contextlib.contextmanager
    def calibrate(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> Iterator[None]:
        """Attach hooks for the calibration pass of ``subgraph``; they are removed on exit, also on error."""
        yield

    def observe(self, names: list[str], x: torch.Tensor, state: RunState) -> None:
        """One batch's input ``x`` of the modules ``names`` (they all read it), for ``input_only`` modifiers.

        Called instead of hooks when subgraphs are cut before the modules (``state.token_mask`` is set).
        """

    def partial_statistics(self) -> dict[str, dict[str, Statistic]]:
        """What calibration accumulated since the last call (one virtual shard), handed over and forgotten.

        Every statistic a modifier gathers from data goes through here, so that shards (and the processes
        that run them) combine in one fixed order: ``{key: {stat name: Statistic}}``, where ``key`` names
        a unit of state (a Hessian shared by q/k/v, one module's observer) the same way in every process.
        """
        return {}

    def load_statistics(self, reduced: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take the statistics of every shard, combined (``partial_statistics``' keys), before ``compress``."""

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        """Use what calibration gathered; return True when weights of ``subgraph`` changed."""
        return False

    def finalize(self, model: torch.nn.Module, state: RunState) -> None:
        """Last step after all subgraphs (e.g. remove leftover state)."""

    def to_dict(self) -> dict[str, Any]:
        """Arguments for recipe.yaml (only those that differ from the defaults)."""
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            if value != default:
                out[f.name] = value
        return out
