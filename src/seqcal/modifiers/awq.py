"""AWQModifier: activation-aware scales searched per mapping, folded, then round-to-nearest quantization.

Math in ``seqcal.algorithms.awq``; mappings from the traced graph (``seqcal.mappings``) or the recipe
(``seqcal.modifiers._awq_mappings``, llm-compressor's format); the scales fold through ``RunState.fold``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from seqcal.algorithms.awq import (
    DUO_SCALING,
    add_channel_abs,
    add_gram,
    grid_points,
    linear_error,
    masked_mse,
    search_all_scales,
    shortlist,
    weight_mean,
)
from seqcal.mappings import resolve_mappings
from seqcal.modifiers._awq_mappings import AWQMapping, from_mapping, resolve
from seqcal.modifiers.activations import InputCalibration
from seqcal.modifiers.base import BatchCursor, RunState, Statistic
from seqcal.modifiers.quantization import QuantizationModifier
from seqcal.modifiers.round_to_nearest import fake_quantized, quant_kwargs
from seqcal.modifiers.spans import SpanCache
from seqcal.modifiers.state import real_tokens
from seqcal.tracing.partition import Subgraph

# A span that is one Linear is scored from the Gram matrix of its inputs once it saw more tokens than this many per
# input: a candidate then costs ``out * in^2`` instead of ``tokens * out * in`` (and the matrix one pass).
GRAM_TOKENS_PER_INPUT = 1.0


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

    name: ClassVar[str] = "AWQModifier"
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
        self.bare = self.scheme is None and self.config_groups is None
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
        for m in [m for m in self._mappings if self._stats.get(m.smooth) is not None]:
            total, count = self._stats[m.smooth]
            self._stats[m.smooth] = None  # folded (or left at scale 1): never calibrated again
            if total is None or count == 0:
                state.results.log.append(f"AWQ: {m.smooth} saw no tokens; its mapping keeps scale 1")
                continue
            with _autocast(state):
                result = self._search(m, model, total / count, state)
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

    def _search(self, m: AWQMapping, model: torch.nn.Module, x_mean: torch.Tensor, state: RunState) -> Any:
        parent, span = model.get_submodule(m.parent), self._spans[m.parent]
        quantized = {n: model.get_submodule(n).weight for n in m.balance if n in self.modules}
        originals = {n: w.data.clone() for n, w in quantized.items()}
        local = (
            len(state.config.sharding.plan.shards_of(state.config.sharding.group.rank))
            if state.config.sharding is not None
            else 1
        )
        gram = self._gram(m, parent, quantized, span, local, state)  # X^T X of every shard, or None
        references = (
            [] if gram is not None else span.outputs(parent, state.config.device)
        )  # the float span's output
        self._screened = 0

        def place(s: torch.Tensor) -> None:
            """Q(W s) / s in place of each quantized balance weight."""
            for n, w in quantized.items():
                view = s.to(w.device, torch.float32).view(1, -1)
                w.data = (fake_quantized(originals[n].float() * view, self.modules[n]) / view).to(w.dtype)

        def run(c: int, calls: list[int]) -> None:
            """Candidate ``c`` (placed) on the recorded ``calls``: squared errors into ``per_call[call, c]``."""
            for i in calls:
                output = span.run(parent, state.config.device, i)
                per_call[i, c], elements[i] = masked_mse(references[i], output, span.calls[i][2])

        def reduced(calls: list[int], kept: list[int]) -> tuple[list[float], bool]:
            """The mean squared error of the ``kept`` candidates over ``calls`` of every process's shards (per
            local shard summed in call order, folded in shard order: ``RunState.reduce_shards``), inf for the
            other candidates; and whether ``calls`` were every recorded call of every process."""
            errors = torch.zeros(local, len(kept), dtype=torch.float64)
            counts = torch.zeros(local, dtype=torch.int64)
            used = torch.zeros(local, dtype=torch.int64)
            for i in calls:
                errors[span.shards[i]] += per_call[i, kept]
                counts[span.shards[i]] += elements[i]
                used[span.shards[i]] += 1
            per_shard = [{"awq_loss": {"errors": Statistic(errors[k]), "elements": Statistic(counts[k : k + 1]),
                                       "calls": Statistic(torch.tensor([span.shards.count(k)])),
                                       "used": Statistic(used[k : k + 1])}}
                         for k in range(local)]  # fmt: skip
            total = state.reduce_shards(per_shard)["awq_loss"]
            self._calls = int(total["calls"].item())
            values = [float("inf")] * per_call.shape[1]
            for c, value in zip(kept, (total["errors"] / max(int(total["elements"].item()), 1)).tolist()):
                values[c] = value
            return values, int(total["used"].item()) == self._calls

        points = len(grid_points(self.n_grid, self.duo_scaling))
        # [call, candidate]: each squared error on each recorded call, NaN where not run
        per_call = torch.full((len(span.calls), points), float("nan"), dtype=torch.float64)
        elements = [0] * len(span.calls)

        def losses(candidates: list[torch.Tensor]) -> list[float]:
            """Every candidate's output MSE over every process's shards; screened out: inf."""
            if gram is not None:  # every process holds the same reduced Gram matrix: no reduction
                values = []
                for s in candidates:
                    place(s)
                    error = linear_error(originals[m.parent].float() - quantized[m.parent].float(), gram)
                    values.append(error / max(self._tokens * parent.out_features, 1))
                return values
            every, kept = list(range(len(span.calls))), list(range(len(candidates)))
            rest = every
            # decided from the arguments alone, so that every process takes the same rounds of reduction
            if self.screen_keep is not None and self.screen_keep + 1 < len(kept):
                screen = screened_calls(span.shards, self.screen_every)
                for c, s in enumerate(candidates):  # the whole grid on the screening calls
                    place(s)
                    run(c, screen)
                values, covered = reduced(screen, kept)
                screened = set(screen)
                rest = [i for i in every if i not in screened]
                if not covered:  # (every call of every process screened: the whole grid is scored already)
                    kept = shortlist(values, self.screen_keep)
                    self._screened = len(candidates) - len(kept)
            for c in kept:
                place(candidates[c])
                run(c, rest)
            return reduced(every, kept)[0]

        scheme = self.modules[next(iter(quantized))]
        group = (
            scheme.weights.group_size
            if quant_kwargs(scheme)["strategy"] in ("group", "tensor_group")
            else None
        )
        weights = [model.get_submodule(n).weight for n in m.balance]
        w_mean = weight_mean(weights, group) if self.duo_scaling is not False else None
        try:
            return search_all_scales(
                losses, x_mean.to(state.config.device), w_mean, self.n_grid, self.duo_scaling
            )
        finally:
            for n, w in quantized.items():
                w.data = originals[n]

    def _gram(self, m: AWQMapping, parent: torch.nn.Module, quantized: dict[str, torch.Tensor], span: SpanCache,
              local: int, state: RunState) -> torch.Tensor | None:  # fmt: skip
        """For a span that is the one balance Linear (o_proj, down_proj): ``X^T X`` of its recorded inputs over
        every shard of every process (folded in shard order), from which ``linear_error`` gives each candidate's
        loss without running the span; None when the span is anything else, or when running it costs less (its
        tokens fewer than its inputs: the Gram matrix costs ``out * in^2`` per candidate, a run ``tokens * out *
        in``)."""
        if not (list(quantized) == [m.parent] == list(m.balance) and state.config.compute_dtype is None):
            return None
        width = parent.in_features
        per_shard = [{"awq_gram": {"gram": Statistic(torch.zeros(width, width, device=state.config.device)),
                                   "tokens": Statistic(torch.zeros(1, dtype=torch.int64)),
                                   "calls": Statistic(torch.tensor([span.shards.count(k)]))}}
                     for k in range(local)]  # fmt: skip
        for (args, _, mask), shard in zip(span.calls, span.shards):
            X = real_tokens(
                args[0].to(state.config.device), None if mask is None else mask.to(state.config.device)
            )
            stats = per_shard[shard]["awq_gram"]
            add_gram(stats["gram"].tensor, X)
            stats["tokens"].tensor += X.shape[0]
        total = state.reduce_shards(per_shard)["awq_gram"]
        self._tokens, self._calls = int(total["tokens"].item()), int(total["calls"].item())
        return total["gram"] if self._tokens > GRAM_TOKENS_PER_INPUT * width else None


def screened_calls(shards: list[int], every: int) -> list[int]:
    """The recorded calls that score the whole grid: every ``every``-th call of each virtual shard (its first
    included), so the choice is the same whichever processes hold the shards.

    Example:
        >>> screened_calls([0, 0, 0, 0, 0, 1, 1], 2)
        [0, 2, 4, 5]
    """
    seen: dict[int, int] = {}
    picked = []
    for i, shard in enumerate(shards):
        if seen.get(shard, 0) % every == 0:
            picked.append(i)
        seen[shard] = seen.get(shard, 0) + 1
    return picked


def _autocast(state: RunState) -> contextlib.AbstractContextManager:
    """The forward passes' autocast (``compute_dtype``), so the search sees the spans as calibration ran them."""
    dtype = state.config.compute_dtype
    return torch.autocast(state.config.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
