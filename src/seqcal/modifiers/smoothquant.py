"""SmoothQuantModifier: per-channel smoothing folded into the producer of each group's input.

A transform (``Modifier.transforms``): for each mapping it gathers the per-channel range of the group's
input, computes ``s`` (``algorithms.smoothing.smoothing_scales``, llm-compressor's formula) and folds it
(``RunState.fold``) before any quantizer of the group observes it. Mappings come from the traced graph
(``seqcal.mappings``) unless the recipe gives them: the norms before q/k/v and gate/up (llm-compressor's
defaults) and the Linears whose rows feed the next group linearly (up_proj -> down_proj, v_proj -> o_proj
without grouped kv heads). In the one-pass cut such a producer is quantized before its consumers' inputs are
seen; the fold divides the scales of its rows and keeps its codes, which is exact for per-channel and group
weight scales (``RunState.refold_refusal`` names the formats where it is not; those mappings are skipped
with a log line).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import fx

from seqcal.algorithms.smoothing import (
    MINIMUM_SMOOTHING_SCALE,
    ChannelRange,
    smoothing_scales,
    update_channel_range,
)
from seqcal.mappings import Mapping, explicit_mappings, matches, resolve_mappings
from seqcal.mappings.names import checkpoint_names
from seqcal.modifiers.base import Batch, BatchCursor, Modifier, RunState, Statistic
from seqcal.tracing.partition import Subgraph

logger = logging.getLogger("seqcal")
ALGORITHMS = ("smoothquant", "log_equalization")


@dataclass
class SmoothQuantModifier(Modifier):
    """SmoothQuant (Xiao et al., 2022) with llm-compressor's arguments.

    Args:
        smoothing_strength: alpha in [0, 1]: how much of the activations' range moves into the weights.
        mappings: ``[[balance regexes], smooth regex]`` pairs (e.g. ``[[["re:.*q_proj", "re:.*k_proj",
            "re:.*v_proj"], "re:.*input_layernorm"]]``); None derives them from the traced graph.
        ignore: smooth layers to leave alone (a mapping is skipped when its producer and all its consumers
            are ignored, as in llm-compressor).
        num_calibration_steps: accepted for llm-compressor compatibility and ignored: the ranges are taken
            over every calibration batch (set ``num_calibration_samples`` to use fewer).
        calibration_function: llm-compressor's hook to run calibration with a custom function; a recipe cannot
            hold one (only null is accepted): seqcal runs the calibration data through the model itself.
        algorithm: "smoothquant" (the scales above) or "log_equalization" (``s = max|X| / log2(2 + max|X|)``,
            Logarithmic Equalization, Wang et al., 2023, as ``LogarithmicEqualizationModifier``).

    Example:
        >>> SmoothQuantModifier(smoothing_strength=0.8)
        SmoothQuantModifier(smoothing_strength=0.8, mappings=None, ignore=[], num_calibration_steps=None, \
calibration_function=None, algorithm='smoothquant')
    """

    name: ClassVar[str] = "SmoothQuantModifier"
    needs_calibration: ClassVar[bool] = True
    input_only: ClassVar[bool] = True  # the ranges need only the groups' inputs
    transforms: ClassVar[bool] = True
    smoothing_strength: float = 0.5
    mappings: list[Any] | None = None
    ignore: list[str] = field(default_factory=list)
    num_calibration_steps: int | None = None
    calibration_function: Any = None
    algorithm: str = "smoothquant"

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"{self.name}: algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}"
            )
        if self.calibration_function is not None:
            raise ValueError(f"{self.name}: calibration_function is not supported: seqcal runs the calibration data "
                             "through the model itself; remove it")  # fmt: skip
        if self.ignore is None:  # llm-compressor's default
            self.ignore = []
        alpha = self.smoothing_strength
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise ValueError(f"{self.name}: smoothing_strength must be a number in [0, 1], got {alpha!r}")
        if isinstance(self.ignore, str):
            self.ignore = [self.ignore]
        if self.mappings is not None and not isinstance(self.mappings, (list, tuple)):
            raise ValueError(
                f"{self.name}: mappings must be a list of [[balance regexes], smooth regex] pairs"
            )
        if self.num_calibration_steps is not None:
            logger.info("seqcal: %s: num_calibration_steps is ignored (ranges use every calibration batch)",
                        self.name)  # fmt: skip
        self.resolved: list[Mapping] = []
        self.warnings: list[str] = []  # ignore entries that match no module (``_kept``)
        self._prepared = False  # prepare() ran: the sequential pipeline orders transforms before quantizers
        self._ranges: dict[str, ChannelRange] = {}  # first consumer -> range of the group's input

    def validate(self, model: torch.nn.Module) -> None:
        if self.mappings:  # explicit mappings are checked before any weight is touched
            self.resolved = self._kept(model, explicit_mappings(model, self.mappings, self.name))

    def prepare(self, graph: fx.Graph | None, model: torch.nn.Module, state: RunState) -> None:
        self._prepared = True
        if self.mappings:
            self.resolved = self._kept(model, explicit_mappings(model, self.mappings, self.name))
        elif graph is None:
            raise ValueError(
                f"{self.name}: {type(model).__name__} could not be traced with its Linears as nodes, so no "
                "mapping can be derived; give mappings: [[[balance regexes], smooth regex], ...] in the recipe"
            )
        else:
            self.resolved = self._kept(model, resolve_mappings(model, graph, None, self.name))
        state.results.log.extend(w for w in self.warnings if w not in state.results.log)
        logger.info("seqcal: %s: %d mappings (%s)", self.name, len(self.resolved),
                    ", ".join(m.producer for m in self.resolved[:2]) + (", ..." if len(self.resolved) > 2 else ""))  # fmt: skip

    def _kept(self, model: torch.nn.Module, mappings: list[Mapping]) -> list[Mapping]:
        aliases, named = checkpoint_names(model), list(model.named_modules())
        self.warnings = [  # ignore entries that match nothing: said in the log and the run's report
            f"{self.name}: ignore entry {p!r} matches no module of {type(model).__name__}; it changes nothing here"
            for p in self.ignore
            if not any(matches(p, n, m, aliases.get(n)) for n, m in named)
        ]
        for line in self.warnings:
            logger.warning("seqcal: %s", line)

        def ignored(name: str) -> bool:
            return any(matches(p, name, model.get_submodule(name), aliases.get(name)) for p in self.ignore)

        return [m for m in mappings if not (ignored(m.producer) and all(ignored(c) for c in m.consumers))]

    def _in(self, subgraph: Subgraph) -> list[Mapping]:
        if subgraph.target_inputs:
            targets = set(subgraph.targets)
            return [m for m in self.resolved if set(m.consumers) <= targets]
        return [m for m in self.resolved if all(subgraph.holds(c) for c in m.consumers)]

    def modules_in(self, subgraph: Subgraph) -> list[str]:
        return [c for m in self._in(subgraph) for c in m.consumers]

    def upstream(self, subgraph: Subgraph) -> list[str]:
        return [m.producer for m in self._in(subgraph)]

    def observe(self, names: list[str], x: torch.Tensor, state: RunState, batch: Batch) -> None:
        for m in self.resolved:
            if m.consumers[0] in names and m.producer not in state.ledger.edited:
                X = batch.real(x.detach())  # [tokens, in]
                self._ranges[m.consumers[0]] = update_channel_range(self._ranges.get(m.consumers[0]), X)

    def partial_statistics(self) -> dict[str, dict[str, Statistic]]:
        """This shard's per-channel ranges, then forgotten: per mapping ``range:<first consumer>``, ``lo`` (a
        min) and ``hi`` (a max), exact in any order."""
        out = {
            f"range:{c}": {"lo": Statistic(lo, "min"), "hi": Statistic(hi, "max")}
            for c, (lo, hi) in self._ranges.items()
        }
        self._ranges = {}
        return out

    def load_statistics(self, reduced: dict[str, dict[str, torch.Tensor]]) -> None:
        for key, stats in reduced.items():
            if key.startswith("range:"):
                self._ranges[key[len("range:") :]] = (stats["lo"], stats["hi"])

    def shares_statistics(self) -> bool:
        """The ranges reduce across processes (min / max, ``partial_statistics``)."""
        return True

    @contextlib.contextmanager
    def calibrate(
        self, subgraph: Subgraph, model: torch.nn.Module, state: RunState, batches: BatchCursor
    ) -> Iterator[None]:
        if (
            not self._prepared
        ):  # pipeline="basic": one pass for all modifiers, the quantizers would not follow
            raise ValueError(
                f"{self.name} needs the sequential pipeline (it folds scales before the quantizers observe "
                "each group); remove pipeline='basic'"
            )
        handles = []
        try:
            for m in self._in(subgraph):
                hook = lambda mod, args, c=m.consumers[0]: self.observe([c], args[0], state, batches.current)  # noqa: E731
                handles.append(model.get_submodule(m.consumers[0]).register_forward_pre_hook(hook))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        changed = False
        for m in self._in(subgraph):
            channel_range = self._ranges.pop(m.consumers[0], None)
            if channel_range is None or m.producer in state.ledger.edited:
                continue
            if why := state.refold_refusal(model, m.producer):
                note = f"{self.name}: not smoothing {', '.join(m.consumers)}: {m.producer} is already quantized and {why}"
                if self.mappings:  # the recipe asked for this mapping: said at the end of the run too
                    state.results.log.append(note)
                logger.info("seqcal: %s", note)
                continue
            weights = [model.get_submodule(c).weight for c in m.consumers]
            if self.algorithm == "log_equalization":
                s = log_equalization_scales(channel_range)
            else:
                s = smoothing_scales(channel_range, weights, float(self.smoothing_strength))
            state.fold(model, m, s)
            state.results.module_errors.setdefault(m.producer, {})["smoothing_scale_max"] = s.max().item()
            changed = True
        return changed


def log_equalization_scales(channel_range: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Logarithmic Equalization's scales (Wang et al., 2023) as llm-compressor computes them: with ``r_j`` the
    dynamic range ``max X_j - min X_j`` of input channel ``j``, ``s_j = r_j / log2(2 + r_j)``.

    Args:
        channel_range: per-channel (min, max) of the group's input, each [in].

    Returns:
        [in] float32 scales, each >= ``MINIMUM_SMOOTHING_SCALE`` (a dead channel must not divide by zero).

    Example:
        >>> log_equalization_scales((torch.tensor([-4.0, 0.0]), torch.tensor([2.0, 0.0]))).tolist()
        [2.0, 1e-05]
    """
    lo, hi = channel_range
    r = (hi - lo).float()  # [in]
    return (r / torch.log2(2 + r)).clamp_min(MINIMUM_SMOOTHING_SCALE)


@dataclass
class LogarithmicEqualizationModifier(SmoothQuantModifier):
    """llm-compressor's LogarithmicEqualizationModifier: SmoothQuant with ``algorithm: log_equalization`` (its
    scales ``r / log2(2 + r)`` of each input channel's dynamic range ``r``; the weights play no part, so
    ``smoothing_strength`` is accepted and unused). Same arguments, mappings and folds as SmoothQuantModifier.

    Example:
        >>> LogarithmicEqualizationModifier().algorithm
        'log_equalization'
    """

    name: ClassVar[str] = "LogarithmicEqualizationModifier"
    algorithm: str = "log_equalization"
