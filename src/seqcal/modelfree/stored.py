"""A quantized source read as a full-precision one: FP8 checkpoints (DeepSeek-V3's and Kimi-K2's 128 x 128
blocks, per-tensor FP8) whose weights a model-free run quantizes again, to NVFP4 or W4A16.

``seqcal.sources`` knows which stored tensors make each weight (``weight`` and ``weight_scale_inv``) and
dequantizes one weight exactly as transformers' dequantizing load does; ``read_stored`` gives the reader the
workers use, and ``SourceCheckpoint.open`` shows the source as the full-precision checkpoint those weights make
(the weight's key, the model's dtype, the scales gone), so the plan, the skeleton and ``config.json`` see what
``oneshot`` sees.

Example:
    >>> stored = read_stored(Path("DeepSeek-V3"), files, config)  # doctest: +SKIP
    >>> stored.parts["model.layers.3.mlp.experts.7.down_proj.weight"]  # doctest: +SKIP
    (('model.layers.3.mlp.experts.7.down_proj.weight', 'model-00009-of-000163.safetensors'), ...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from seqcal.checkpoint.shard_file import _ShardFile
from seqcal.modelfree.memory import COPY_BUFFER
from seqcal.sources.files import FileCopy, read_tensor, stored_pieces, stored_span

# torch dtype names -> safetensors', for the dequantized weights' headers
SAFETENSORS_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


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

    def copy(
        self, source_dir: Path, key: str, file: str, shard: _ShardFile, dtype: str | None = None
    ) -> None:
        """Write tensor ``key`` of ``file`` to ``shard`` as stored, or cast to ``dtype`` (a torch dtype name) when
        given, through a buffer of ``COPY_BUFFER`` bytes (an embedding of a giant is gigabytes); a quantized weight
        dequantized."""
        path, pieces = str(source_dir / file), None
        # a quantized weight is read into memory, dequantized; so is a dtype or byte order read through safetensors
        if key not in self.parts and stored_span(path, key) is not None:
            cast = FileCopy(path, key, getattr(torch, dtype)) if dtype is not None else None
            pieces = cast.pieces(COPY_BUFFER) if cast else stored_pieces(path, key, COPY_BUFFER)
        if pieces is None:
            tensor = self.read(source_dir, key, file)
            shard.add(key, tensor if dtype is None else tensor.to(getattr(torch, dtype)))
        else:
            shard.add_pieces(key, *pieces)

    def subset(self, keys: set[str]) -> Stored:
        """The same reader knowing only ``keys``' parts (what one job sends to its worker)."""
        return Stored(self.source_format, self.dtype, {k: p for k, p in self.parts.items() if k in keys})


def read_stored(root: Path, files: dict[str, str], config: dict[str, Any]) -> Stored:
    """The reader of the source's quantized weights: which stored tensors make each (checked from the headers by
    ``seqcal.sources``), and the dtype they are dequantized to; ``Stored()`` for a full-precision source.

    Args:
        root: the checkpoint directory.
        files: stored key -> its file's name.
        config: config.json's content.

    Raises:
        ValueError: a quantized format other than FP8 (``oneshot`` reads those), a dtype that is not a float one,
            or scales missing or misshapen.
    """
    from seqcal.sources.checkpoint import QuantizedCheckpoint
    from seqcal.sources.detect import detect_source

    fmt = detect_source(config.get("quantization_config"), str(root / "config.json"))
    if fmt is None:
        return Stored()
    if fmt.method != "fp8":
        raise ValueError(
            f"model-free: {root} is stored as {fmt.name}, and model-free reads FP8 sources only (DeepSeek's and "
            "Kimi's blocks); quantize it with oneshot, which reads it, or start from the unquantized model"
        )
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    if dtype not in SAFETENSORS_NAMES:
        raise ValueError(f"model-free: {root / 'config.json'} has dtype {dtype!r}; set it to bfloat16, float16 or "
                         "float32, the dtype its FP8 weights are dequantized to")  # fmt: skip
    checkpoint = QuantizedCheckpoint(root, fmt, files={k: str(root / f) for k, f in files.items()})
    parts = {name: tuple((key, files[key]) for key in part.keys) for name, part in checkpoint.parts.items()}
    return Stored(fmt, dtype, parts)
