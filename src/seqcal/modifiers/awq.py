"""AWQModifier: activation-aware scales searched per mapping, folded, then round-to-nearest quantization.

Math in ``seqcal.algorithms.awq``; the search for one mapping's scales in ``seqcal.modifiers.awq_search``; mappings from the traced graph (``seqcal.mappings``) or the recipe
(``seqcal.modifiers._awq_mappings``, llm-compressor's format); the scales fold through ``RunState.fold``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from seqcal.algorithms.awq import DUO_SCALING, add_channel_abs
from seqcal.mappings import resolve_mappings
from seqcal.modifiers._awq_mappings import AWQMapping, from_mapping, resolve
from seqcal.modifiers.activations import InputCalibration
from seqcal.modifiers.awq_search import search_autocast, search_mapping
from seqcal.modifiers.base import BatchCursor, RunState, Statistic
from seqcal.modifiers.quantization import QuantizationModifier
from seqcal.modifiers.round_to_nearest import quant_kwargs, rounded
from seqcal.modifiers.spans import SpanCache
from seqcal.tracing.partition import Subgraph


@dataclass
class AWQModifier(QuantizationModifier):
    """AWQ (Lin et al., 2023) with llm-compressor's arguments: scale each mapping's channels, then quantize.

    Args (besides QuantizationModifier's targets, scheme, config_groups, ignore; with neither scheme nor
    config_groups the QuantizationModifier right after it in the recipe gives them, as in llm-compressor 0.14):
        mappings: [{smooth_layer: pattern, balance_layers: [patterns]}]; None: Llama-like defaults.
        duo_scaling: True (activations and weights), False (activations only) or "both" (half the grid each).
        n_grid: grid points of the scale search.
        offload_device: where the cached span inputs wait ("cpu"), None: where they were computed.
        max_chunk_memory: bytes of cached inputs per span the search may keep, split evenly over the virtual
            shards (each keeps its first batches within its share); later batches are left out of the search
            (never out of the activation statistics).
        screen_every, screen_keep: a span that has to be run per grid point (attention, MLP) scores the whole
            grid on every ``screen_every``-th recorded batch of each virtual shard first; then only the identity
            scale and the ``screen_keep`` points with the lowest screening loss run on the other batches, and
            the lowest loss over every batch wins. ``screen_keep: null`` runs every point on every batch
            (llm-compressor's search). When the shortlist holds the exhaustive search's winner, the scales are
            the same bit for bit (the losses are summed in the same order).

    Example:
        >>> AWQModifier(scheme="W4A16_ASYM", ignore=["lm_head"], duo_scaling="both")  # doctest: +SKIP
    """

    own_modules_only: ClassVar[bool] = False  # folds its scales into the producers of its modules

    name: ClassVar[str] = "AWQModifier"
    mixed_observer: ClassVar[str | None] = "minmax"  # its search rounds with min-max ranges
    needs_calibration: ClassVar[bool] = True
    input_only: ClassVar[bool] = False  # re-runs whole spans (self_attn, mlp) on their cached arguments
    mappings: list[Any] | None = None
    duo_scaling: bool | str = True
    n_grid: int = 20
    offload_device: str | None = None
    max_chunk_memory: int = 1 << 30
    screen_every: int = 4
    screen_keep: int | None = 3

    def __post_init__(self) -> None:
        if self.duo_scaling not in DUO_SCALING or not isinstance(self.duo_scaling, (bool, str)):
            raise ValueError(
                f"{self.name}: duo_scaling must be True, False or 'both', got {self.duo_scaling!r}"
            )
        least = {True: 3, False: 2, "both": 4}[self.duo_scaling]  # ratios i / (n - 1) need n >= 2 per family
        if isinstance(self.n_grid, bool) or not isinstance(self.n_grid, int) or self.n_grid < least:
            raise ValueError(f"{self.name}: n_grid must be an integer >= {least} for duo_scaling="
                             f"{self.duo_scaling!r}, got {self.n_grid!r}")  # fmt: skip
        if isinstance(self.max_chunk_memory, bool) or not isinstance(self.max_chunk_memory, int) or self.max_chunk_memory < 1:  # fmt: skip
            raise ValueError(f"{self.name}: max_chunk_memory must be a positive number of bytes, got {self.max_chunk_memory!r}")  # fmt: skip
        if (
            isinstance(self.screen_every, bool)
            or not isinstance(self.screen_every, int)
            or self.screen_every < 1
        ):
            raise ValueError(f"{self.name}: screen_every must be an integer >= 1, got {self.screen_every!r}")
        if self.screen_keep is not None and (isinstance(self.screen_keep, bool) or not isinstance(self.screen_keep, int) or self.screen_keep < 1):  # fmt: skip
            raise ValueError(f"{self.name}: screen_keep must be an integer >= 1 or null (no screening), got "
                             f"{self.screen_keep!r}")  # fmt: skip
        self.bare = self.scheme is None and self.config_groups is None and self.mixed_precision is None
        self._mappings: list[AWQMapping] = []
        self._skipped: list[str] = []
        if not self.bare:
            super().__post_init__()
            return
        self.ignore = [self.ignore] if isinstance(self.ignore, str) else self.ignore
        self.groups, self.modules, self._fused, self._global_scales = {}, {}, [], {}
        self.inputs = InputCalibration({})

    def bind(self, quantization: QuantizationModifier) -> AWQModifier:
        """This bare AWQModifier with the scheme of the QuantizationModifier after it (llm-compressor 0.14)."""
        return AWQModifier(**{**quantization.to_dict(), **self.to_dict()})

    def validate(self, model: torch.nn.Module) -> None:
        if self.bare:
            raise ValueError(f"{self.name}: no quantization scheme; give `scheme` (such as W4A16_ASYM) or "
                             "`config_groups`, or put a QuantizationModifier right after it in the recipe")  # fmt: skip
        super().validate(model)
        mappings, skipped = resolve(model, self.mappings, self.name)
        self._mappings = [m for m in mappings if any(b in self.modules for b in m.balance)]
        self._skipped = (
            skipped  # llm-compressor skips these too (v_proj -> o_proj under grouped-query attention)
        )
        if self.duo_scaling is not False:
            balance = [b for m in self._mappings for b in m.balance if b in self.modules]
            tensor = [b for b in balance if quant_kwargs(self.modules[b])["strategy"] == "tensor"]
            if tensor:
                raise ValueError(f"{self.name}: duo_scaling needs per-channel or group weights, but {tensor[0]} is "
                                 "quantized per tensor; set duo_scaling: false or use a channel/group scheme")  # fmt: skip
            labels = [*self.mixed.pin, *self.mixed.labels] if self.mixed is not None else []
            for label, scheme in zip(labels, self.mixed.every_scheme().values() if self.mixed else []):
                if quant_kwargs(scheme)["strategy"] == "tensor":  # a width the allocation may give any module
                    raise ValueError(f"{self.name}: duo_scaling needs per-channel or group weights, but the "
                                     f"mixed_precision candidate {label!r} is per tensor; set duo_scaling: false or "
                                     "drop it")  # fmt: skip

    @property
    def needs_graph(self) -> bool:  # type: ignore[override]
        """Without explicit mappings, ``prepare`` derives them from the traced graph."""
        return self.mappings is None

    compresses_everywhere: ClassVar[bool] = True  # every process scores the candidates on its own shards

    def shares_statistics(self) -> bool:
        """The activation sums reduce (``awq:``), and the grid search's losses in a second round per mapping
        (``RunState.reduce_shards``); the span records stay where they were recorded."""
        return True

    def partial_statistics(self) -> dict[str, dict[str, Statistic]]:
        """This shard's ``sum |x|`` per channel and tokens of each mapping not folded yet (``awq:<smooth>``),
        and what ``QuantizationModifier`` gathers; the span records start the next shard."""
        out = super().partial_statistics()
        for smooth, stat in self._stats.items():
            if stat is not None and stat[0] is not None:
                out[f"awq:{smooth}"] = {
                    "sum": Statistic(stat[0]),
                    "tokens": Statistic(torch.tensor([stat[1]])),
                }
                self._stats[smooth] = [None, 0]
        for span in self._spans.values():
            span.end_shard()
        return out

    def load_statistics(self, reduced: dict[str, dict[str, torch.Tensor]]) -> None:
        super().load_statistics(reduced)
        for key, stats in reduced.items():
            if key.startswith("awq:"):
                self._stats[key[len("awq:") :]] = [stats["sum"], int(stats["tokens"].item())]

    def prepare(self, graph: Any, model: torch.nn.Module, state: RunState) -> None:
        if self.mappings is not None or graph is None:  # explicit, or untraceable: llm-compressor's defaults
            return
        called = {str(n.target) for n in graph.nodes if n.op == "call_module"}
        if any(
            name not in called for name in self.modules
        ):  # some run inside opaque code (experts): the same
            return
        found = [from_mapping(model, m) for m in resolve_mappings(model, graph, None, self.name)]
        self._mappings = [m for m in found if any(b in self.modules for b in m.balance)]
        self._skipped = []  # resolve_mappings logged each group it skipped, with the reason

    def initialize(self, model: torch.nn.Module, state: RunState) -> None:
        super().initialize(model, state)
        if not self._mappings:
            self.validate(model)
        if self._skipped:  # one line, as llm-compressor's warning
            state.results.log.append(f"AWQ: {len(self._skipped)} mapping(s) skipped as llm-compressor does, such as "
                             f"{self._skipped[0]}")  # fmt: skip
        self._stats: dict[str, list | None] = {}  # smooth -> [sum |x| per channel, tokens]; None once folded
        self._spans: dict[str, SpanCache] = {}  # parent -> its recorded calls, within max_chunk_memory

    @contextlib.contextmanager
    def calibrate(
        self, subgraph: Subgraph, model: torch.nn.Module, state: RunState, batches: BatchCursor
    ) -> Iterator[None]:
        handles, hooked = [], set()
        try:
            # entered once per virtual shard of the calibration set: statistics and span records carry over
            for m in self._mappings:
                inside = subgraph.holds(m.parent) and subgraph.holds(m.smooth)
                if self._stats.get(m.smooth, 0) is None or not inside:
                    continue  # folded already, or not (wholly) in this subgraph
                self._stats.setdefault(m.smooth, [None, 0])
                balance = model.get_submodule(m.balance[0])  # all balance layers read the same input
                handles.append(balance.register_forward_pre_hook(self._stat_hook(m.smooth, batches)))
                if m.parent not in hooked:  # mappings sharing a span record its calls once
                    hooked.add(m.parent)
                    shards = state.config.sharding.plan.shards if state.config.sharding is not None else 1
                    span = self._spans.setdefault(  # max_chunk_memory split over the virtual shards
                        m.parent, SpanCache(max(1, self.max_chunk_memory // shards), self.offload_device)
                    )
                    hook = span.hook(lambda: batches.current.token_mask)
                    handles.append(
                        model.get_submodule(m.parent).register_forward_pre_hook(hook, with_kwargs=True)
                    )
            with super().calibrate(subgraph, model, state, batches):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def _stat_hook(self, smooth: str, batches: BatchCursor) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            X = batches.current.real(args[0].detach())  # [tokens, in], padding dropped
            stat = self._stats[smooth]
            stat[0], stat[1] = add_channel_abs(stat[0], X), stat[1] + X.shape[0]

        return hook

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        if self.mixed is not None:  # each unit's width first, from the unsmoothed weights and their inputs
            names = [n for n in self.modules_in(subgraph) if n not in state.results.quantized]
            self.mixed.assign(
                names, model, self.modules, state, lambda n: (None, self._mean_square(n)), rounded
            )
        for m in [m for m in self._mappings if self._stats.get(m.smooth) is not None]:
            total, count = self._stats[m.smooth]
            self._stats[m.smooth] = None  # folded (or left at scale 1): never calibrated again
            if total is None or count == 0:
                state.results.log.append(f"AWQ: {m.smooth} saw no tokens; its mapping keeps scale 1")
                continue
            with search_autocast(state):
                result = search_mapping(self, m, model, total / count, state)
            state.fold(model, m.mapping(), result.scales)
            for name in m.balance:
                state.results.module_errors.setdefault(name, {}).update(
                    awq_loss=result.loss, awq_initial_loss=result.initial_loss, awq_ratio=result.ratio,
                    awq_batches=self._calls, awq_screened=self._screened)  # fmt: skip
        for parent in {
            m.parent for m in self._mappings if m.smooth in self._stats and not self._stats[m.smooth]
        }:
            self._spans.pop(parent, None)  # every mapping of this span is folded
        return super().compress(subgraph, model, state)

    def replayed(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> None:
        for m in self._mappings:  # folded by the interrupted run; the checkpoint put the folded weights back
            if subgraph.holds(m.parent) and subgraph.holds(m.smooth):
                self._stats[m.smooth] = None
        super().replayed(subgraph, model, state)

    def finalize(self, model: torch.nn.Module, state: RunState) -> None:
        missed = [m.smooth for m in self._mappings if m.smooth not in self._stats]
        if missed:  # a subgraph cut inside a mapping (its producer and its span apart): no scales for it
            state.results.log.append(
                f"AWQ: {len(missed)} mapping(s) never calibrated (scale 1), such as {missed[0]}"
            )
        super().finalize(model, state)
