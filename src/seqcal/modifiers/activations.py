"""Input activations of quantized Linears: calibrate static scales, fake-quantize as the runtime does.

``InputCalibration`` (owned by a quantization modifier) observes the inputs of the modules whose scheme has
static ``input_activations`` (or NVFP4's, whose global scale is calibrated), on the same inputs the weights are
calibrated on: in the one-pass cut these are computed with every upstream module already quantized, weights
and activations. When the modifier compresses a module, the observer's qparams become
``QuantizedWeight.input_scale`` / ``input_zero_point``; for NVFP4 inputs (fp4, fp8 scales per 16 columns
computed at inference, ``dynamic: local``) the observed absolute maximum becomes ``input_global_scale``, one
value for the modules vLLM fuses (q/k/v, gate/up), as llm-compressor's ``generate_gparam`` computes it.

``quantized_inputs`` (entered by the pipeline around the calibration loop) fake-quantizes the input of every
module once it is quantized, exactly as compressed-tensors' quantized forward (and vLLM) does: with the
calibrated static scale, or with qparams computed from each input for dynamic activations. So every pass
after a module's compression (its propagation pass, a replay on resume) feeds downstream layers what
inference will feed them.

Example:
    >>> with quantized_inputs(model, state, {"model.layers.0.mlp.down_proj": scheme}):  # doctest: +SKIP
    ...     model(ids)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from torch import Tensor

from seqcal.algorithms import FP8_DTYPE
from seqcal.algorithms.fp4 import nvfp4_global_scale
from seqcal.modifiers.fake_inputs import (
    enum_value,
    input_fake_quantize,
    nvfp4_inputs,
)
from seqcal.modifiers.formats import fused_groups
from seqcal.modifiers.observers import ActivationObserver, check_static_input, make_observer, observer_name
from seqcal.modifiers.state import Batch, BatchCursor, RunState
from seqcal.records import Statistic


def static_inputs(scheme: QuantizationScheme) -> QuantizationArgs | None:
    """The scheme's input activation arguments when they are static, else None."""
    acts = scheme.input_activations
    return acts if acts is not None and acts.dynamic is False else None


def calibrated_inputs(scheme: QuantizationScheme) -> QuantizationArgs | None:
    """The scheme's input activation arguments when calibration data sets something of them: static scales,
    or NVFP4's global scale. Else None (weight-only or fully dynamic)."""
    acts = scheme.input_activations
    return acts if static_inputs(scheme) is not None or nvfp4_inputs(acts) else None


def check_activations(scheme: QuantizationScheme, where: str) -> None:
    """Refuse activation settings seqcal cannot calibrate or store, before any work (names the fix).

    Args:
        scheme: a modifier's config group.
        where: the modifier and group, for the message.

    Raises:
        ValueError: output activations, a dynamic strategy compressed-tensors does not run, an unknown
            observer or a static strategy that cannot be stored.
    """
    if scheme.output_activations is not None:
        raise ValueError(
            f"{where}: output_activations are not supported (vLLM's Linear kernels read no output scale); "
            "remove output_activations from the scheme"
        )
    acts = scheme.input_activations
    if acts is None:
        return
    if enum_value(acts.dynamic) == "local":
        _check_nvfp4_inputs(acts, where)
    elif acts.dynamic is False:
        check_static_input(acts, where)
    elif acts.dynamic is not True or enum_value(acts.strategy) not in ("token", "tensor", "group"):
        raise ValueError(
            f"{where}: dynamic input activations with strategy {enum_value(acts.strategy)!r} (dynamic="
            f"{enum_value(acts.dynamic)}) are not supported; use strategy 'token' (W8A8, FP8_DYNAMIC) or 'tensor'"
        )


def _check_nvfp4_inputs(acts: QuantizationArgs, where: str) -> None:
    """``dynamic: local`` (group scales at inference under a calibrated global scale) is NVFP4's only."""
    nvfp4 = (enum_value(acts.type), acts.num_bits, enum_value(acts.strategy), acts.group_size) == (
        "float", 4, "tensor_group", 16) and acts.symmetric and acts.scale_dtype in (None, FP8_DTYPE)  # fmt: skip
    if not nvfp4:
        raise ValueError(
            f"{where}: input activations with dynamic 'local' are NVFP4's (fp4 float, strategy tensor_group, "
            f"group_size 16, symmetric, fp8 scales), got {enum_value(acts.type)} {acts.num_bits}-bit, strategy "
            f"{enum_value(acts.strategy)!r}, group_size {acts.group_size}; use the NVFP4 preset"
        )
    check_static_input(acts, where)  # the observer of the global scale: an unknown name lists the valid ones
    if observer_name(acts) not in ("minmax", "static_minmax", "memoryless_minmax"):
        raise ValueError(
            f"{where}: NVFP4 input activations calibrate their global scale with a min-max observer; "
            f"observer {observer_name(acts)!r} is not supported for them, use static_minmax (the preset's)"
        )


