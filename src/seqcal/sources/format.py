"""What the readers of quantized checkpoints share: the stored format, its error, and how a weight is stored.

``SourceFormat`` names a checkpoint's format (``seqcal.sources.detect`` reads it from config.json); each family of
formats (``fp8``, ``mxfp4``, ``compressed``, ``int_packed``) says which stored tensors make each weight (``Part``)
and combines them (``Family``); ``seqcal.sources.checkpoint`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from seqcal.errors import ModelLoadError


class SourceFormatError(ModelLoadError, ValueError):
    """A quantized checkpoint seqcal cannot read as it is: an unknown method, a missing or misshapen tensor
    (a ModelLoadError, which the loader passes on with its message as it is; a ValueError, as the other checks
    of the model directory raise)."""


@dataclass(frozen=True)
class SourceFormat:
    """The stored form of a checkpoint's quantized weights.

    Attributes:
        method: the config's ``quant_method`` ("fp8", "mxfp4", "compressed-tensors", "awq", "gptq").
        name: the format, e.g. "fp8-block", "fp8-block-ue8m0", "fp8-tensor", "mxfp4", "nvfp4",
            "int4-pack-quantized", "int8-int-quantized", "fp8-float-quantized", "awq-int4", "gptq-int4".
        weight_bits: bits per stored weight value (the lowest over the checkpoint's groups).
        weight_type: "float" or "int".
        config: the ``quantization_config`` as read.
    """

    method: str
    name: str
    weight_bits: int
    weight_type: str
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def record(self) -> dict[str, Any]:
        """What the output's ``quantization_config`` and report say about the source (JSON-ready)."""
        return {"quant_method": self.method, "format": self.name, "weight_bits": self.weight_bits,
                "weight_type": self.weight_type}  # fmt: skip


# stored key -> (safetensors dtype name, shape), from the files' headers
Infos = dict[str, tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class Part:
    """The stored tensors one weight is made of.

    Attributes:
        keys: the stored keys the family's ``dequantize`` reads (the data first, then scales, zero points, ...).
        stacked: the data's first dimension is the experts' index (read one expert's slice at a time).
    """

    keys: tuple[str, ...]
    stacked: bool = False


class Family(Protocol):
    """How one family of formats stores a weight: which tensors (``parts``) and how they combine."""

    def parts(self, infos: Infos) -> dict[str, Part]:
        """Weight name -> its Part, for every quantized weight; raises SourceFormatError for a tensor missing
        or of the wrong shape (one sentence, naming the tensor and what was expected)."""
        ...

    def dequantize(self, name: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Weight ``name`` from its stored tensors (by key; for a stacked part, one expert's slice with the
        experts' dimension kept, of size 1), in ``dtype``."""
        ...
