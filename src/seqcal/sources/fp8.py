"""FP8 weights with ``weight_scale_inv`` (``quant_method: fp8``): DeepSeek-V3/R1, Kimi-K2, Qwen3/GLM FP8.

Each quantized Linear stores ``weight`` (float8 e4m3) and ``weight_scale_inv`` (float32; DeepSeek-V3.1 and
later round the scales to powers of two, ``scale_fmt: ue8m0``, some store them as float8_e8m0fnu or as their
exponent bytes): one scale per ``weight_block_size`` block (128 x 128; a partial block at the edge has its own
scale), or one per tensor without a block size. The weight is ``fp8 * scale`` in float32, cast to the dtype,
as transformers' ``FineGrainedFP8Config(dequantize=True)`` computes it; blocks are taken from the bits
(``seqcal.sources.fp8_bits``: the same values, without torch's slow float8 cast) or, where that would not be
exact, through compressed-tensors' ``FP8BlockDequantizer`` (which pads the partial blocks); a single scale is one
product here.
"""

from __future__ import annotations

import math

import torch
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

from seqcal.sources.format import Infos, Part, SourceFormat, SourceFormatError
from seqcal.sources.fp8_bits import blocks_times_scales, exact_by_bits

FP8_DTYPES = ("F8_E4M3",)
# Elements dequantized at once (whole rows of blocks): the product is taken in float32, so DeepSeek-V3's dense MLP
# weight (18432 x 7168) would otherwise hold 1 GB of float32 beside its bf16 result; in chunks it holds ~70 MB.
# Each value is the same product, so the chunks change no bit.
CHUNK_ELEMENTS = 8 << 20
SCALE = ".weight_scale_inv"


class Fp8Family:
    """``weight`` + ``weight_scale_inv`` per module (see the module's docstring)."""

    def __init__(self, source: SourceFormat) -> None:
        block = source.config.get("weight_block_size")
        self.block = tuple(block) if block is not None else None

    def parts(self, infos: Infos) -> dict[str, Part]:
        parts = {}
        for key, (_, shape) in infos.items():
            if key.endswith(SCALE):
                weight = key.removesuffix(SCALE) + ".weight"
                if weight not in infos:
                    raise SourceFormatError(f"{key} has no weight {weight!r} beside it; the checkpoint is "
                                            "incomplete: download it again")  # fmt: skip
                self._check(weight, infos[weight][1], key, shape)
                parts[weight] = Part((weight, key))
        for key, (dtype, _) in infos.items():
            if dtype in FP8_DTYPES and key not in parts:
                raise SourceFormatError(f"{key} is stored in FP8 but its scale {scale_key(key)} is missing; the "
                                        "checkpoint is incomplete: download it again")  # fmt: skip
        return parts

    def _check(self, weight: str, shape: tuple[int, ...], key: str, scale: tuple[int, ...]) -> None:
        """The scale's shape: one per block over the last two dimensions, or a single one."""
        if len(shape) < 2:
            raise SourceFormatError(f"{weight} has shape {list(shape)}; an FP8 weight with {key} is 2-D")
        if self.block is None:
            expected = [math.prod(scale) == 1, list(scale) == [*shape[:-1], 1]]
            want = "a single value (per tensor) or one per row"
        else:
            grid = [*shape[:-2], *(math.ceil(n / b) for n, b in zip(shape[-2:], self.block))]
            expected = [list(scale) == grid]
            want = f"{grid} (one per {self.block[0]} x {self.block[1]} block of {list(shape)})"
        if not any(expected):
            raise SourceFormatError(f"{key} has shape {list(scale)}, expected {want}; the checkpoint's scales do "
                                    "not match its weight_block_size: check config.json or the file")  # fmt: skip

    def dequantize(self, name: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        weight, scale = tensors[name], scale_float32(tensors[scale_key(name)])
        if self.block is None or scale.numel() == 1:  # one scale per tensor, or per row
            scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(*weight.shape[:-1], 1)
            return (weight.to(torch.float32) * scale).to(dtype)
        flat_w, flat_s = weight.reshape(-1, *weight.shape[-2:]), scale.reshape(-1, *scale.shape[-2:])
        out = torch.empty(flat_w.shape, dtype=dtype)
        if exact_by_bits(weight, scale):  # the same values, about 7x faster than the float8 cast (fp8_bits)
            for w, s, o in zip(flat_w, flat_s, out):
                blocks_times_scales(w, s, self.block, dtype, out=o)
            return out.reshape(weight.shape)
        converter = FP8BlockDequantizer(targets=["w"], weight_block_size=self.block, dtype=dtype)
        block_rows = self.block[0]
        rows = max(1, CHUNK_ELEMENTS // (weight.shape[-1] * block_rows)) * block_rows  # whole row blocks
        for w, s, o in zip(flat_w, flat_s, out):
            for r0 in range(0, w.shape[0], rows):
                chunk = {
                    "w.weight": w[r0 : r0 + rows],
                    "w.weight_scale_inv": s[r0 // block_rows :][: rows // block_rows],
                }
                o[r0 : r0 + rows] = converter.process(chunk)["w.weight"]
        return out.reshape(weight.shape)


def scale_key(weight: str) -> str:
    """The stored name of weight ``weight``'s scales (``...weight`` -> ``...weight_scale_inv``)."""
    return weight.removesuffix(".weight") + SCALE


def scale_float32(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32: e8m0 exponent bytes (uint8) are ``2 ** (byte - 127)``, as transformers reads them."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)