def observer_statistics(observer: ActivationObserver) -> dict[str, Any]:
    """One shard's range of ``observer`` as statistics (``Modifier.partial_statistics``), copied.

    ``static_minmax`` reduces exactly (min of the mins, max of the maxes); the moving-average and memoryless
    observers depend on the order of batches, so across shards their ranges are averaged (one shard: exactly
    the observer's own range). Static input observers and the KV cache's observers share this form.

    Example:
        >>> observer_statistics(observer)["hi"].reduce  # doctest: +SKIP
        'max'
    """
    lo, hi = (t.clone() for t in observer.range)  # q/k/v share one measured range: folds add in place
    if observer_name(observer.args) == "static_minmax":
        return {"lo": Statistic(lo, "min"), "hi": Statistic(hi, "max")}
    return {"lo": Statistic(lo), "hi": Statistic(hi), "shards": Statistic(torch.ones(1, dtype=torch.float64))}


def observer_from_statistics(observer: ActivationObserver, stats: Mapping[str, Tensor]) -> ActivationObserver:
    """The fresh ``observer`` given the range of every shard combined (``observer_statistics``' form)."""
    shards = float(stats["shards"].item()) if "shards" in stats else 1.0
    observer.range = (
        (stats["lo"] / shards, stats["hi"] / shards) if shards != 1.0 else (stats["lo"], stats["hi"])
    )
    return observer


class InputCalibration:
    """Observers of the static input activations of a modifier's modules.

    Args:
        schemes: module name -> scheme (only those with static input activations are observed).

    Example:
        >>> calib = InputCalibration({"fc": scheme})  # doctest: +SKIP
        >>> calib.observe(["fc"], x, state, Batch()); calib.finish(["fc"], model, state)  # doctest: +SKIP
    """

    def __init__(self, schemes: Mapping[str, QuantizationScheme]) -> None:
        self.args = {n: a for n, s in schemes.items() if (a := calibrated_inputs(s)) is not None}
        self.observers: dict[str, ActivationObserver] = {}
        # NVFP4 input global scales of fused modules (q/k/v, gate/up) fixed by a sibling's finish
        self._global_scales: dict[str, Tensor] = {}
        self._fused: list[tuple[str, ...]] | None = None
        # the last input measured and its range per observer setting: q/k/v (gate/up) read the same tensor
        self._last: tuple[Tensor | None, int, dict[str, Any]] = (None, -1, {})

    def __bool__(self) -> bool:
        return bool(self.args)

    def observe(self, names: list[str], x: Tensor, state: RunState, batch: Batch) -> None:
        """Add one batch's input ``x`` of the modules ``names`` (those without static inputs are skipped)."""
        mine = [n for n in names if n in self.args and n not in state.results.quantized]
        if not mine:
            return
        last, version, measured = self._last
        if last is not x or version != x._version:
            measured = {}
            self._last = (x, x._version, measured)
        tokens = None
        for name in mine:
            observer = self.observers.get(name) or self.observers.setdefault(
                name, make_observer(self.args[name])
            )
            key = repr(self.args[name])
            if key not in measured:
                tokens = batch.real(x.detach()) if tokens is None else tokens
                measured[key] = observer.measure(tokens, observer.args)
            observer.update(tokens, measured[key])

    def partial_statistics(self) -> dict[str, dict[str, Any]]:
        """The observed ranges of this shard (``Modifier.partial_statistics``; ``observer_statistics``), then
        forgotten."""
        out = {f"input:{n}": observer_statistics(o) for n, o in self.observers.items() if o.range is not None}
        self.observers.clear()
        self._last = (None, -1, {})
        return out

    def load_statistics(self, reduced: dict[str, dict[str, Tensor]]) -> None:
        """Observers holding the ranges of every shard combined (``partial_statistics``' keys)."""
        for key, stats in reduced.items():
            if key.startswith("input:"):
                name = key[len("input:") :]
                self.observers[name] = observer_from_statistics(make_observer(self.args[name]), stats)

    @contextlib.contextmanager
    def hooks(
        self, names: list[str], model: torch.nn.Module, state: RunState, batches: BatchCursor
    ) -> Iterator[None]:
        """Observe the inputs of ``names`` during a calibration pass (removed on exit, also on error)."""
        handles = []
        try:
            for name in [n for n in names if n in self.args]:
                hook = lambda module, args, name=name: self.observe([name], args[0], state, batches.current)  # noqa: E731
                handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._last = (None, -1, {})  # release the last batch's activations

    def finish(self, names: list[str], model: torch.nn.Module, state: RunState) -> None:
        """Store the calibrated input qparams of ``names`` (already in ``state.results.quantized``) and free their
        observers. A module whose input was never seen has no static scale to save: an error naming it."""
        mine = [n for n in names if n in self.args]
        for name in mine:
            observer = self.observers.get(name)
            if observer is None or observer.range is None:
                raise RuntimeError(
                    f"{name}: its input was never seen during calibration, so its static input scale cannot "
                    "be calibrated; give calibration data that reaches it, or add it to ignore"
                )
        self._nvfp4_global_scales([n for n in mine if nvfp4_inputs(self.args[n])], model)
        for name in mine:
            observer = self.observers.pop(name)
            if nvfp4_inputs(self.args[name]):
                state.results.quantized[name].input_global_scale = self._global_scales.pop(name)
                continue
            scale, zero_point = observer.qparams()
            dtype = model.get_submodule(
                name
            ).weight.dtype  # compressed-tensors keeps scales in the weight's dtype
            qw = state.results.quantized[name]
            qw.input_scale = scale.to(dtype if dtype.is_floating_point else torch.float32)
            qw.input_zero_point = None if observer.args.symmetric else zero_point

    def _nvfp4_global_scales(self, names: list[str], model: torch.nn.Module) -> None:
        """The input global scales of ``names``: ``448 * 6 / amax`` of the observed range, the largest over
        each fused group (vLLM loads q/k/v and gate/up as one layer with one input scale)."""
        if not names:
            return
        if self._fused is None:
            self._fused = fused_groups(model, [n for n, a in self.args.items() if nvfp4_inputs(a)])
        group_of = {m: g for g in self._fused for m in g}
        for name in [n for n in names if n not in self._global_scales]:
            members = [m for m in group_of.get(name, (name,)) if m in self.observers]
            ranges = [self.observers[m].range for m in members if self.observers[m].range is not None]
            amax = torch.stack([torch.maximum(hi.max(), -lo.min()) for lo, hi in ranges]).amax()
            scale = nvfp4_global_scale(amax)  # in the observed dtype, then float32: generate_gparam's order
            self._global_scales.update({m: scale.clone() for m in members})  # own tensors for safetensors


