"""The modifier lifecycle: what the executor calls, in order, for every subgraph.

A modifier is a typed dataclass (its fields are the recipe's arguments, with llm-compressor's names).
The executor owns hooks and state (``modifiers.state``: the run's configuration, results and fold ledger) and
passes them down; a modifier keeps nothing global:

    modifier.validate(model)                     once, before any weight is touched
    modifier.initialize(model, state)            once: resolve targets, data-free work
    for each subgraph:
        with modifier.calibrate(subgraph, model, state, batches):   hooks live only inside this block
            calibration pass over all batches (hooks read the batch being run: batches.current)
            (or, for subgraphs cut before their modules: modifier.observe(names, x, state, batch) per batch)
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
from dataclasses import fields
from typing import Any, ClassVar

import torch
from torch import fx

from seqcal.modifiers.needs import Gather, Needs

# re-exported: the run state and its parts live in modifiers.state
from seqcal.modifiers.state import Batch as Batch
from seqcal.modifiers.state import BatchCursor as BatchCursor
from seqcal.modifiers.state import RunState as RunState
from seqcal.records import REDUCTIONS as REDUCTIONS  # re-exported: these types moved to seqcal.records
from seqcal.records import Fold as Fold
from seqcal.records import QuantizedWeight as QuantizedWeight
from seqcal.records import Statistic as Statistic
from seqcal.records import fold_records as fold_records
from seqcal.records import folds_from as folds_from
from seqcal.tracing.partition import Subgraph


class Modifier:
    """Base class of every modifier; subclasses are dataclasses whose fields are the recipe arguments."""

    name: ClassVar[str] = "Modifier"
    needs_calibration: ClassVar[bool] = False  # False: data-free, the executor may skip calibration passes
    # True: calibration needs only the inputs of the modifier's own modules (``observe``), so the pipeline
    # may cut subgraphs before those modules and run each subgraph once instead of twice.
    input_only: ClassVar[bool] = False
    # False: an interrupted run cannot be resumed, because this modifier changes weights that a replayed
    # subgraph cannot put back (neither quantized nor recorded in ``state.ledger.changed``).
    resumable: ClassVar[bool] = True
    # Why a run refuses this modifier when it is not resumable ("X, which cannot be resumed (...)"), or in several
    # processes when ``shares_statistics`` is False ("X <this>; run it in one process ..."): a modifier that
    # refuses for another reason says its own.
    not_resumable_because: ClassVar[str] = (
        "replayed layers would lack the weights it changed besides the quantized ones"
    )
    not_shared_because: ClassVar[str] = (
        "gathers statistics that do not yet reduce across processes (each would solve on its own share of the data)"
    )
    # True: ``compress`` removes or renumbers modules (REAP's expert pruning); it runs last in each subgraph.
    restructures: ClassVar[bool] = False
    # True: it changes no weight besides its quantized or pruned modules' (``Needs.own_modules_only``); a
    # subclass that folds into other modules (AWQ) says False again.
    own_modules_only: ClassVar[bool] = False

    # Statistics the framework gathers for this modifier from each of its modules' inputs, in every cut, and
    # reduces across processes in shard order; ``compress`` reads them with ``gathered(module)``. Declared on
    # the class, or set per instance where an argument decides (imatrix_mse weights: QuantizationModifier).
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
            restructures=self.restructures,
            own_modules_only=self.own_modules_only,
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
    def calibrate(
        self, subgraph: Subgraph, model: torch.nn.Module, state: RunState, batches: BatchCursor
    ) -> Iterator[None]:
        """Attach hooks for the calibration pass of ``subgraph``; they are removed on exit, also on error.
        A hook reads the batch being run (its token mask) from ``batches.current``."""
        yield

    def observe(self, names: list[str], x: torch.Tensor, state: RunState, batch: Batch) -> None:
        """One batch's input ``x`` of the modules ``names`` (they all read it), for ``input_only`` modifiers.

        Called instead of hooks when subgraphs are cut before the modules; ``batch.real(x)`` drops its padding.
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
        """What ``compress`` computed besides the quantized weights (``state.results.quantized``, sent by the run
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
