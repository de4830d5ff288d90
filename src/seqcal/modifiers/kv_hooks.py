"""Where seqcal reaches the keys and values an attention module caches: the forward's cache argument, a
stand-in cache whose ``update`` shows them to an observer (calibration, ``seqcal.modifiers.kv_cache``) or
replaces them by their fp8 fake quantization with static scales (``quantized_kv`` during the run,
``fake_quantized_kv`` to evaluate a checkpoint whose KV cache transformers would run unquantized).

Example:
    >>> with fake_quantized_kv(model, checkpoint_kv_scales(tensors)):  # doctest: +SKIP
    ...     model(ids)
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
from compressed_tensors.quantization import QuantizationArgs
from torch import Tensor

from seqcal.modifiers.fake_inputs import qdq
from seqcal.modifiers.state import BatchCursor


class _Calibrated(Protocol):
    """What the hooks read of a KV-cache calibration (``seqcal.modifiers.kv_cache.KVCacheCalibration``)."""

    finished: set[str]  # attention modules whose k_scale / v_scale are calibrated


# The attention forward's cache argument: ``cache`` since transformers 5.24, ``past_key_values`` before it.
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")


def cache_argument(module: torch.nn.Module) -> str | None:
    """The argument of ``module.forward`` that takes the cache (one of ``CACHE_ARGUMENTS``), or None.

    Example:
        >>> cache_argument(model.model.layers[0].self_attn)  # doctest: +SKIP
        'past_key_values'
    """
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((p for p in CACHE_ARGUMENTS if p in params), None)


class ObservingCache:
    """Stands in for the cache an attention module updates: shows the new keys and values to ``observe`` (or
    replaces them by what it returns, for fake quantization) and passes them on (to the real cache, when the
    model was given one)."""

    def __init__(self, observe: Any, cache: Any) -> None:
        self._observe = observe
        self._cache = cache

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        replaced = self._observe(key_states, value_states)
        if replaced is not None:
            key_states, value_states = replaced
        if self._cache is not None:
            return self._cache.update(key_states, value_states, *args, **kwargs)
        return key_states, value_states

    def __getattr__(self, name: str) -> Any:
        cache = self.__dict__.get("_cache")
        if cache is None:
            raise AttributeError(
                f"the attention module read {name!r} of its cache; seqcal observes keys and values only "
                "through cache.update(...)"
            )
        return getattr(cache, name)


def kv_tap(model: torch.nn.Module, modules: Iterable[str]) -> Any:
    """A stand-in cache for tracing the one-pass cut with a ``kv_cache_scheme``, or None when the attention
    modules cannot be told apart by their ``layer_idx`` (the cut after layers is used then).

    It is an empty ``DynamicCache`` (so that the model's mask and position code behave as for a prompt with no
    past) that stores nothing: its ``update`` hands the keys and values of attention ``layer_idx`` to what the
    run asks for (``KVTap.on_update``: observe them, or replace them by their fp8 fake quantization) and returns
    them. Traced as a constant, the attention's ``cache.update(...)`` statement runs it at run time; the
    pipeline finds which subgraph runs each update (``kv_update_sites``).

    Args:
        model: the model.
        modules: the attention modules whose keys and values are calibrated.
    """
    from transformers import DynamicCache

    layers: dict[int, str] = {}
    for name in modules:
        index = getattr(model.get_submodule(name), "layer_idx", None)
        if not isinstance(index, int) or index in layers:
            return None
        layers[index] = name

    class KVTap(DynamicCache):
        """See ``kv_tap``."""

        def __init__(self) -> None:
            super().__init__(config=getattr(model.config, "get_text_config", lambda: model.config)())
            self.layers_to_names = layers
            # attention module -> (keys, values) -> replacement (keys, values) or None; set by the run
            self.on_update: dict[str, Any] = {}

        def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
                   **kwargs: Any) -> tuple[Tensor, Tensor]:  # fmt: skip
            if isinstance(key_states, torch.fx.Proxy):  # while tracing: run the statement at run time instead
                raise TypeError("the KV-cache stand-in is updated at run time")
            act = self.on_update.get(self.layers_to_names.get(layer_idx, ""))
            replaced = act(key_states, value_states) if act is not None else None
            return replaced if replaced is not None else (key_states, value_states)

        def __repr__(self) -> str:
            return "KVTap()"

    return KVTap()


def cache_update(node: torch.fx.Node) -> str | None:
    """The attention module whose ``cache.update(...)`` statement ``node`` runs (an opaque statement of a graph
    traced with ``kv_tap``), else None."""
    site = getattr(node.target, "site", None) if node.op == "call_function" else None
    if site is None or not any(a in site.inputs and f"{a}.update(" in site.code for a in CACHE_ARGUMENTS):
        return None
    return node.meta.get("seqcal_module")


def kv_update_sites(subgraphs: Any, modules: Iterable[str]) -> dict[int, list[str]] | None:
    """Subgraph index -> the attention modules (of ``modules``) whose ``cache.update(...)`` statement it runs,
    found in a graph traced with ``kv_tap``; None unless each runs in exactly one subgraph cut before its
    targets (the one-pass executor calibrates them there)."""
    wanted, found = set(modules), {}
    for sg in subgraphs:
        for node in sg.nodes:
            name = cache_update(node)
            if name in wanted and (found.setdefault(name, sg.index) != sg.index or not sg.target_inputs):
                return None
    if set(found) != wanted:
        return None
    out: dict[int, list[str]] = {}
    for name, index in found.items():
        out.setdefault(index, []).append(name)
    return out


@contextlib.contextmanager
def fake_quantized_kv(model: torch.nn.Module, scales: dict[str, tuple[Tensor, Tensor]]) -> Iterator[None]:
    """Run the attention modules in ``scales`` with their cached keys and values fake-quantized to fp8 with
    the static scales, as vLLM's fp8 KV cache stores them (``x / scale`` cast to float8_e4m3fn, times scale).

    transformers 5.24 with compressed-tensors 0.20 loads a checkpoint's ``k_scale`` / ``v_scale`` as unexpected
    keys and runs the cache unquantized (its attention's cache argument is now ``cache``, which
    compressed-tensors does not look for); this emulates the KV cache for evaluation. Hooks are removed on exit.

    Args:
        model: the model.
        scales: attention module name -> (k_scale, v_scale), each [1] or [kv_heads, 1, 1].

    Example:
        >>> with fake_quantized_kv(model, {"model.layers.0.self_attn": (k, v)}):  # doctest: +SKIP
        ...     model(ids)
    """
    handles = []
    try:
        for name, (k_scale, v_scale) in scales.items():
            module = model.get_submodule(name)
            argument = cache_argument(module)
            if argument is None:
                raise ValueError(f"fake_quantized_kv: {name} takes none of {', '.join(CACHE_ARGUMENTS)}")
            handles.append(
                module.register_forward_pre_hook(
                    _quantizing_hook(argument, k_scale, v_scale), with_kwargs=True
                )
            )
        yield
    finally:
        for handle in handles:
            handle.remove()


def fp8_kv(k_scale: Tensor, v_scale: Tensor) -> Any:
    """``(keys, values) -> (keys, values)`` fake-quantized to fp8 with static scales, as vLLM's fp8 KV cache."""

    fp8 = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)

    def quantize(keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        # scales [1] or [kv_heads, 1, 1] broadcast against [batch, kv_heads, seq, head_dim]
        k = qdq(keys, k_scale.to(keys.device, keys.dtype), None, fp8).to(keys.dtype)
        return k, qdq(values, v_scale.to(values.device, values.dtype), None, fp8).to(values.dtype)

    return quantize


def _quantizing_hook(argument: str, k_scale: Tensor, v_scale: Tensor) -> Any:
    quantize = fp8_kv(k_scale, v_scale)

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, argument: ObservingCache(quantize, kwargs.get(argument))}

    return hook


