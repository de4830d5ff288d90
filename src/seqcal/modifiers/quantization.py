"""QuantizationModifier: round-to-nearest weight quantization (data-free), llm-compressor's arguments."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from compressed_tensors.quantization import QuantizationScheme

from seqcal.algorithms import fake_quantize, formats, quantize, weight_qparams
from seqcal.modifiers.activations import InputCalibration, static_inputs
from seqcal.modifiers.base import Modifier, QuantizedWeight, RunState, Statistic
from seqcal.modifiers.formats import check_widths, fused_groups, shared_global_scales, weight_format
from seqcal.modifiers.schemes import resolve_modules, resolve_schemes, strategy_of
from seqcal.tracing.partition import Subgraph


@dataclass
class QuantizationModifier(Modifier):
    """Quantize the weights of matching Linear layers with round-to-nearest.

    Args:
        targets: module class names or ``re:`` patterns the ``scheme`` applies to (default all Linear).
        scheme: a compressed-tensors preset ("W4A16", "W8A8", "FP8_DYNAMIC", "FP8", ...) or {preset: targets};
            static input activations (FP8, or config_groups with ``dynamic: false``) are calibrated on data.
        config_groups: explicit compressed-tensors config groups (instead of ``scheme``).
        ignore: modules left in full precision (class names or ``re:`` patterns), e.g. ["lm_head"].
        kv_cache_scheme: not supported; must stay None.

    Example:
        >>> QuantizationModifier(scheme="W4A16", ignore=["lm_head"])  # doctest: +SKIP
    """

    name: ClassVar[str] = "QuantizationModifier"
    # needs no data at all, or (static input activations) only its modules' inputs
    input_only: ClassVar[bool] = True
    targets: str | list[str] = "Linear"
    scheme: str | dict[str, Any] | None = None
    config_groups: dict[str, Any] | None = None
    ignore: list[str] = field(default_factory=list)
    kv_cache_scheme: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ignore, str):
            self.ignore = [self.ignore]
        if self.kv_cache_scheme is not None:
            raise ValueError(f"{self.name}: kv_cache_scheme is not supported yet; remove it from the recipe")
        self.groups = resolve_schemes(self.scheme, self.config_groups, self.targets, self.name)
        self.modules: dict[str, QuantizationScheme] = {}
        # modules vLLM merges into one weight (shared NVFP4 global scale); module -> NVFP4 global scale
        self._fused: list[tuple[str, ...]] = []
        self._global_scales: dict[str, torch.Tensor] = {}
        self.inputs = InputCalibration({})
        if any(static_inputs(g) for g in self.groups.values()):
            self.needs_calibration = True  # static input scales are calibrated on data

    def validate(self, model: torch.nn.Module) -> None:
        self.modules = resolve_modules(model, self.groups, self.ignore, self.name)
        self.inputs = InputCalibration(self.modules)
        if not self.modules:
            raise ValueError(
                f"{self.name}: no Linear layer matches targets {self.targets!r} (ignore={self.ignore!r}); "
                "targets are class names such as 'Linear' or 're:' patterns on module names"
            )
        # Before any calibration: a width the format cannot hold would stop the run later, at that module's
        # solve, after every subgraph before it was calibrated.
        check_widths(model, self.modules, self.name)
        self._fused = fused_groups(model, self.modules)

    def initialize(self, model: torch.nn.Module, state: RunState) -> None:
        if not self.modules:
            self.validate(model)

    def modules_in(self, subgraph: Subgraph) -> list[str]:
        """The modules of this modifier whose weights ``subgraph`` uses (for a subgraph cut before its
        targets: the targets only; an opaque statement touching a parent module does not pull its children in).
        """
        if subgraph.target_inputs:
            return [n for n in self.modules if n in set(subgraph.targets)]
        prefixes = tuple(subgraph.modules)
        return [n for n in self.modules if n in prefixes or n.startswith(tuple(p + "." for p in prefixes))]

    @contextlib.contextmanager
    def calibrate(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> Iterator[None]:
        names = [n for n in self.modules_in(subgraph) if n not in state.quantized]
        with self.inputs.hooks(names, model, state):  # static input scales; nothing else needs data
            yield

    def observe(self, names: list[str], x: torch.Tensor, state: RunState) -> None:
        self.inputs.observe([n for n in names if n in self.modules], x, state)

    def partial_statistics(self) -> dict[str, dict[str, Statistic]]:
        return self.inputs.partial_statistics()

    def load_statistics(self, reduced: dict[str, dict[str, torch.Tensor]]) -> None:
        self.inputs.load_statistics(reduced)

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        names = [n for n in self.modules_in(subgraph) if n not in state.quantized]
        self.prepare_global_scales(model, names)
        for name in names:
            module = model.get_submodule(name)
            state.quantized[name] = rtn_quantize_module(
                module, self.modules[name], self._global_scales.get(name)
            )
        self.inputs.finish(names, model, state)
        return bool(names)

    def prepare_global_scales(self, model: torch.nn.Module, names: list[str]) -> None:
        """NVFP4: fix the global scale of ``names`` (shared across each fused group) before any is quantized."""
        nvfp4 = [n for n in names if strategy_of(self.modules[n].weights) == "tensor_group"]
        shared_global_scales(model, nvfp4, self._fused, self._global_scales)


def quant_kwargs(scheme: QuantizationScheme) -> dict[str, Any]:
    """The weight arguments of ``scheme`` as keyword arguments of seqcal.algorithms."""
    w = scheme.weights
    return {
        "num_bits": w.num_bits,
        "symmetric": w.symmetric,
        "strategy": strategy_of(w),
        "group_size": w.group_size if strategy_of(w) == "group" else None,
        "type": str(w.type.value if hasattr(w.type, "value") else w.type),
    }


def rtn_quantize_module(
    module: torch.nn.Module, scheme: QuantizationScheme, global_scale: torch.Tensor | None = None
) -> QuantizedWeight:
    """Round-to-nearest quantize ``module.weight`` in place (fake-quantized) and return its compressed form.

    Args:
        module: the Linear.
        scheme: its scheme.
        global_scale: NVFP4's float32 [1] global scale (shared by a fused group); computed from this weight
            alone when None.
    """
    fmt = weight_format(scheme)
    W = module.weight.data  # [out, in]
    if fmt is not None:  # block fp8, NVFP4, MX: seqcal.algorithms.formats
        if fmt.needs_global_scale and global_scale is None:
            global_scale = formats.global_scale_of(W)
        scale, zero_point = formats.qparams(W, fmt, global_scale)
        q = formats.quantize(W, scale, zero_point, fmt, global_scale)
        module.weight.data = formats.dequantize(q, scale, zero_point, fmt, global_scale, dtype=W.dtype)
        return QuantizedWeight(q=q, scale=scale, zero_point=zero_point, g_idx=None, scheme=scheme,
                               global_scale=global_scale if fmt.needs_global_scale else None)  # fmt: skip
    kw = quant_kwargs(scheme)
    observer = scheme.weights.observer or "minmax"
    scale, zero_point = weight_qparams(
        W, num_bits=kw["num_bits"], symmetric=kw["symmetric"], strategy=kw["strategy"],
        group_size=kw["group_size"], type=kw["type"], observer=observer if observer in ("minmax", "mse") else "minmax",
    )  # fmt: skip
    qargs = {"num_bits": kw["num_bits"], "type": kw["type"], "group_size": kw["group_size"]}
    q = quantize(W, scale, zero_point, **qargs)
    module.weight.data = fake_quantize(W, scale, zero_point, **qargs)
    return QuantizedWeight(
        q=q, scale=scale, zero_point=None if kw["symmetric"] else zero_point, g_idx=None, scheme=scheme
    )
