"""GPTQModifier: Hessians from the calibration pass, GPTQ solve per Linear (math in algorithms.gptq)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from seqcal.algorithms import GPTQNumericalError, accumulate_hessian, gptq_quantize
from seqcal.modifiers.base import QuantizedWeight, RunState
from seqcal.modifiers.quantization import QuantizationModifier, quant_kwargs, rtn_quantize_module
from seqcal.partition import Subgraph

ACTORDERS = (None, "static", "group", "weight", "dynamic")


@dataclass
class _Accumulator:
    """One Hessian shared by every module that reads the same input tensor (q/k/v, gate/up)."""

    H: torch.Tensor | None = None
    n: int = 0
    last_input: tuple[int, int, tuple[int, ...]] | None = None  # (data_ptr, version, shape) already added


@dataclass
class GPTQModifier(QuantizationModifier):
    """GPTQ (Frantar et al., 2022) weight quantization, calibrated layer by layer.

    Args (besides QuantizationModifier's targets, scheme, config_groups, ignore):
        block_size: columns solved together (lazy batch updates).
        dampening_frac: fraction of mean(diag(H)) added to the diagonal.
        actorder: None, "static"/"weight" (column order by diag(H), same format) or "group" (g_idx saved).
        sequential_targets: layer classes to calibrate one by one (overrides the pipeline's inference).
        offload_hessians: accepted for llm-compressor compatibility; Hessians of one subgraph stay on device.

    Example:
        >>> GPTQModifier(scheme="W4A16", ignore=["lm_head"], dampening_frac=0.01)  # doctest: +SKIP
    """

    name: ClassVar[str] = "GPTQModifier"
    needs_calibration: ClassVar[bool] = True
    block_size: int = 128
    dampening_frac: float = 0.01
    actorder: str | None = "static"
    sequential_targets: str | list[str] | None = None
    offload_hessians: bool = False
    sequential_update: bool = True  # deprecated in llm-compressor; accepted and ignored

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.actorder not in ACTORDERS:
            raise ValueError(f"{self.name}: actorder={self.actorder!r} is not one of {ACTORDERS}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"{self.name}: block_size must be a positive integer, got {self.block_size!r}")
        if not 0 <= float(self.dampening_frac) < 1:
            raise ValueError(f"{self.name}: dampening_frac must be in [0, 1), got {self.dampening_frac!r}")
        self._acc: dict[str, _Accumulator] = {}

    @contextlib.contextmanager
    def calibrate(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> Iterator[None]:
        names = [n for n in self.modules_in(subgraph) if n not in state.quantized]
        shared: dict[tuple[int, int, tuple[int, ...]], _Accumulator] = {}
        handles = []
        try:
            for name in names:
                handles.append(
                    model.get_submodule(name).register_forward_pre_hook(self._hook(name, shared, state))
                )
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, name: str, shared: dict, state: RunState) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0]
            key = (x.data_ptr(), x._version, tuple(x.shape))
            acc = self._acc.get(name)
            if acc is None:  # first batch: modules fed the very same tensor share one accumulator
                acc = shared.setdefault(key, _Accumulator())
                self._acc[name] = acc
            if acc.last_input == key:
                return  # a sibling (q after k, up after gate) already added this input
            acc.last_input = key
            X = x.detach()
            mask = state.token_mask
            if mask is not None and X.dim() == 3 and tuple(mask.shape) == tuple(X.shape[:2]):
                X = X[mask.to(X.device, torch.bool)]  # padding tokens carry no signal
            acc.H, acc.n = accumulate_hessian(acc.H, X, acc.n)

        return hook

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        names = [n for n in self.modules_in(subgraph) if n not in state.quantized]
        for name in names:
            module = model.get_submodule(name)
            acc = self._acc.pop(name, None)
            start = time.perf_counter()
            if acc is None or acc.H is None:
                state.log.append(f"{name}: never called during calibration; quantized round-to-nearest")
                state.quantized[name] = rtn_quantize_module(module, self.modules[name])
                continue
            state.quantized[name] = self._solve(name, module, acc.H, state)
            state.module_errors.setdefault(name, {})["gptq_seconds"] = time.perf_counter() - start
        return bool(names)

    def _solve(self, name: str, module: torch.nn.Module, H: torch.Tensor, state: RunState) -> QuantizedWeight:
        scheme = self.modules[name]
        kw = quant_kwargs(scheme)
        W = module.weight.data
        try:
            result = gptq_quantize(
                W, H, block_size=self.block_size, dampening_frac=float(self.dampening_frac),
                actorder=self.actorder, **kw,
            )  # fmt: skip
        except GPTQNumericalError as exc:
            state.log.append(f"{name}: GPTQ failed ({exc}); fell back to round-to-nearest")
            return rtn_quantize_module(module, scheme)
        if result.retries:
            state.log.append(f"{name}: Cholesky needed {result.retries} retries (dampening {result.dampening_frac})")
        module.weight.data = result.Q
        state.module_errors.setdefault(name, {})["gptq_loss"] = result.loss
        return QuantizedWeight(
            q=result.q,
            scale=result.scale,
            zero_point=None if kw["symmetric"] else result.zero_point,
            g_idx=result.g_idx,
            scheme=scheme,
            loss=result.loss,
        )
