"""AutoRoundModifier: learned rounding and ranges per decoder layer (signed gradient descent), llm-compressor's
arguments. Math in ``seqcal.algorithms.autoround`` (int weights), ``seqcal.algorithms.autoround_formats`` (fp8,
NVFP4, MX) and ``seqcal.algorithms.autoround_grids`` (GGUF's types: llama.cpp's scales, the codes learned).

The modifier is not ``input_only``, so the pipeline cuts after each layer. The layer's calibration pass records
its calls (``SpanCache``); ``compress`` computes the layer's full-precision output on its *reference inputs*,
learns the rounding offsets and min/max factors of every Linear of the layer against it (``iters`` steps of
``batch_size`` rows; the best iterate by loss is kept), quantizes the Linears into ``state.results.quantized``, and the
propagation pass gives the next layer the quantized layer's output, which the layer trains on.

Reference inputs (``reference``): ``"full_precision"`` (default, auto-round's own): the unquantized model's
activations, carried from layer to layer beside the quantized ones (one more copy of a layer's recorded hidden
states), so that each layer also makes up for the error of the layers before it; ``"quantized"`` (llm-compressor's
wrapper): the inputs the quantized layer sees.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from compressed_tensors.quantization import QuantizationScheme
from torch.func import functional_call

from seqcal.algorithms import dequantize, formats
from seqcal.algorithms.autoround import LearnedQuantizer, learned_codes, sign_step_
from seqcal.algorithms.autoround_formats import FormatQuantizer
from seqcal.algorithms.autoround_grids import GridQuantizer
from seqcal.algorithms.formats import WeightFormat
from seqcal.algorithms.search_steps import TrainingKernels, batches_of, linear_lr, masked_mse
from seqcal.backend import linears_on_onednn
from seqcal.gguf.scheme import GGUFScheme
from seqcal.modifiers.base import BatchCursor, QuantizedWeight, RunState
from seqcal.modifiers.formats import weight_format
from seqcal.modifiers.layer_calls import Calls, with_hidden
from seqcal.modifiers.quantization import QuantizationModifier
from seqcal.modifiers.round_to_nearest import quant_kwargs, rounded
from seqcal.modifiers.spans import SpanCache
from seqcal.tracing.partition import Subgraph

REFERENCES = ("full_precision", "quantized")


@dataclass
class AutoRoundModifier(QuantizationModifier):
    """AutoRound (Cheng et al., 2024) with llm-compressor's arguments: learned rounding per decoder layer.

    Args (besides QuantizationModifier's targets, scheme, config_groups, ignore):
        iters: signed gradient steps per layer (0: round to nearest). Symmetric int weights use the whole code
            range with signed scales, as auto-round does (``seqcal.algorithms.autoround``), also at 0 steps.
        lr: learning rate of the rounding offsets and range factors, decayed linearly to 0; None: 1 / iters.
        batch_size: calibration rows per step.
        enable_torch_compile, device_ids, disable_opt_rtn: llm-compressor's; accepted, no effect here (the layer
            runs eagerly on the run's execution device; iters 0 is plain round to nearest).
        amp: the search's forward and backward passes run under bfloat16 autocast (auto-round's ``amp``, on by
            default there too: much faster on CPUs with bf16 instructions and on GPUs), and so do the reference
            outputs they are compared with, so that the loss is the quantization's error and not bfloat16's
            rounding (auto-round runs its whole model in bfloat16); the codes and the propagation keep the run's
            dtype. False: the search and the reference in the run's dtype.
        reference: the inputs of the full-precision output each layer learns to match: "full_precision"
            (auto-round's) or "quantized" (llm-compressor's wrapper). See the module docstring.
        max_chunk_memory: bytes of recorded layer calls kept for the search (later batches are left out).
        seed: of the random row batches.

    Example:
        >>> AutoRoundModifier(scheme="W4A16", ignore=["lm_head"], iters=50)  # doctest: +SKIP
    """

    name: ClassVar[str] = "AutoRoundModifier"
    mixed_observer: ClassVar[str | None] = "minmax"  # it learns its ranges from min-max ones
    needs_calibration: ClassVar[bool] = True
    input_only: ClassVar[bool] = False  # re-runs whole decoder layers on their recorded calls
    iters: int = 200
    lr: float | None = None
    batch_size: int = 8
    enable_torch_compile: bool = True
    device_ids: str | None = None
    disable_opt_rtn: bool = False
    amp: bool = True
    reference: str = "full_precision"
    max_chunk_memory: int = 1 << 30
    seed: int = 42

    def __post_init__(self) -> None:
        _check_int(self.name, "iters", self.iters, 0)
        _check_int(self.name, "batch_size", self.batch_size, 1)
        _check_int(self.name, "max_chunk_memory", self.max_chunk_memory, 1)
        _check_int(self.name, "seed", self.seed, 0)
        if self.lr is not None and (isinstance(self.lr, bool) or not isinstance(self.lr, (int, float))
                                    or not math.isfinite(self.lr) or self.lr <= 0):  # fmt: skip
            raise ValueError(
                f"{self.name}: lr must be a positive number or null (1 / iters), got {self.lr!r}"
            )
        for flag in ("enable_torch_compile", "disable_opt_rtn", "amp"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{self.name}: {flag} must be true or false, got {getattr(self, flag)!r}")
        if self.reference not in REFERENCES:
            raise ValueError(
                f"{self.name}: reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}"
            )
        # the full-precision activations carried between layers are not in the checkpoint: a resumed run could
        # not continue them, so it is refused (the pipeline says so) instead of giving other weights
        self.resumable = self.reference == "quantized"
        super().__post_init__()

    def gathers_importance(self, group: QuantizationScheme) -> bool:
        # GGUF types fix their scales by llama-quantize --imatrix's rule: the inputs' E[x^2] of each Linear
        return super().gathers_importance(group) or isinstance(group, GGUFScheme)

    def validate(self, model: torch.nn.Module) -> None:
        super().validate(model)
        if self.mixed is not None:  # every candidate and pin a module may get (mixed_precision)
            for label, scheme in zip(
                [*self.mixed.pin, *self.mixed.labels], self.mixed.every_scheme().values()
            ):
                if why := _refusal(scheme):
                    raise ValueError(f"{self.name}: mixed_precision candidate {label!r}: {why}; AutoRound learns "
                                     "min-max int, fp8, NVFP4, MX and GGUF weights")  # fmt: skip
        for name, scheme in self.modules.items():
            if why := _refusal(scheme):
                raise ValueError(f"{self.name}: {name} {why}; AutoRound learns min-max int weights (2 to 8 bits, per "
                                 "channel or group), fp8, NVFP4 or MX weights (per tensor, channel or group) and GGUF types: use "
                                 "GPTQModifier or QuantizationModifier for it, or add it to ignore")  # fmt: skip

    def shares_statistics(self) -> bool:
        """False: the rounding learned on a layer depends on every recorded call, which stay in their process;
        a run with more than one process refuses this modifier."""
        return False

    def initialize(self, model: torch.nn.Module, state: RunState) -> None:
        super().initialize(model, state)
        self._spans: dict[str, SpanCache] = {}  # decoder layer -> its recorded calls
        self._reference: list[torch.Tensor] | None = None  # full-precision outputs of the layer before
        self.losses: dict[str, tuple[float, float]] = {}  # layer -> (round to nearest, best learned) loss
        # enable_torch_compile is on by default (llm-compressor's): not worth a line
        if self.device_ids is not None or self.disable_opt_rtn:
            state.results.log.append(f"{self.name}: device_ids and disable_opt_rtn have no effect in seqcal (layers run on "
                             "the execution device; iters 0 is round to nearest)")  # fmt: skip

    @contextlib.contextmanager
    def calibrate(
        self, subgraph: Subgraph, model: torch.nn.Module, state: RunState, batches: BatchCursor
    ) -> Iterator[None]:
        handles = []
        try:  # entered once per virtual shard: the recorded calls carry over
            for layer in subgraph.targets:
                span = self._spans.setdefault(layer, SpanCache(self.max_chunk_memory))
                hook = span.hook(lambda: batches.current.token_mask)
                handles.append(model.get_submodule(layer).register_forward_pre_hook(hook, with_kwargs=True))
            with super().calibrate(subgraph, model, state, batches):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        changed = False
        for layer in subgraph.targets:
            span = self._spans.pop(layer, None)
            names = [
                n
                for n in self.modules_in(subgraph)
                if n.startswith(layer + ".") and n not in state.results.quantized
            ]
            if span is None or not span.calls:
                self._reference = None
                continue
            calls = Calls.of(span.calls)
            span.calls.clear()
            with torch.no_grad(), self._reference_precision(state):
                reference = self._reference_outputs(model.get_submodule(layer), calls, state.config.device)
            self._reference = reference if self.reference == "full_precision" else None
            if names and self.mixed is not None:  # each unit's scheme from its errors under every candidate
                self.mixed.assign(
                    names, model, self.modules, state, lambda n: (None, self._mean_square(n)), rounded
                )
            if names:
                self._learn(layer, names, calls, reference, model, state)
                changed = True
        return super().compress(subgraph, model, state) or changed  # the rest round to nearest (lm_head, ...)

    def replayed(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> None:
        self._reference = None
        super().replayed(subgraph, model, state)

    def _reference_outputs(
        self, layer: torch.nn.Module, calls: Calls, device: torch.device
    ) -> list[torch.Tensor]:
        """The layer's full-precision outputs on its reference inputs, one per (stacked) call."""
        carried = self._reference
        if carried is not None and not calls.accepts(carried):
            carried = None  # the layers do not chain (another shape): the recorded inputs it is
        out = []
        for u, unit in enumerate(calls.units):
            parts = []
            for rows in torch.arange(unit.rows).split(self.batch_size):
                args, kwargs = unit.select(rows, device)
                if carried is not None:
                    args, kwargs = with_hidden(args, kwargs, carried[u][rows].to(device))
                y = layer(*args, **kwargs)
                parts.append((y[0] if isinstance(y, (tuple, list)) else y).detach())
            out.append(torch.cat(parts))  # [rows, seq, hidden]
        return out

    def _reference_precision(self, state: RunState) -> contextlib.AbstractContextManager:
        """The reference outputs' precision: the search's under ``amp`` (bfloat16 autocast), else the run's."""
        if self.amp:
            return self._training_precision(state)
        stack = contextlib.ExitStack()
        stack.enter_context(linears_on_onednn(state.config.device))
        stack.enter_context(_autocast(state.config.device, state.config.compute_dtype))
        return stack

    def _training_precision(self, state: RunState) -> contextlib.AbstractContextManager:
        """bfloat16 autocast (``amp``), else the run's compute dtype, else float32 Linears on oneDNN's kernels."""
        dtype = torch.bfloat16 if self.amp else state.config.compute_dtype
        stack = contextlib.ExitStack()
        stack.enter_context(TrainingKernels(linears=dtype is None))  # under autocast the Linears stay torch's
        stack.enter_context(_autocast(state.config.device, dtype))
        return stack

    def _learn(self, layer: str, names: list[str], calls: Calls, reference: list[torch.Tensor],
               model: torch.nn.Module, state: RunState) -> None:  # fmt: skip
        """Learn, then quantize, the Linears ``names`` of ``layer`` against ``reference``."""
        block = model.get_submodule(layer)
        self.prepare_global_scales(model, names)  # NVFP4: one per fused group, from the unquantized weights
        W = {n: model.get_submodule(n).weight.detach() for n in names}
        quantizers = {n: self._quantizer(n, W[n]) for n in names}
        params = {n: q.start() for n, q in quantizers.items()}
        # under amp the fake-quantized weights are made in bfloat16, the dtype autocast would cast them to
        dtype = torch.bfloat16 if self.amp else None
        frozen = {k: v.detach() for k, v in block.named_parameters()}
        rel = {n: n[len(layer) + 1 :] + ".weight" for n in names}
        lr = self.lr if self.lr is not None else 1.0 / max(self.iters, 1)
        best, first, kept = math.inf, math.nan, {n: p.detached() for n, p in params.items()}
        for step, rows in enumerate(batches_of(calls.rows, self.batch_size, self.iters, self.seed)):
            loss = 0.0
            for share, args, kwargs, mask, target in calls.batch(rows, reference, state.config.device):
                with torch.enable_grad(), self._training_precision(state):
                    weights = {rel[n]: quantizers[n](params[n], dtype or W[n].dtype) for n in names}
                    y = functional_call(block, {**frozen, **weights}, args, kwargs)
                    value = masked_mse(y[0] if isinstance(y, (tuple, list)) else y, target, mask) * share
                    value.backward()
                loss += value.item()
            first = loss if step == 0 else first
            if loss < best:  # signed steps do not always descend: keep the best iterate seen
                best, kept = loss, {n: p.detached() for n, p in params.items()}
            for p in params.values():
                sign_step_(p, linear_lr(lr, step, self.iters))
        if self.iters == 0:  # round to nearest: nothing was learned or measured
            best = first
        self.losses[layer] = (first, best)
        for n in names:
            module, quantizer = model.get_submodule(n), quantizers[n]
            if isinstance(quantizer, GridQuantizer):  # GGUF: llama.cpp's imatrix scales, the learned codes
                q, scale, zp = quantizer.codes(kept[n])
                module.weight.data = formats.dequantize(q, scale, zp, quantizer.fmt, dtype=W[n].dtype)
                g = None
            elif isinstance(quantizer, FormatQuantizer):
                q, scale = quantizer.codes(kept[n])
                zp, fmt, g = None, quantizer.fmt, quantizer.global_scale
                module.weight.data = formats.dequantize(q, scale, None, fmt, g, dtype=W[n].dtype)
                g = g if fmt.needs_global_scale else None
            else:
                kw = _int_format(self.modules[n])
                q, scale, zp = learned_codes(W[n], kept[n], **kw)
                gs = W[n].shape[-1] if kw["group_size"] is None else kw["group_size"]
                module.weight.data = dequantize(q, scale, zp, group_size=gs, dtype=W[n].dtype)
                g = None
            state.results.quantized[n] = QuantizedWeight(q, scale, zp, None, self.modules[n], global_scale=g)
            if self.iters:
                state.results.module_errors.setdefault(n, {}).update(
                    autoround_initial_loss=first, autoround_loss=best
                )
        self.inputs.finish(names, model, state)  # static input scales, observed in the calibration pass

    def _quantizer(self, name: str, W: torch.Tensor) -> LearnedQuantizer | FormatQuantizer | GridQuantizer:
        """The learned fake quantization of ``name``'s weight: int codes, a float / scaled format, or a GGUF type."""
        fmt = _float_format(self.modules[name])
        if fmt is not None and fmt.scale == "gguf":
            return GridQuantizer.of(W, fmt, self._mean_square(name))
        if fmt is None:
            kw = _int_format(self.modules[name])
            return LearnedQuantizer.of(W, **kw)
        return FormatQuantizer.of(W, fmt, self._global_scales.get(name))


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def _int_format(scheme: Any) -> dict[str, Any]:
    kw = quant_kwargs(scheme)
    return {"num_bits": kw["num_bits"], "symmetric": kw["symmetric"], "group_size": kw["group_size"]}