@contextlib.contextmanager
def quantized_inputs(
    model: torch.nn.Module, state: RunState, schemes: Mapping[str, QuantizationScheme]
) -> Iterator[None]:
    """Fake-quantize the inputs of the modules in ``schemes`` whose quantized weight's scheme quantizes activations,
    once each is in ``state.results.quantized`` (before that, calibration sees their raw inputs): the scheme a
    module holds decides, which a modifier may have chosen for it. Hooks are removed on exit.

    Args:
        model: the model being calibrated.
        state: the run state; read at call time, so a module starts quantizing its input when it is compressed.
        schemes: module name -> scheme (from the modifiers).

    Example:
        >>> with quantized_inputs(model, state, schemes):  # doctest: +SKIP
        ...     calibrate_subgraphs(...)
    """
    handles = []
    # q/k/v (gate/up) read the same tensor with equal input quantizers: quantize it once for all of them
    last: list[Any] = [None, -1, None, None]  # input, its version, its QuantizedWeight, the result

    def hook_for(name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> tuple | None:
            qw = state.results.quantized.get(name)
            if qw is None or qw.scheme.input_activations is None:  # not quantized yet, or weights only
                return None
            if not args or not isinstance(args[0], Tensor):
                return None
            x = args[0]
            if last[0] is not x or last[1] != x._version or not _same_input_quantizer(last[2], qw):
                last[:] = [x, x._version, qw, input_fake_quantize(x, qw)]
            return (last[3], *args[1:])

        return hook

    try:
        for name in schemes:  # a weight-only module's hook returns at once
            handles.append(model.get_submodule(name).register_forward_pre_hook(hook_for(name)))
        yield
    finally:
        for handle in handles:
            handle.remove()
        last.clear()


def _same_input_quantizer(a: Any, b: Any) -> bool:
    """Whether two modules' inputs are fake-quantized alike (same activation args, equal calibrated scales)."""
    if a is b:
        return True
    if a is None or a.scheme.input_activations != b.scheme.input_activations:
        return False
    for field in ("input_global_scale", "input_scale", "input_zero_point"):
        u, v = getattr(a, field, None), getattr(b, field, None)
        if (u is None) != (v is None) or (u is not None and not torch.equal(u, v)):
            return False
    return True


def quantizes_activations(modifiers: list[Any]) -> bool:
    """Whether some modifier's scheme quantizes input activations (the runtime then quantizes inputs, which
    the model ``oneshot`` returns does not: measure such a model from its checkpoint).

    Example:
        >>> quantizes_activations(parse_recipe("recipes/rtn_fp8_static.yaml").modifiers)  # doctest: +SKIP
        True
    """
    return any(g.input_activations is not None for m in modifiers for g in m.scheme_groups().values())
