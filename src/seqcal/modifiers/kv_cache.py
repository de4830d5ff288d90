"""KV-cache quantization: calibrate ``k_scale`` / ``v_scale`` of each attention module on the keys and values
its cache stores.

A recipe's ``kv_cache_scheme`` (llm-compressor's argument of QuantizationModifier and GPTQModifier) asks for an
fp8 KV cache with static scales, one per layer (``strategy: tensor``) or one per key/value head
(``strategy: attn_head``). The keys and values are observed where transformers hands them to the cache:
the attention module calls ``cache.update(key_states, value_states, layer_idx)`` after the rotary embedding
and after any k-norm, with exactly the tensors the attention kernel reads and the cache stores. A stand-in
cache shows those tensors to an observer and returns them unchanged: in the one-pass cut it is the model's
cache argument in the traced graph (``kv_hooks.kv_tap``), and the subgraph that runs an attention's update
runs once more, with its q/k/v quantized, to observe them (``tap_action``, ``observe_updates``); in the
layer cut a forward pre-hook hands it to each attention module during the calibration pass. No other module
and no global registry is touched. This is what compressed-tensors does as well (its ``QuantizedKVCache``),
so the scales mean what vLLM reads. The stand-in caches and the hooks that fake-quantize the keys and values
with the scales are in ``seqcal.modifiers.kv_hooks``.

Saved as compressed-tensors / llm-compressor write them: ``<attention>.k_scale`` and ``<attention>.v_scale``
in the dtype of the attention's weights, shape ``[1]`` (tensor) or ``[num_kv_heads, 1, 1]`` (attn_head),
``scale = max|x| / 448`` over the real (non-padding) tokens (for the min-max observers), no zero point, and
``kv_cache_scheme`` in ``quantization_config``.

Example:
    >>> QuantizationModifier(scheme="FP8", ignore=["lm_head"],  # doctest: +SKIP
    ...     kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False})
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs
from torch import Tensor

from seqcal.modifiers.activations import observer_from_statistics, observer_statistics
from seqcal.modifiers.kv_hooks import (
    CACHE_ARGUMENTS,
    ObservingCache,
    cache_argument,
    checkpoint_kv_scales,
    fake_quantized_kv,
    fp8_kv,
    quantized_kv,
)
from seqcal.modifiers.observers import OBSERVERS, ActivationObserver, observer_name
from seqcal.modifiers.state import BatchCursor
from seqcal.tracing.partition import within

# the hooks that apply the scales live in kv_hooks; they are still imported from here
__all__ = [
    "CACHE_ARGUMENTS",
    "KV_PROJECTIONS",
    "KV_STRATEGIES",
    "SUPPORTED",
    "KVCacheCalibration",
    "attention_modules",
    "checkpoint_kv_scales",
    "fake_quantized_kv",
    "kv_cache_args",
    "quantized_kv",
]

KV_STRATEGIES = ("tensor", "attn_head")
# Children that make a module an attention whose keys and values are cached (compressed-tensors' list).
KV_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj", "kv_b_proj")
SUPPORTED = (
    "fp8 with static scales: num_bits: 8, type: float, strategy: 'tensor' (one scale per layer) or "
    "'attn_head' (one per key/value head), dynamic: false, symmetric: true"
)


def _value(x: object) -> str:
    return str(getattr(x, "value", x))


def kv_cache_args(spec: Any, where: str) -> QuantizationArgs:
    """The recipe's ``kv_cache_scheme`` as QuantizationArgs, refused unless seqcal and vLLM support it.

    Args:
        spec: a dict of QuantizationArgs fields (or QuantizationArgs).
        where: the modifier, for the message.

    Returns:
        The validated arguments.

    Raises:
        ValueError: not QuantizationArgs, or not fp8 static tensor / attn_head (the message lists what is).

    Example:
        >>> kv_cache_args({"num_bits": 8, "type": "float", "strategy": "tensor"}, "QuantizationModifier")
        QuantizationArgs(num_bits=8, ...)  # doctest: +SKIP
    """
    try:
        args = spec if isinstance(spec, QuantizationArgs) else QuantizationArgs.model_validate(spec)
    except Exception as exc:  # pydantic's ValidationError names the bad fields
        raise ValueError(f"{where}: kv_cache_scheme is not valid ({exc}); supported: {SUPPORTED}") from exc
    got = (
        f"num_bits {args.num_bits}, type {_value(args.type)}, strategy {_value(args.strategy)}, "
        f"dynamic {_value(args.dynamic)}, symmetric {args.symmetric}"
    )
    if (
        args.num_bits != 8
        or _value(args.type) != "float"
        or _value(args.strategy) not in KV_STRATEGIES
        or args.dynamic is not False
        or not args.symmetric
        or args.group_size is not None
    ):
        raise ValueError(f"{where}: kv_cache_scheme ({got}) is not supported; supported: {SUPPORTED}")
    name = observer_name(args)
    if name not in OBSERVERS:
        raise ValueError(
            f"{where}: kv_cache_scheme observer {name!r} does not exist; valid observers: {', '.join(OBSERVERS)}"
        )
    return args


def attention_modules(model: torch.nn.Module, where: str) -> dict[str, str]:
    """Attention modules whose keys and values are cached: name -> the forward's cache argument.

    An attention module is one whose class name says attention and that holds a key/value projection
    (``KV_PROJECTIONS``), as compressed-tensors decides.

    Raises:
        ValueError: the model has no such module, or one whose forward takes no cache argument (its keys and
            values cannot be observed where the cache stores them).
    """
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if "attention" not in type(module).__name__.lower():
            continue
        if not any(isinstance(getattr(module, p, None), torch.nn.Module) for p in KV_PROJECTIONS):
            continue
        argument = cache_argument(module)
        if argument is None:
            raise ValueError(
                f"{where}: kv_cache_scheme cannot be calibrated on {name} ({type(module).__name__}): its forward "
                f"takes none of {', '.join(CACHE_ARGUMENTS)}, so the keys and values it caches cannot be "
                "observed; remove kv_cache_scheme from the recipe for this model"
            )
        found[name] = argument
    if not found:
        raise ValueError(
            f"{where}: kv_cache_scheme needs attention modules with cached keys and values (a class named "
            f"*Attention* holding one of {', '.join(KV_PROJECTIONS)}), and {type(model).__name__} has none; "
            "remove kv_cache_scheme from the recipe for this model"
        )
    return found


def _tokens(x: Tensor, mask: Tensor | None) -> Tensor:
    """``x [batch, kv_heads, seq, head_dim]`` as ``[tokens, kv_heads, head_dim]`` without padding tokens."""
    x = x.detach().transpose(1, 2)  # [batch, seq, kv_heads, head_dim]
    if mask is not None and tuple(mask.shape) == tuple(x.shape[:2]) and not bool(mask.all()):
        return x[mask.to(x.device, torch.bool)]
    return x.reshape(-1, *x.shape[2:])


class KVCacheCalibration:
    """Observers of the keys and values of every attention module; their qparams become k_scale / v_scale.

    Args:
        args: the validated ``kv_cache_scheme``.
        where: the modifier, for messages.

    Example:
        >>> kv = KVCacheCalibration(kv_cache_args(spec, "m"), "m")  # doctest: +SKIP
        >>> kv.initialize(model)  # doctest: +SKIP
        >>> with kv.hooks(subgraph.modules, model, batches): ...  # doctest: +SKIP
        >>> kv.finish(subgraph, model)  # doctest: +SKIP
    """

    def __init__(self, args: QuantizationArgs, where: str) -> None:
        self.args = args
        self.where = where
        self.modules: dict[str, str] = {}  # attention module -> its cache argument
        self.observers: dict[tuple[str, str], ActivationObserver] = {}  # (module, "k" | "v") -> observer
        self.finished: set[str] = set()
        self.observing: set[str] = (
            set()
        )  # modules whose updates a stand-in cache shows to their observers now

    def validate(self, model: torch.nn.Module) -> None:
        self.modules = attention_modules(model, self.where)

    def initialize(self, model: torch.nn.Module) -> None:
        """Give each attention module its ``k_scale`` / ``v_scale`` buffers (placeholders until calibrated),
        so that the checkpoint writer saves them with the module, as compressed-tensors loads them."""
        if not self.modules:
            self.validate(model)
        for name in self.modules:
            module = model.get_submodule(name)
            for key in ("k_scale", "v_scale"):
                if key not in module._buffers:
                    module.register_buffer(key, torch.zeros(1, dtype=_scale_dtype(module)))

    def modules_in(self, modules: list[str]) -> list[str]:
        """The attention modules inside the subgraph modules ``modules`` not calibrated yet."""
        return [n for n in self.modules if n not in self.finished and within(n, modules)]

    def _observe(self, name: str, batches: BatchCursor) -> Any:
        def observe(keys: Tensor, values: Tensor) -> None:
            for kind, x in (("k", keys), ("v", values)):
                observer = self.observers.get((name, kind))
                if observer is None:
                    observer = self.observers.setdefault(
                        (name, kind), OBSERVERS[observer_name(self.args)](self.args)
                    )
                observer.update(_tokens(x, batches.current.token_mask))

        return observe

    def tap_action(self, name: str, model: torch.nn.Module, batches: BatchCursor) -> Any:
        """What the one-pass cut's stand-in cache (``kv_hooks.kv_tap``) does with the keys and values of ``name``:
        fp8 fake quantization with its scales once calibrated, shown to its observers while ``observe_updates``
        asks for it, else nothing."""
        observe = self._observe(name, batches)

        def act(keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor] | None:
            if name in self.finished:
                module = model.get_submodule(name)
                return fp8_kv(module.k_scale, module.v_scale)(keys, values)
            if name in self.observing:
                observe(keys, values)
            return None

        return act

    @contextlib.contextmanager
    def observe_updates(self, names: list[str]) -> Iterator[None]:
        """Observe the keys and values of ``names`` that the stand-in cache sees during the block."""
        self.observing.update(names)
        try:
            yield
        finally:
            self.observing.difference_update(names)

    @contextlib.contextmanager
    def hooks(self, modules: list[str], model: torch.nn.Module, batches: BatchCursor) -> Iterator[None]:
        """During a calibration pass, hand the attention modules in ``modules`` an observing cache (``batches``:
        the batch it runs, whose padding the observers drop)."""
        handles = []
        try:
            for name in self.modules_in(modules):
                handles.append(
                    model.get_submodule(name).register_forward_pre_hook(
                        self._pre_hook(name, self.modules[name], batches), with_kwargs=True
                    )
                )
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _pre_hook(self, name: str, argument: str, batches: BatchCursor) -> Any:
        observe = self._observe(name, batches)

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            kwargs = dict(kwargs)
            kwargs[argument] = ObservingCache(observe, kwargs.get(argument))
            return args, kwargs

        return hook

    def partial_statistics(self) -> dict[str, dict[str, Any]]:
        """This shard's key and value ranges (``Modifier.partial_statistics``), then forgotten: per attention
        module and kind ``kv:<module>:k`` / ``kv:<module>:v``, as ``activations.observer_statistics`` gives them."""

        out = {f"kv:{name}:{kind}": observer_statistics(o) for (name, kind), o in self.observers.items()
               if o.range is not None}  # fmt: skip
        self.observers.clear()
        return out

    def load_statistics(self, reduced: dict[str, dict[str, Tensor]]) -> None:
        """Observers holding the ranges of every shard combined (``partial_statistics``' keys)."""

        for key, stats in reduced.items():
            if key.startswith("kv:"):
                name, _, kind = key[len("kv:") :].rpartition(":")
                fresh = OBSERVERS[observer_name(self.args)](self.args)
                self.observers[(name, kind)] = observer_from_statistics(fresh, stats)

    def scales_of(self, modules: list[str], model: torch.nn.Module) -> dict[str, Tensor]:
        """``<attention>.k_scale`` / ``.v_scale`` of the calibrated attention modules inside ``modules`` (what the
        process that calibrated them hands to the others, ``load_scales``)."""
        names = [n for n in self.finished if within(n, modules)]
        return {f"{n}.{kind}_scale": getattr(model.get_submodule(n), f"{kind}_scale") for n in sorted(names)
                for kind in ("k", "v")}  # fmt: skip

    def load_scales(self, scales: dict[str, Tensor], model: torch.nn.Module) -> None:
        """Take ``scales_of``' scales calibrated by another process: stored, and the modules count as finished."""
        for key, scale in scales.items():
            name, _, buffer = key.rpartition(".")
            model.get_submodule(name).register_buffer(buffer, scale.cpu())
            self.finished.add(name)

    def finish(self, modules: list[str], model: torch.nn.Module) -> bool:
        """Store the calibrated ``k_scale`` / ``v_scale`` of the attention modules in ``modules``; True when
        there were some (their keys and values are quantized from now on: the subgraph must run again).

        Raises:
            RuntimeError: an attention module's cache was never updated during calibration (its forward did
                not run as a module, or did not call ``cache.update``); names it and the fix.
        """
        names = self.modules_in(modules)
        for name in names:
            module = model.get_submodule(name)
            for kind in ("k", "v"):
                observer = self.observers.pop((name, kind), None)
                if observer is None or observer.range is None:
                    raise RuntimeError(
                        f"{self.where}: the keys and values of {name} were never seen during calibration (its "
                        f"forward did not run as a module with a {self.modules[name]!r} argument, or did not "
                        "call cache.update); kv_cache_scheme needs the attention modules to run as modules: "
                        "do not trace into them (trace_into), or remove kv_cache_scheme"
                    )
                scale, _ = observer.qparams()  # [1] or [kv_heads]
                shape = (-1, 1, 1) if _value(self.args.strategy) == "attn_head" else (1,)
                module.register_buffer(f"{kind}_scale", scale.reshape(shape).to(_scale_dtype(module)).cpu())
            self.finished.add(name)
        return bool(names)


def _scale_dtype(module: torch.nn.Module) -> torch.dtype:
    """compressed-tensors keeps k_scale / v_scale in the dtype of the attention's weights (float16 if not float)."""
    dtype = next((p.dtype for p in module.parameters()), torch.float32)
    return dtype if dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else torch.float16
