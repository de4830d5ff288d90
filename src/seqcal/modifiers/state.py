"""The run state the executor hands to modifiers, in named parts, and the batch that travels with each pass.

    RunState      what one run shares with its modifiers: ``config`` (frozen), ``results``, ``ledger``
    RunConfig     set once by the pipeline: device, autocast dtype, device budget, shards, KV-cache scheme
    RunResults    what the checkpoint and the report read: quantized weights, sparsity, errors, log
    FoldLedger    the scales folded so far and what they changed (resume and the checkpoint read it)
    Batch         one calibration batch as a modifier sees it besides its activations (its token mask)
    BatchCursor   the batch a forward pass is running, for hooks (which get only the module's arguments)

Nothing here is set per batch: ``observe`` gets the ``Batch`` as an argument, and hooks registered in
``calibrate`` read the ``BatchCursor`` they are handed, which only the pass running the batches moves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import torch

from seqcal.algorithms import dequantize
from seqcal.mappings import Mapping, fold_scales
from seqcal.modifiers.formats import strategy_of, weight_format
from seqcal.records import Fold, QuantizedWeight, Statistic, fold, tensors_of

T = TypeVar("T")


class Shards(Protocol):
    """What a modifier may ask of the run's virtual shards (``seqcal.distributed.ShardedRun``)."""

    def reduce_round(
        self, per_shard: list[dict[str, dict[str, Statistic]]], device: torch.device
    ) -> dict[str, dict[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class RunConfig:
    """How the run executes; set once by the pipeline (the calibration loop's copy adds its shards and cut).

    Attributes:
        device: the execution device.
        compute_dtype: autocast dtype of the forward passes (None: the weights' dtype).
        device_budget: bytes of device memory the run may use (``max_device_memory``), or None: modifiers size
            their working memory from it (GPTQ's stacked solves, ``modifiers.solve_chunks``).
        sharding: the virtual shards of the batches and the processes they run on, or None (one process, all
            batches accumulated at once).
        kv_cache_scheme: the recipe's ``kv_cache_scheme`` (compressed-tensors QuantizationArgs) when the KV
            cache is quantized (written to ``quantization_config``; the scales are the attention modules'
            ``k_scale`` / ``v_scale`` buffers), else None.
        kv_in_graph: the keys and values reach the traced graph through the one-pass cut's stand-in cache
            (``kv_hooks.kv_tap``), which observes them; False: attention modules are handed an observing
            cache by a hook in the layer cut.
        in_place_factor: GPTQ's CPU solves factor each Hessian in its own memory (``gptq_quantize``'s
            ``in_place_factor``), as the host budget needs (``plan.host.fit_host``).
    """

    device: torch.device = torch.device("cpu")
    compute_dtype: torch.dtype | None = None
    device_budget: int | None = None
    sharding: Shards | None = None
    kv_cache_scheme: Any = None
    kv_in_graph: bool = False
    in_place_factor: bool = False


@dataclass
class RunResults:
    """What the run produced, read by the checkpoint writer and the report.

    Attributes:
        quantized: module name -> its compressed weight (the checkpoint packs exactly these).
        sparsity: pruned module -> its mask structure ("2:4", "0:0"): a later quantizer keeps its zeros.
        module_errors: module name -> metrics (rel_error, loss, ...).
        log: human-readable events (fallbacks, warnings), repeated at the end of the run.
        report: per-subgraph and per-module numbers, saved as quantization_report.json.
        transform_config: online rotations (QuIP, SpinQuant R4) as compressed-tensors' ``transform_config``
            block, written to config.json's quantization_config; transform_tensors: their matrices,
            checkpoint key -> tensor.
        files: further text files of the output directory, name -> content (a mixed-precision allocation's
            replay recipe).
    """

    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    sparsity: dict[str, str] = field(default_factory=dict)
    module_errors: dict[str, dict[str, float]] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    transform_config: dict[str, Any] = field(default_factory=dict)
    transform_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)


@dataclass
class FoldLedger:
    """The scales folded so far and the modules they, and in-place edits, changed (``RunState.fold`` writes it).

    Attributes:
        folds: every fold, in order.
        divided: subgraph index -> the folds whose scales divided its cached inputs (the cut before the
            modules); its checkpoint file records them so a resumed run divides them again.
        edited: producers whose weights a fold changed (written after the consumers' subgraph, kept).
        changed: every other module whose parameters or buffers a modifier changed in place, outside the
            quantized weights (consumers of a fold, calibrated buffers): put back on a replay.
    """

    folds: list[Fold] = field(default_factory=list)
    divided: dict[int, list[Fold]] = field(default_factory=dict)
    edited: set[str] = field(default_factory=set)
    changed: set[str] = field(default_factory=set)

    def record(self, mapping: Mapping, scales: torch.Tensor) -> Fold:
        """Note a fold of ``scales`` into ``mapping``: the producer edited, the consumers' columns changed."""
        record = Fold(mapping, scales.detach().float())
        self.folds.append(record)
        self.edited.add(mapping.producer)
        self.changed.update(mapping.consumers)
        return record

    def since(self, start: int) -> list[Fold]:
        """The folds recorded after the first ``start`` (``len(folds)`` taken before a step)."""
        return self.folds[start:]

    def divide(self, index: int, record: Fold) -> None:
        """Note that ``record``'s scales divided the cached inputs of subgraph ``index``."""
        self.divided.setdefault(index, []).append(record)


@dataclass(frozen=True)
class Batch:
    """One calibration batch as a modifier sees it besides its activations.

    Attributes:
        token_mask: ``[batch, seq]`` bool, False at padding positions; None when nothing is padded.
    """

    token_mask: torch.Tensor | None = None

    def real(self, x: torch.Tensor) -> torch.Tensor:
        """``x [batch, seq, in]`` as ``[tokens, in]`` without the padding tokens (``real_tokens``)."""
        return real_tokens(x, self.token_mask)


def real_tokens(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``x [..., in]`` as ``[tokens, in]`` without the padding tokens (they carry no signal); ``mask`` is the
    batch's token mask ``[batch, seq]`` (or None). Observers and GPTQ's Hessians read their inputs through it."""
    if mask is not None and bool(mask.all()):
        mask = None  # nothing to drop: skip the copy a boolean index makes
    if mask is not None and x.dim() == 3 and tuple(mask.shape) == tuple(x.shape[:2]):
        x = x[mask.to(x.device, torch.bool)]
    elif mask is not None and x.dim() == 2 and x.shape[0] == mask.numel():
        x = x[mask.reshape(-1).to(x.device, torch.bool)]  # flattened tokens (MoE experts fed every token)
    return x.reshape(-1, x.shape[-1])


class BatchCursor:
    """The batch a forward pass is running, for the hooks of that pass (a hook gets only the module's arguments).

    One per run; the pass that runs the batches moves it (``at``), hooks only read ``current``.

    Example:
        >>> cursor = BatchCursor()
        >>> with cursor.at(Batch(torch.tensor([[False, True]]))):
        ...     cursor.current.token_mask.sum().item()
        1
        >>> cursor.current.token_mask is None
        True
        >>> [cursor.current.token_mask for _ in cursor.over([1], lambda b: Batch(torch.tensor([b])))]
        [tensor([1])]
    """

    def __init__(self) -> None:
        self._current = Batch()

    @property
    def current(self) -> Batch:
        return self._current

    @contextlib.contextmanager
    def at(self, batch: Batch) -> Iterator[Batch]:
        """The block runs ``batch``; afterwards (also on error) no batch is running."""
        self._current = batch
        try:
            yield batch
        finally:
            self._current = Batch()

    def over(self, items: Iterable[T], batch_of: Callable[[T], Batch]) -> Iterator[T]:
        """``items``, each while its batch (``batch_of(item)``) is the current one: a pass's loop over batches."""
        try:
            for item in items:
                self._current = batch_of(item)
                yield item
        finally:
            self._current = Batch()


@dataclass
class RunState:
    """What one run shares with its modifiers: its configuration, its results and its fold ledger."""

    config: RunConfig = field(default_factory=RunConfig)
    results: RunResults = field(default_factory=RunResults)
    ledger: FoldLedger = field(default_factory=FoldLedger)

    def with_config(self, **changes: Any) -> RunState:
        """The same results and ledger under a configuration with ``changes`` (the calibration loop's shards)."""
        return replace(self, config=replace(self.config, **changes))

    def changed_modules(self) -> set[str]:
        """Every module whose weights a modifier changed: quantized, folded into (producer or consumer), pruned,
        or marked in ``ledger.changed``. A resumed run puts them all back when it replays a finished subgraph,
        and offloaded weights are copied back to the host for them."""
        return {*self.results.quantized, *self.ledger.edited, *self.results.sparsity, *self.ledger.changed}

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
        if self.config.sharding is not None:
            return self.config.sharding.reduce_round(per_shard, self.config.device)
        total = None
        for partial in per_shard:
            total = fold(total, partial)
        return tensors_of(total or {})

    def fold(self, model: torch.nn.Module, mapping: Mapping, scales: torch.Tensor) -> Fold:
        """Fold smoothing ``scales`` into ``mapping`` (``seqcal.mappings.fold_scales``) and record it in the
        ledger, so the pipeline moves the group's cached inputs and other modifiers' statistics to the new
        coordinates.

        A producer quantized already (a Linear of an earlier group in the one-pass cut: up_proj before
        down_proj's inputs are seen) takes the fold when its codes stay valid (``refold_refusal``): the scales of
        its rows are divided, the codes kept, and its weight is their dequantized value.

        Raises:
            RuntimeError: a consumer is already quantized, or the producer is and cannot take the fold.
        """
        quantized = self.results.quantized
        where = f"cannot fold scales into {mapping.producer} -> {', '.join(mapping.consumers)}"
        done = [n for n in mapping.consumers if n in quantized]
        if done:
            raise RuntimeError(
                f"{where}: {done[0]} is already quantized; transforms must run before the quantizers of the group"
            )
        if why := self.refold_refusal(model, mapping.producer):
            raise RuntimeError(f"{where}: {mapping.producer} is already quantized and {why}")
        fold_scales(model, mapping, scales)
        if mapping.producer in quantized:
            quantized[mapping.producer] = _rows_divided(
                model, mapping.producer, quantized[mapping.producer], scales
            )
        return self.ledger.record(mapping, scales)

    def refold_refusal(self, model: torch.nn.Module, producer: str) -> str | None:
        """Why smoothing scales cannot be folded into ``producer``'s rows now that it is quantized (None: they
        can, or it is not quantized). Dividing row ``i`` by ``s_i`` keeps every code when each weight scale
        belongs to one row (strategies channel and group, float scales): the row's scales are divided. One scale
        across rows (tensor, blocks), fp8 or e8m0 scales (NVFP4, MX) would need new codes, and keys or values
        whose KV-cache scales were calibrated already would no longer match them."""
        qw = self.results.quantized.get(producer)
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
        for parent in parents if self.config.kv_cache_scheme is not None else ():
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
