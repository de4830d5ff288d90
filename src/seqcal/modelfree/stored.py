"""A quantized source read as a full-precision one: FP8 checkpoints (DeepSeek-V3's and Kimi-K2's 128 x 128
blocks, per-tensor FP8) whose weights a model-free run quantizes again, to NVFP4 or W4A16.

``seqcal.sources`` knows which stored tensors make each weight (``weight`` and ``weight_scale_inv``) and
dequantizes one weight exactly as transformers' dequantizing load does; this module presents the source as the
full-precision checkpoint those weights make (the weight's key, the model's dtype, the scales gone), so the plan,
the skeleton and ``config.json`` see what ``oneshot`` sees, and the workers read each weight dequantized.

Example:
    >>> info, stored = dequantized_view(Path("DeepSeek-V3"), info, config)  # doctest: +SKIP
    >>> info["model.layers.3.mlp.experts.7.down_proj.weight"].dtype  # doctest: +SKIP
    'BF16'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from seqcal.execution.store import read_tensor

# torch dtype names -> safetensors', for the dequantized weights' headers
_SAFETENSORS_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass(frozen=True)
class Stored:
    """How a worker reads the source's tensors: as stored, or a quantized weight dequantized.

    Attributes:
        source_format: the source's stored format (``seqcal.sources.SourceFormat``), None for full precision.
        dtype: the dtype weights are dequantized to (the model's: config.json's ``dtype``).
        parts: weight key -> ((stored key, file), ...) the weight is made of, for every quantized weight.
    """

    source_format: Any = None
    dtype: str = "bfloat16"
    parts: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)

    def read(self, source_dir: Path, key: str, file: str) -> Tensor:
        """Tensor ``key`` of ``file`` as stored, or the quantized weight ``key`` dequantized."""
        part = self.parts.get(key)
        if part is None:
            return read_tensor(str(source_dir / file), key)
        from seqcal.sources.checkpoint import family_for

        tensors = {k: read_tensor(str(source_dir / f), k) for k, f in part}
        return family_for(self.source_format).dequantize(key, tensors, getattr(torch, self.dtype))

    def subset(self, keys: set[str]) -> Stored:
        """The same reader knowing only ``keys``' parts (what one job sends to its worker)."""
        return Stored(self.source_format, self.dtype, {k: p for k, p in self.parts.items() if k in keys})


def dequantized_view(
    root: Path, info: dict[str, Any], config: dict[str, Any]
) -> tuple[dict[str, Any], Stored]:
    """The source's tensors as its full-precision form has them, and the reader of its quantized weights.

    Args:
        root: the checkpoint directory.
        info: stored key -> ``TensorInfo`` from the headers.
        config: config.json's content.

    Returns:
        (key -> TensorInfo with each quantized weight under its own key in the model's dtype and its scales gone,
        the reader); ``(info, Stored())`` for a full-precision source.

    Raises:
        SourceError: a quantized format other than FP8 (``oneshot`` reads those), or scales missing or misshapen.
    """
    from seqcal.modelfree.source import SourceError, TensorInfo
    from seqcal.sources.checkpoint import QuantizedCheckpoint
    from seqcal.sources.detect import detect_source

    fmt = detect_source(config.get("quantization_config"), str(root / "config.json"))
    if fmt is None:
        return info, Stored()
    if fmt.method != "fp8":
        raise SourceError(
            f"model-free: {root} is stored as {fmt.name}, and model-free reads FP8 sources only (DeepSeek's and "
            "Kimi's blocks); quantize it with oneshot, which reads it, or start from the unquantized model"
        )
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    if dtype not in _SAFETENSORS_NAMES:
        raise SourceError(f"model-free: {root / 'config.json'} has dtype {dtype!r}; set it to bfloat16, float16 or "
                          "float32, the dtype its FP8 weights are dequantized to")  # fmt: skip
    checkpoint = QuantizedCheckpoint(root, fmt, files={k: str(root / t.file) for k, t in info.items()})
    view = dict(info)
    parts = {}
    for name, part in checkpoint.parts.items():
        data = info[part.keys[0]]
        for key in part.keys:
            view.pop(key, None)
        view[name] = TensorInfo(data.file, _SAFETENSORS_NAMES[dtype], data.shape)
        parts[name] = tuple((key, info[key].file) for key in part.keys)
    return view, Stored(fmt, dtype, parts)