def checkpoint_kv_scales(tensors: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """Attention module name -> (k_scale, v_scale) from a checkpoint's tensors (empty when it has none)."""
    names = [k.removesuffix(".k_scale") for k in tensors if k.endswith(".k_scale")]
    return {n: (tensors[f"{n}.k_scale"], tensors[f"{n}.v_scale"]) for n in names if f"{n}.v_scale" in tensors}


@contextlib.contextmanager
def quantized_kv(
    model: torch.nn.Module, modifiers: list[Any], tap: Any = None, batches: BatchCursor | None = None
) -> Iterator[None]:
    """Fake-quantize the keys and values of every attention module once its k_scale / v_scale are calibrated
    (entered by the pipeline around the calibration loop): later passes, the propagation pass of its own layer
    included, feed downstream layers what an fp8 KV cache gives them. Before that, calibration sees raw keys.

    Args:
        model: the model being calibrated.
        modifiers: the run's modifiers; those with a ``kv`` (KVCacheCalibration) take part.
        tap: the one-pass cut's stand-in cache (``kv_tap``), whose updates then observe and quantize too.
        batches: the run's batch cursor (the token mask of the batch the stand-in cache observes).

    Example:
        >>> with quantized_kv(model, modifiers):  # doctest: +SKIP
        ...     calibrate_subgraphs(...)
    """
    handles = []
    try:
        for kv in [kv for m in modifiers if (kv := m.kv_calibration()) is not None]:
            for name, argument in kv.modules.items():
                module = model.get_submodule(name)
                handles.append(
                    module.register_forward_pre_hook(_when_finished(kv, name, argument), with_kwargs=True)
                )
                if tap is not None:
                    tap.on_update[name] = kv.tap_action(name, model, batches or BatchCursor())
        yield
    finally:
        for handle in handles:
            handle.remove()
        if tap is not None:
            tap.on_update.clear()


def _when_finished(kv: _Calibrated, name: str, argument: str) -> Any:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if name not in kv.finished:
            return None
        return _quantizing_hook(argument, module.k_scale, module.v_scale)(module, args, kwargs)

    return hook
