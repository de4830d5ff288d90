"""gpt-oss's MXFP4 experts (``quant_method: mxfp4``): ``*_blocks`` and ``*_scales`` per fused expert tensor.

``gate_up_proj_blocks`` is ``[experts, rows, groups, 16]`` bytes, two e2m1 values each (low nibble first), and
``gate_up_proj_scales`` ``[experts, rows, groups]``, one e8m0 exponent (``2 ** (byte - 127)``) per group of 32;
the weight is the ``[experts, inputs, rows]`` tensor the model holds. The dequantization is transformers' own
(``convert_moe_packed_tensors``, what ``Mxfp4Config(dequantize=True)`` runs), called on one expert's slice at a
time: compressed-tensors' MXFP4 compressor reads its own layout (``weight_packed`` per Linear), not this one.
Attention, router and embeddings are stored in bf16 and read as they are.
"""

from __future__ import annotations

import torch

from seqcal.sources.format import Infos, Part, SourceFormat, SourceFormatError

BLOCKS, SCALES = "_blocks", "_scales"


class Mxfp4Family:
    """``P_blocks`` + ``P_scales`` -> ``P`` (see the module's docstring)."""

    def __init__(self, source: SourceFormat) -> None:
        self.source = source

    def parts(self, infos: Infos) -> dict[str, Part]:
        parts = {}
        for key, (_, shape) in infos.items():
            if key.endswith(SCALES) and key.removesuffix(SCALES) + BLOCKS not in infos:
                raise SourceFormatError(f"{key} has no {key.removesuffix(SCALES) + BLOCKS!r} beside it; the "
                                        "checkpoint is incomplete: download it again")  # fmt: skip
            if not key.endswith(BLOCKS):
                continue
            name = key.removesuffix(BLOCKS)
            scales = name + SCALES
            if scales not in infos:
                raise SourceFormatError(f"{key} is stored in MXFP4 but its scales {scales!r} are missing; the "
                                        "checkpoint is incomplete: download it again")  # fmt: skip
            if len(shape) != 4 or infos[scales][1] != shape[:-1]:
                raise SourceFormatError(f"{scales} has shape {list(infos[scales][1])}, expected {list(shape[:-1])} "
                                        f"(one per group of {key}'s {list(shape)}: experts, rows, groups, 16 "
                                        "bytes); check the file")  # fmt: skip
            parts[name] = Part((key, scales), stacked=True)
        return parts

    def dequantize(self, name: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        return convert_moe_packed_tensors(tensors[name + BLOCKS], tensors[name + SCALES], dtype=dtype)