def _float_format(scheme: Any) -> WeightFormat | None:
    """The format of ``scheme``'s float weights (fp8 with plain scales, NVFP4, MX), None for int weights."""
    fmt = weight_format(scheme)
    kw = quant_kwargs(scheme)
    if fmt is None and kw["type"] == "float":
        fmt = WeightFormat(num_bits=kw["num_bits"], type="float", strategy=kw["strategy"],
                           group_size=kw["group_size"])  # fmt: skip
    return fmt


def _refusal(scheme: Any) -> str | None:
    """Why AutoRound cannot learn ``scheme``'s weights (None: it can)."""
    kw = quant_kwargs(scheme)
    if scheme.output_activations is not None:
        return "quantizes its outputs"
    if kw["observer"] != "minmax":
        return f"has the weight observer {kw['observer']!r} (AutoRound learns its ranges from min-max)"
    fmt = _float_format(scheme)
    if fmt is not None and fmt.scale == "gguf":  # a GGUF type: its scales fixed, the codes learned
        return None
    if fmt is not None:
        if fmt.strategy == "block" or fmt.type != "float":
            return f"has {fmt.strategy} {fmt.num_bits}-bit {fmt.type} weights (learned per group, channel or tensor)"
        return None
    if not 2 <= kw["num_bits"] <= 8:
        return f"has {kw['num_bits']}-bit int weights"
    if kw["strategy"] not in ("group", "channel"):
        return f"has {kw['strategy']!r} weight scales"
    return None


def _check_int(owner: str, name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{owner}: {name} must be an integer >= {least}, got {value!r}")
