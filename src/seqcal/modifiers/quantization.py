"""QuantizationModifier: round-to-nearest weight quantization, llm-compressor's arguments.

Data-free, unless static input activations or the imatrix_mse weight observer need calibration inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from compressed_tensors.quantization import QuantizationScheme

from seqcal.modifiers.activations import InputCalibration, calibrated_inputs
from seqcal.modifiers.base import Batch, BatchCursor, Modifier, RunState, Statistic
from seqcal.modifiers.formats import (
    check_bits,
    check_widths,
    fused_groups,
    shared_global_scales,
)
from seqcal.modifiers.importance import IMPORTANCE_GATHERS, mean_square, usable_importance, uses_importance
from seqcal.modifiers.kv_cache import KVCacheCalibration, kv_cache_args
from seqcal.modifiers.mixed_allocator import MixedPrecision
from seqcal.modifiers.needs import Needs
from seqcal.modifiers.observers import apply_observer_overrides
from seqcal.modifiers.round_to_nearest import quant_kwargs as quant_kwargs  # re-exported: moved beside RTN
from seqcal.modifiers.round_to_nearest import rounded, rtn_quantize_module
from seqcal.modifiers.round_to_nearest import rtn_quantize_weight as rtn_quantize_weight
from seqcal.modifiers.schemes import check_supported, resolve_modules, resolve_schemes, strategy_of
from seqcal.tracing.partition import Subgraph


@dataclass
class QuantizationModifier(Modifier):
    """Quantize the weights of matching Linear layers with round-to-nearest.

    Args:
        targets: module class names or ``re:`` patterns the ``scheme`` applies to (default all Linear).
        scheme: a compressed-tensors preset ("W4A16", "W8A8", "FP8_DYNAMIC", "FP8", ...) or {preset: targets};
            static input activations (FP8, or config_groups with ``dynamic: false``) and NVFP4's input global
            scale are calibrated on data.
        config_groups: explicit compressed-tensors config groups (instead of ``scheme``).
        ignore: modules left in full precision (class names or ``re:`` patterns), e.g. ["lm_head"].
        kv_cache_scheme: fp8 KV cache with static scales (QuantizationArgs fields: num_bits 8, type float,
            strategy tensor or attn_head): k_scale / v_scale of each attention module are calibrated on the keys
            and values it caches (``seqcal.modifiers.kv_cache``); the run then cuts after each layer.
        weight_observer, input_observer, output_observer: observer names that override the scheme's
            (llm-compressor's arguments), e.g. weight_observer="imatrix_mse".
        observer: the same as a mapping {weights: ..., input: ..., output: ...} (not together with the above).
        bypass_divisibility_checks: llm-compressor's switch to skip its early check that group sizes divide the
            inputs. seqcal's quantizers and checkpoints need whole groups, so it changes nothing where they divide
            and cannot make ragged groups possible: such modules are still refused, the message says why.

    Weight observers are llm-compressor's: minmax (default), mse, imatrix_mse (MSE weighted by the inputs'
    E[x^2], which makes this modifier calibrate on data). See seqcal.algorithms.observe.

    Example:
        >>> QuantizationModifier(scheme="W4A16", ignore=["lm_head"])  # doctest: +SKIP
    """

    own_modules_only: ClassVar[bool] = True  # changes only the weights it quantizes

    name: ClassVar[str] = "QuantizationModifier"
    # needs no data at all, or (static input activations) only its modules' inputs
    input_only: ClassVar[bool] = True
    # imatrix_mse weights: E[x^2] of the inputs gathered by the framework (False: the subclass has it, GPTQ's H)
    importance_from_inputs: ClassVar[bool] = True
    # with mixed precision and no observer given, every candidate's weight observer: an algorithm that rounds with
    # its own ranges (AWQ's search, AutoRound's learned ones start from min-max) measures the curves with them too
    mixed_observer: ClassVar[str | None] = None
    targets: str | list[str] = "Linear"
    scheme: str | dict[str, Any] | None = None
    config_groups: dict[str, Any] | None = None
    ignore: list[str] = field(default_factory=list)
    kv_cache_scheme: dict[str, Any] | None = None
    weight_observer: str | None = None
    input_observer: str | None = None
    output_observer: str | None = None
    observer: dict[str, str] | None = None
    bypass_divisibility_checks: bool = False
    mixed_precision: dict[str, Any] | None = None  # seqcal: each module's scheme chosen under a budget

    def __post_init__(self) -> None:
        if isinstance(self.ignore, str):
            self.ignore = [self.ignore]
        if not isinstance(self.bypass_divisibility_checks, bool):
            raise ValueError(f"{self.name}: bypass_divisibility_checks must be true or false, "
                             f"got {self.bypass_divisibility_checks!r}")  # fmt: skip
        self.kv: KVCacheCalibration | None = None
        if self.kv_cache_scheme is not None:
            self.kv = KVCacheCalibration(kv_cache_args(self.kv_cache_scheme, self.name), self.name)
            # keys and values are observed where the attention updates its cache: data is needed even for a
            # data-free weight scheme. The one-pass cut reaches them through a stand-in cache (``kv_tap``,
            # ``kv_update_sites``); where it cannot, the pipeline cuts after each layer.
            self.needs_calibration = True
        self.mixed = MixedPrecision.of(self.mixed_arguments(), self.targets, self.name)
        if (
            self.mixed is not None
            and self.mixed_observer
            and self.weight_observer is None
            and self.observer is None
        ):
            self.weight_observer = self.mixed_observer
        if self.mixed is None:
            self.groups = resolve_schemes(self.scheme, self.config_groups, self.targets, self.name)
        else:
            self._mix()
        for name, group in self.groups.items():  # here, not at calibration: a recipe's error names its line
            check_bits(group, f"{self.name} group {name!r}")
        self._override_observers()
        self.modules: dict[str, QuantizationScheme] = {}
        # modules vLLM merges into one weight (shared NVFP4 global scale); module -> NVFP4 global scale
        self._fused: list[tuple[str, ...]] = []
        self._global_scales: dict[str, torch.Tensor] = {}
        self.inputs = InputCalibration({})
        if self.importance_from_inputs and any(self.gathers_importance(g) for g in self.groups.values()):
            # imatrix_mse's E[x^2]: the framework gathers it, beside what a subclass declares
            self.gathers = (*type(self).gathers, *IMPORTANCE_GATHERS)
        if any(calibrated_inputs(g) or uses_importance(g) for g in self.groups.values()):
            self.needs_calibration = (
                True  # static input scales and imatrix_mse weights are calibrated on data
            )

    def gathers_importance(self, group: QuantizationScheme) -> bool:
        """Whether modules of ``group`` need their inputs' E[x^2] (``imatrix_mse``); a subclass may add schemes
        whose rounding uses it (AutoRound's GGUF scales)."""
        return uses_importance(group)

    def mixed_arguments(self) -> dict[str, Any] | None:
        """The mixed-precision arguments (``seqcal.modifiers.mixed_precision``), or None: one scheme per group."""
        return self.mixed_precision

    def _mix(self) -> None:
        """Schemes chosen per module in the pass: groups from the candidates and pins; round to nearest measures
        with E[x^2]. Each choice depends on the curves measured before it, which travel with the modules' report
        entries to the other processes and into the resume files (``MixedPrecision.catch_up``)."""
        if self.name not in (
            "QuantizationModifier",
            "GPTQModifier",
            "MixedPrecisionModifier",
            "AutoRoundModifier",
            "AWQModifier",
        ):
            raise ValueError(f"{self.name}: mixed_precision is not supported here; use it with GPTQModifier, "
                             "AWQModifier, AutoRoundModifier or QuantizationModifier, or MixedPrecisionModifier")  # fmt: skip
        if self.scheme is not None or self.config_groups is not None:
            raise ValueError(f"{self.name}: mixed_precision chooses each module's scheme from its candidates; give "
                             "no scheme or config_groups beside it (its pin fixes the scheme of some modules)")  # fmt: skip
        self.groups = self.mixed.groups()  # type: ignore[union-attr]
        self.needs_calibration = True
        if self.importance_from_inputs:
            self.gathers = (*type(self).gathers, *IMPORTANCE_GATHERS)

    def _override_observers(self) -> None:
        """Apply weight_observer / input_observer / output_observer / observer to the groups, then check them."""
        given = (self.weight_observer, self.input_observer, self.output_observer, self.observer)
        if all(v is None for v in given):
            return
        # with mixed precision, every candidate and pin, not only the groups that resolve the modules
        groups = {**self.groups, **self.mixed.every_scheme()} if self.mixed is not None else self.groups
        apply_observer_overrides(groups, self.name, *given)
        for name, group in groups.items():
            check_supported(group, f"{self.name} group {name!r}")

    def validate(self, model: torch.nn.Module) -> None:
        self.warnings: list[str] = []  # ignore entries that match nothing, for the run's report
        if self.mixed is not None:
            self.mixed.check_pins(model)
        self.modules = resolve_modules(model, self.groups, self.ignore, self.name, self.warnings)
        self.inputs = InputCalibration(self.modules)
        if not self.modules:
            raise ValueError(
                f"{self.name}: no Linear layer matches targets {self.targets!r} (ignore={self.ignore!r}); "
                "targets are class names such as 'Linear' or 're:' patterns on module names"
            )
        # Before any calibration: a width the format cannot hold would stop the run later, at that module's
        # solve, after every subgraph before it was calibrated.
        try:
            if self.mixed is None:  # else each candidate is checked per module by the allocation
                check_widths(model, self.modules, self.name)
        except ValueError as exc:
            if not self.bypass_divisibility_checks:
                raise
            raise ValueError(f"{exc} (bypass_divisibility_checks skips only llm-compressor's early check: seqcal "
                             "quantizes whole groups, it has no ragged last group)") from None  # fmt: skip
        self._fused = fused_groups(model, self.modules)
        if self.mixed is not None:
            self.mixed.validate(model, self.modules)
        if self.kv is not None:
            self.kv.validate(model)

    def initialize(self, model: torch.nn.Module, state: RunState) -> None:
        if not self.modules:
            self.validate(model)
        state.results.log.extend(w for w in getattr(self, "warnings", []) if w not in state.results.log)
        if self.kv is not None:  # the scheme itself reaches the checkpoint through the run's configuration
            self.kv.initialize(model)

    def quantizes(self) -> dict[str, QuantizationScheme]:
        return self.modules

    def scheme_groups(self) -> dict[str, QuantizationScheme]:
        return self.groups

    def kv_calibration(self) -> KVCacheCalibration | None:
        return self.kv

    def modules_in(self, subgraph: Subgraph) -> list[str]:
        """The modules of this modifier whose weights ``subgraph`` uses (for a subgraph cut before its
        targets: the targets only; an opaque statement touching a parent module does not pull its children in).
        """
        if subgraph.target_inputs:
            return [n for n in self.modules if n in set(subgraph.targets)]
        return [n for n in self.modules if subgraph.holds(n)]

    @contextlib.contextmanager
    def calibrate(
        self, subgraph: Subgraph, model: torch.nn.Module, state: RunState, batches: BatchCursor
    ) -> Iterator[None]:
        names = [n for n in self.modules_in(subgraph) if n not in state.results.quantized]
        # static input scales, imatrix_mse's importance, KV-cache scales; nothing else needs data
        with self.inputs.hooks(names, model, state, batches), self.kv_hooks(subgraph, model, state, batches):
            yield

    def shares_statistics(self) -> bool:
        """Static input ranges, imatrix_mse's sums of ``x^2`` (mixed precision's E[x^2]) and the KV cache's ranges
        reduce across processes."""
        return True

    def needs(self) -> Needs:
        """With mixed precision, a subgraph's modules are solved by one process, in module order: each unit's
        choice depends on the units chosen before it."""
        return replace(super().needs(), one_solver=self.mixed is not None)

    def kv_hooks(
        self, subgraph: Subgraph, model: torch.nn.Module, state: RunState, batches: BatchCursor
    ) -> contextlib.AbstractContextManager:
        """Observe the keys and values of the subgraph's attention modules (kv_cache_scheme), else nothing."""
        # the one-pass cut observes through its stand-in cache instead
        if self.kv is None or state.config.kv_in_graph:
            return contextlib.nullcontext()
        return self.kv.hooks(subgraph.modules, model, batches)

    def kv_finish(
        self, subgraph: Subgraph, model: torch.nn.Module, state: RunState, updates: bool = False
    ) -> bool:
        """Store k_scale / v_scale of the subgraph's attention modules (kv_cache_scheme); True when some were:
        their fp8 keys and values change the subgraph's outputs, which the propagation pass recomputes.

        Args:
            updates: the attention modules whose cache update a one-pass subgraph runs (``kv_updates``, after
                their own observation pass) instead of those inside the subgraph's modules (the layer cut).
        """
        if self.kv is None or state.config.kv_in_graph != updates:  # one-pass: after its own pass
            return False
        inside = [n for n in subgraph.kv_updates if n in self.kv.modules and n not in self.kv.finished] if \
            updates else self.kv.modules_in(subgraph.modules)  # fmt: skip
        # those this process compresses (a subgraph split over processes: its owner's)
        names = [n for n in inside if subgraph.holds(n)]
        state.ledger.changed.update(names)  # their buffers: put back on a replay
        return self.kv.finish(names, model)

    def replayed(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> None:
        if self.kv is not None:  # their k_scale / v_scale are back: keys and values are fp8 from here on
            self.kv.finished.update(n for n in self.kv.modules if subgraph.holds(n))

    def observe(self, names: list[str], x: torch.Tensor, state: RunState, batch: Batch) -> None:
        self.inputs.observe([n for n in names if n in self.modules], x, state, batch)

    def partial_statistics(self) -> dict[str, dict[str, Statistic]]:
        """Static input ranges (``input:``) and key / value ranges (``kv:``); imatrix_mse's sums are declared."""
        kv = self.kv.partial_statistics() if self.kv is not None else {}
        return {**self.inputs.partial_statistics(), **kv}

    def load_statistics(self, reduced: dict[str, dict[str, torch.Tensor]]) -> None:
        self.inputs.load_statistics(reduced)
        if self.kv is not None:
            self.kv.load_statistics(reduced)

    def results(self, subgraph: Subgraph, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The KV cache's scales calibrated in ``subgraph`` (kv_cache_scheme), else none."""
        if self.kv is None:
            return {}
        return self.kv.scales_of([*subgraph.modules, *subgraph.kv_updates], model)

    def load_results(
        self, subgraph: Subgraph, results: dict[str, torch.Tensor], model: torch.nn.Module
    ) -> None:
        if self.kv is not None:
            self.kv.load_scales(results, model)

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        names = [n for n in self.modules_in(subgraph) if n not in state.results.quantized]
        if self.mixed is not None:  # each unit's scheme from its errors under every candidate (E[x^2])
            self.mixed.assign(
                names, model, self.modules, state, lambda n: (None, self._mean_square(n)), rounded
            )
        self.prepare_global_scales(model, names)
        for name in names:
            module, scheme = model.get_submodule(name), self.modules[name]
            seen = mean_square(self._gathered_or_none(name)) if uses_importance(scheme) else None
            importance = usable_importance(name, scheme, seen, module.weight.shape[-1], state)
            before = module.weight.data.clone() if self.mixed is not None else None
            state.results.quantized[name] = rtn_quantize_module(
                module, scheme, self._global_scales.get(name), importance=importance
            )
            if self.mixed is not None:  # the error the allocation predicted, measured
                self.mixed.measured(name, before, module.weight.data, self._mean_square(name), state)
        self.inputs.finish(names, model, state)
        return self.kv_finish(subgraph, model, state) or bool(names)

    def _mean_square(self, name: str) -> torch.Tensor | None:
        return mean_square(self._gathered_or_none(name))

    def finalize(self, model: torch.nn.Module, state: RunState) -> None:
        if self.mixed is not None:  # the allocation reached, and a recipe that replays it
            solver = "GPTQModifier" if self.name == "MixedPrecisionModifier" else self.name
            mixed = {"mixed_precision", "average_bits", "max_size", "candidates", "pin", "error", "targets"}
            arguments = {k: v for k, v in self.to_dict().items() if k not in mixed}
            self.mixed.finish(solver, arguments, self.modules, model, state)

    def _gathered_or_none(self, name: str) -> dict[str, torch.Tensor] | None:
        """The declared statistics of ``name`` (imatrix_mse's sums among them), or None: none declared or seen."""
        if not self.gathers:
            return None
        try:
            return self.gathered(name)
        except KeyError:
            return None

    def prepare_global_scales(self, model: torch.nn.Module, names: list[str]) -> None:
        """NVFP4: fix the global scale of ``names`` (shared across each fused group) before any is quantized."""
        nvfp4 = [n for n in names if strategy_of(self.modules[n].weights) == "tensor_group"]
        shared_global_scales(model, nvfp4, self._fused, self._global_scales)
