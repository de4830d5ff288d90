"""The arguments of a model-free run, llm-compressor 0.14's ``model_free_ptq`` keywords and seqcal's, checked
once, and the recipe modifier they describe.

llm-compressor's ``scheme`` (a preset name or a QuantizationScheme) and ``config`` (a QuantizationConfig: several
groups and an ignore list) become a ``QuantizationModifier``, so their targets and ignore patterns resolve as a
recipe's do; its ``device`` is where weights are quantized; ``converter`` (a dequantizer run first) is refused:
seqcal reads quantized sources itself.

Example:
    >>> ModelFreeArgs("llama", "out", scheme="W4A16", ignore=["lm_head"]).modifier().scheme  # doctest: +SKIP
    'W4A16'
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from seqcal.modifiers.quantization import QuantizationModifier
from seqcal.run_args import parse_bytes


@dataclass(frozen=True)
class ModelFreeArgs:
    """A model-free run.

    Attributes:
        model_stub: the source checkpoint directory (safetensors; a Hub id is resolved to its local snapshot).
        save_directory: the output directory (absent or empty, unless ``resume`` or ``overwrite``).
        scheme: a preset name ("W4A16", "W8A16", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16") or a
            compressed-tensors QuantizationScheme (or its dict).
        config: a compressed-tensors QuantizationConfig (or its dict) instead of ``scheme``.
        targets: what ``scheme`` applies to: class names or ``re:`` patterns on module names (default Linear).
        ignore: modules left in full precision (class names, names or ``re:`` patterns), e.g. ["lm_head"].
        max_workers: worker processes, each quantizing one source file at a time.
        max_host_memory: resident memory of all processes together to stay under ("64GB"); fewer workers run
            when the budget needs it, and a budget below one worker's need is refused before any work.
        device: where weights are quantized ("cpu", "cuda:0"); None: the cpu.
        resume: continue a killed run in ``save_directory`` (its finished files are kept).
        overwrite: replace what ``save_directory`` holds.
        trust_remote_code: let transformers build a class the checkpoint's code defines (only to read its modules).
        requantize: quantize an FP8 source to 8 bits again (refused by default: the two roundings compound).
        keep_source_format: write an FP8 source's Linears the scheme leaves alone in their stored FP8 form
            (``seqcal.modelfree.keep``), not dequantized.
    """

    model_stub: str | os.PathLike
    save_directory: str | os.PathLike
    scheme: Any = None
    config: Any = None
    targets: Sequence[str] = ("Linear",)
    ignore: Sequence[str] = field(default_factory=tuple)
    max_workers: int = 1
    max_host_memory: int | str | None = None
    device: str | None = None
    resume: bool = False
    overwrite: bool = False
    trust_remote_code: bool = False
    requantize: bool = False
    keep_source_format: bool = False

    def __post_init__(self) -> None:
        if (self.scheme is None) == (self.config is None):
            raise ValueError("model_free_ptq: give exactly one of scheme (e.g. 'W4A16') or config")
        if not isinstance(self.max_workers, int) or self.max_workers < 1:
            raise ValueError(f"model_free_ptq: max_workers must be a positive int, got {self.max_workers!r}")
        if self.resume and self.overwrite:
            raise ValueError("model_free_ptq: resume and overwrite exclude each other; pass one")
        parse_bytes(self.max_host_memory, "max_host_memory")  # a bad size is refused here, before any work

    @property
    def host_budget(self) -> int | None:
        """``max_host_memory`` in bytes."""
        return parse_bytes(self.max_host_memory, "max_host_memory")

    def modifier(self) -> QuantizationModifier:
        """The recipe modifier these arguments describe.

        Raises:
            ValueError: an unknown scheme, or one that needs calibration data (static activations, a KV cache).
        """
        targets = [self.targets] if isinstance(self.targets, str) else list(self.targets)
        ignore = [self.ignore] if isinstance(self.ignore, str) else list(self.ignore)
        try:  # the recipe's checks, named as this call's
            if isinstance(self.scheme, str):
                modifier = QuantizationModifier(scheme=self.scheme, targets=targets, ignore=ignore)
            elif self.scheme is not None:
                group = _as_dict(self.scheme)
                group["targets"] = group.get("targets") or targets
                modifier = QuantizationModifier(config_groups={"group_0": group}, ignore=ignore)
            else:
                config = _as_dict(self.config)
                if config.get("kv_cache_scheme") is not None:
                    raise ValueError("model_free_ptq: config.kv_cache_scheme needs calibration data, which model-free "
                                     "runs without; use oneshot with a dataset, or drop kv_cache_scheme")  # fmt: skip
                groups = {name: _as_dict(g) for name, g in (config.get("config_groups") or {}).items()}
                modifier = QuantizationModifier(
                    config_groups=groups, ignore=[*(config.get("ignore") or []), *ignore]
                )
        except ValueError as exc:
            raise ValueError(str(exc).replace("QuantizationModifier", "model_free_ptq", 1)) from None
        if modifier.needs_calibration:
            raise ValueError(
                "model_free_ptq: the scheme quantizes activations with static scales, which need calibration data "
                "(model-free reads no data); use a weight-only or dynamic scheme (W4A16, FP8_DYNAMIC, NVFP4A16), "
                "or oneshot with a dataset"
            )
        return modifier


def _as_dict(value: Any) -> dict[str, Any]:
    """A pydantic model (QuantizationScheme, QuantizationConfig) or a mapping, as a plain dict."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return dict(value)
    raise TypeError(
        f"model_free_ptq: expected a QuantizationScheme / QuantizationConfig or a dict, got {type(value).__name__}"
    )
