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
        changed = modifier.compress(subgraph, model, state)      on the subgraph's owner; the other processes
                                                                 get its weights and modifier.load_results(...)
        (propagation pass when any modifier changed weights)
        (a resumed run's finished subgraphs: their saved weights put back, then modifier.replayed(subgraph, ...))
    modifier.finalize(model, state)              once

Version 2 adds services a modifier declares it needs (all optional, see docs/modifiers.md):

    transforms = True                            the modifier edits weights upstream of a group (smoothing)
    modifier.prepare(graph, model, state)        once, after tracing: the graph with the Linears as nodes
    modifier.upstream(subgraph) -> [names]       producers it may edit while ``subgraph`` runs (onloaded with it
                                                 and written to the checkpoint after it)
    modifier.on_fold(fold, model, state)         a transform folded scales into a group this modifier has
                                                 statistics for: move them to the new coordinates

Inside each group the order is fixed: transforms observe the group's inputs and fold (``state.fold``), the
cached inputs of the group are rewritten into the new coordinates, and only then do quantizers (GPTQ, static
observers) see them, so nothing a quantizer accumulates is ever in the old coordinates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import torch
from torch import fx

from seqcal.algorithms import dequantize
from seqcal.mappings import Mapping, fold_scales
from seqcal.modifiers.formats import weight_format
from seqcal.modifiers.needs import Gather, Needs
from seqcal.modifiers.schemes import strategy_of
from seqcal.records import REDUCTIONS as REDUCTIONS  # re-exported: these types moved to seqcal.records
from seqcal.records import Fold as Fold
from seqcal.records import QuantizedWeight as QuantizedWeight
from seqcal.records import Statistic as Statistic
from seqcal.records import fold, tensors_of
from seqcal.records import fold_records as fold_records
from seqcal.records import folds_from as folds_from
from seqcal.tracing.partition import Subgraph


@dataclass
class RunState:
    """Everything one calibration run accumulates; owned by the executor, passed to modifiers."""

    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)  # module name -> compressed weight
    module_errors: dict[str, dict[str, float]] = field(default_factory=dict)  # module name -> metrics
    log: list[str] = field(default_factory=list)  # human-readable events (fallbacks, warnings)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    report: dict[str, Any] = field(default_factory=dict)  # per-subgraph/per-module numbers, saved as JSON
    token_mask: torch.Tensor | None = None  # [batch, seq] bool of the batch being run (False = padding)
    # autocast dtype of the forward passes (None: the weights' dtype)
    compute_dtype: torch.dtype | None = None
    # Bytes of device memory the run may use (max_device_memory), or None: modifiers size their working
    # memory from it (GPTQ's stacked solves, modifiers.solve_chunks).
    device_budget: int | None = None
    # Virtual shards of the batches and the processes they run on (seqcal.distributed.ShardedRun), or None:
    # the executor then accumulates over all batches at once.
    sharding: Any = None
    # Pruned modules -> their mask structure ("2:4", "0:0"), set by the pruning modifiers: a later quantizer
    # keeps their zeros (GPTQ solves with the mask), the checkpoint records the sparsity.
    sparsity: dict[str, str] = field(default_factory=dict)
    # The recipe's kv_cache_scheme (compressed-tensors QuantizationArgs) when the KV cache is quantized: written
    # to quantization_config; the scales themselves are the attention modules' k_scale / v_scale buffers.
    kv_cache_scheme: Any = None
    # The one-pass cut's stand-in cache (``kv_hooks.kv_tap``) when the keys and values reach the graph through it.
    kv_tap: Any = None
    folds: list[Fold] = field(default_factory=list)  # scales folded so far, in order (``fold``)
    # Subgraph index -> the folds whose scales divided its cached inputs (the cut before the modules); a resumed
    # run divides them again when it replays the subgraph (``replay_folds``: those of the one being replayed).
    divided: dict[int, list[Fold]] = field(default_factory=dict)
    replay_folds: list[Fold] = field(default_factory=list)
    edited: set[str] = field(default_factory=set)  # producers whose weights a fold changed (saved, kept)
    # Every other module whose parameters or buffers a modifier changed in place, outside ``quantized``
    # (consumers of a fold, calibrated buffers): see ``changed_modules``.
    changed: set[str] = field(default_factory=set)
    # Online rotations (QuIP, SpinQuant R4): compressed-tensors' ``transform_config`` block and its matrices,
    # checkpoint key -> tensor; written to config.json's quantization_config and the checkpoint's tensors.
    transform_config: dict[str, Any] = field(default_factory=dict)
    transform_tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def changed_modules(self) -> set[str]:
        """Every module whose weights a modifier changed: quantized, folded into (producer or consumer), pruned,
        or marked in ``changed``. A resumed run puts them all back when it replays a finished subgraph, and
        offloaded weights are copied back to the host for them."""
        return {*self.quantized, *self.edited, *self.sparsity, *self.changed}

    def reduce_shards(
        self, per_shard: list[dict[str, dict[str, Statistic]]]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """A further round of reduction, inside ``compress`` of a modifier that ``compresses_everywhere``: one
        partial per virtual shard of this process (in order), folded in shard order over every process, and
        the result returned on every process (AWQ's grid-search losses). Every process must call it the same
        number of times, in the same order.

        Example:
            >>> RunState().reduce_shards([{"l": {"s": Statistic(torch.ones(2))}}])["l"]["s"]
            tensor([1., 1.])
        """
        if self.sharding is not None:
            return self.sharding.reduce_round(per_shard, self.device)
        total = None
        for partial in per_shard:
            total = fold(total, partial)
        return tensors_of(total or {})

    def fold(self, model: torch.nn.Module, mapping: Mapping, scales: torch.Tensor) -> Fold:
        """Fold smoothing ``scales`` into ``mapping`` (``seqcal.mappings.fold_scales``) and record it, so the
        pipeline moves the group's cached inputs and other modifiers' statistics to the new coordinates.

        A producer quantized already (a Linear of an earlier group in the one-pass cut: up_proj before
        down_proj's inputs are seen) takes the fold when its codes stay valid (``refold_refusal``): the scales of
        its rows are divided, the codes kept, and its weight is their dequantized value.

        Raises:
            RuntimeError: a consumer is already quantized, or the producer is and cannot take the fold.
        """
        done = [n for n in mapping.consumers if n in self.quantized]
        if done:
            raise RuntimeError(
                f"cannot fold scales into {mapping.producer} -> {', '.join(mapping.consumers)}: {done[0]} is "
                "already quantized; transforms must run before the quantizers of the group"
            )
        if why := self.refold_refusal(model, mapping.producer):
            raise RuntimeError(
                f"cannot fold scales into {mapping.producer} -> {', '.join(mapping.consumers)}: "
                f"{mapping.producer} is already quantized and {why}"
            )
        fold_scales(model, mapping, scales)
        if mapping.producer in self.quantized:
            self.quantized[mapping.producer] = _rows_divided(model, mapping.producer,
                                                             self.quantized[mapping.producer], scales)  # fmt: skip
        record = Fold(mapping, scales.detach().float())
        self.folds.append(record)
        self.edited.add(mapping.producer)
        self.changed.update(mapping.consumers)  # their columns were scaled: not the model's weights any more
        return record

    def refold_refusal(self, model: torch.nn.Module, producer: str) -> str | None:
        """Why smoothing scales cannot be folded into ``producer``'s rows now that it is quantized (None: they
        can, or it is not quantized). Dividing row ``i`` by ``s_i`` keeps every code when each weight scale
        belongs to one row (strategies channel and group, float scales): the row's scales are divided. One scale
        across rows (tensor, blocks), fp8 or e8m0 scales (NVFP4, MX) would need new codes, and keys or values
        whose KV-cache scales were calibrated already would no longer match them."""
        qw = self.quantized.get(producer)
        if qw is None:
            return None
        if (fmt := weight_format(qw.scheme)) is not None:
            return f"its format ({fmt.strategy}, {fmt.scale} scales) would need new codes for scaled rows"
        if (strategy := strategy_of(qw.scheme.weights)) not in ("channel", "group"):
            return f"one weight scale spans all its rows (strategy {strategy!r}): scaled rows would need new codes"
        if qw.q.numel() == 0:
            return "its codes were written to the checkpoint already"
        parts = producer.split(".")
        parents = [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
        for parent in parents if self.kv_cache_scheme is not None else ():
            if hasattr(model.get_submodule(parent), "v_scale"):
                return f"its outputs reach the quantized KV cache of {parent}, whose scales are calibrated already"
        return None


def _rows_divided(
    model: torch.nn.Module, producer: str, qw: QuantizedWeight, scales: torch.Tensor
) -> QuantizedWeight:
    """``qw`` with its last ``len(scales)`` rows divided by ``scales`` (the rows ``fold_scales`` divided): those
    rows' scales divided, the codes kept, and the module's weight set to the dequantized result, so that the
    model computes what the checkpoint will hold."""
    weight = model.get_submodule(producer).weight
    scale = qw.scale.clone()
    rows = slice(scale.shape[0] - scales.shape[0], None)
    scale[rows] = (scale[rows].float() / scales.to(scale.device).unsqueeze(-1)).to(scale.dtype)
    group = qw.scheme.weights.group_size if strategy_of(qw.scheme.weights) == "group" else None
    values = dequantize(qw.q, scale, qw.zero_point, group_size=group, g_idx=qw.g_idx, dtype=weight.dtype)
    weight.data = values.to(weight.device)
    return replace(qw, scale=scale)


class Modifier:
    """Base class of every modifier; subclasses are dataclasses whose fields are the recipe arguments."""

    name: ClassVar[str] = "Modifier"
    needs_calibration: ClassVar[bool] = False  # False: data-free, the executor may skip calibration passes
    # True: calibration needs only the inputs of the modifier's own modules (``observe``), so the pipeline
    # may cut subgraphs before those modules and run each subgraph once instead of twice.
    input_only: ClassVar[bool] = False
    # False: an interrupted run cannot be resumed, because this modifier changes weights that a replayed
    # subgraph cannot put back (neither quantized nor recorded in ``RunState.changed_modules``).
    resumable: ClassVar[bool] = True

    # Statistics the framework gathers for this modifier from each of its modules' inputs, in every cut, and
    # reduces across processes in shard order; ``compress`` reads them with ``gathered(module)``.
    gathers: ClassVar[tuple[Gather, ...]] = ()

    def needs(self) -> Needs:
        """What this modifier needs from the pipeline: every stage asks this (through ``ModifierSet``), never
        the attributes it is made from (the class flags above and below, set per instance where an argument
        decides, as a kv_cache_scheme makes a data-free quantizer calibrate)."""
        return Needs(
            calibration=self.needs_calibration,
            input_only=self.input_only,
            transforms=self.transforms,
            graph=self.needs_graph,
            everywhere=self.compresses_everywhere,
            shared_statistics=self.shares_statistics(),
            resumable=self.resumable,
        )

    def gathered(self, module: str) -> dict[str, torch.Tensor]:
        """The declared statistics (``gathers``) of ``module``, every batch's, reduced: inside ``compress``.

        Raises:
            KeyError: no calibration batch reached ``module`` (or the class declares no ``gathers``).
        """
        values = self.__dict__.get("_gathered")
        if values is None or module not in values.reduced:
            raise KeyError(
                f"{self.name}: no statistics were gathered for {module} (no calibration input reached it)"
            )
        return values.reduced[module]

    def modules_in(self, subgraph: Subgraph) -> list[str]:
        """The modules of this modifier whose weights ``subgraph`` uses (none by default)."""
        return []

    def quantizes(self) -> dict[str, Any]:
        """Module name -> compressed-tensors scheme of every Linear this modifier quantizes (after validate)."""
        return {}

    def prunes(self) -> dict[str, Any]:
        """Module name -> sparsity of every Linear this modifier prunes (after validate)."""
        return {}

    def scheme_groups(self) -> dict[str, Any]:
        """The recipe's compressed-tensors scheme groups (config group name -> QuantizationScheme), known before
        the model is: whether the recipe quantizes activations, say."""
        return {}

    def kv_calibration(self) -> Any:
        """The KV-cache calibration (``modifiers.kv_cache.KVCacheCalibration``) when this modifier quantizes the
        KV cache, else None."""
        return None

    def layer_targets(self) -> Any:
        """Layer classes or patterns to calibrate one by one (llm-compressor's ``sequential_targets``), or None."""
        return None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in vars(
            cls
        ):  # a subclass is named after itself in messages and recipes, not its parent
            cls.name = cls.__name__

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

    # True: ``compress`` runs on every process, not only on the subgraph's owner, with this modifier's statistics
    # loaded on every process; it may reduce more in between (``RunState.reduce_shards``: AWQ's search losses)
    # and must do the same on every process (folds, weights), which the owner's weights then overwrite.
    compresses_everywhere: ClassVar[bool] = False

    def shares_statistics(self) -> bool:
        """True when every statistic this modifier gathers from data goes through ``partial_statistics``, so
        that several processes give the one-process result. False (the default) makes a run with more than
        one process refuse the modifier instead of solving on one process's share of the data."""
        return not self.needs_calibration

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        """Use what calibration gathered; return True when weights of ``subgraph`` changed."""
        return False

    def results(self, subgraph: Subgraph, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """What ``compress`` computed besides the quantized weights (``state.quantized``, sent by the run
        itself) that every process needs to propagate ``subgraph`` as the one that compressed it: named
        tensors (the KV cache's ``k_scale`` / ``v_scale``). With several processes only the subgraph's owner
        compresses; the others get these through ``load_results``."""
        return {}

    def load_results(
        self, subgraph: Subgraph, results: dict[str, torch.Tensor], model: torch.nn.Module
    ) -> None:
        """Take ``results`` computed by the process that compressed ``subgraph`` (instead of ``compress``)."""

    # --- version 2 services (optional) ---------------------------------------------------------------------

    # True: the modifier edits weights upstream of its groups (SmoothQuant, AWQ). The executor runs its
    # calibration (``observe`` or ``calibrate`` hooks) and ``compress`` on each subgraph before every other
    # modifier sees the group's inputs, then rewrites the cached inputs by the folds it recorded.
    transforms: ClassVar[bool] = False
    # True: ``prepare`` gets the traced graph although the modifier is no transform (AWQ derives its mappings).
    needs_graph: ClassVar[bool] = False

    def prepare(self, graph: fx.Graph, model: torch.nn.Module, state: RunState) -> None:
        """After tracing, before calibration: ``graph`` has every Linear as a call_module node (for
        ``seqcal.mappings.resolve_mappings``). Raise ValueError here for mappings that cannot apply."""

    def upstream(self, subgraph: Subgraph) -> list[str]:
        """Modules outside ``subgraph`` whose weights this modifier edits while it runs (the producers it folds
        into): the pipeline onloads them with it and saves them after it."""
        return []

    def on_fold(self, fold: Fold, model: torch.nn.Module, state: RunState) -> None:
        """Another modifier folded ``fold.scales`` into ``fold.mapping``: statistics this modifier already
        holds for its consumers must move to the new coordinates (inputs ``X / scales``). The default holds
        none; a modifier that cannot move its statistics exactly raises RuntimeError naming them."""

    def replayed(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> None:
        """A resumed run put back ``subgraph`` as an interrupted run finished it (its saved weights, buffers and
        ``state`` records) instead of calibrating it: note its modules as done, as ``compress`` would have."""

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
