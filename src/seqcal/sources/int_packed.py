"""Integer weights packed in int32 words: AutoAWQ GEMM (``quant_method: awq``) and GPTQ (``gptq``).

AutoAWQ stores ``qweight`` ``[in, out / 8]`` (its own nibble order), ``qzeros`` ``[groups, out / 8]`` and
``scales`` ``[groups, out]``; compressed-tensors' ``AutoAWQConverter`` turns one module's tensors into its
pack-quantized form and its compressor decompresses them, so seqcal reads AutoAWQ exactly as a compressed-tensors
W4A16 asymmetric checkpoint converted from it.

GPTQ (AutoGPTQ / GPTQModel) stores ``qweight`` ``[in / (32 / bits), out]`` packed along the inputs, low bits
first, ``qzeros`` ``[groups, out / (32 / bits)]`` packed along the outputs, ``scales`` ``[groups, out]`` and
``g_idx`` ``[in]`` (the group of each input column, in any order with ``desc_act``). The weight is
``(q - z[g_idx]) * scales[g_idx]`` in the scales' dtype, with ``z`` the stored zero plus one in GPTQ's original
format (``checkpoint_format: gptq``; ``gptq_v2`` stores it as it is). compressed-tensors has no GPTQ converter
and transformers' needs the GPTQModel kernels package, hence the few lines here.
"""

from __future__ import annotations

import torch

from seqcal.sources.format import Infos, Part, SourceFormat, SourceFormatError

WORD = 32


class IntPackedFamily:
    """``qweight`` + ``scales`` (+ ``qzeros``, ``g_idx``) per Linear."""

    def __init__(self, source: SourceFormat) -> None:
        self.method, self.config, self.bits = source.method, source.config, source.weight_bits
        self.group = int(self.config.get("group_size", self.config.get("q_group_size", 128)))
        if self.method == "awq":
            from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

            self.awq = AutoAWQConverter.from_autoawq_config(self.config)
            self.scheme = next(iter(self.awq.update_config(None).config_groups.values()))

    def parts(self, infos: Infos) -> dict[str, Part]:
        parts = {}
        for key, (_, shape) in infos.items():
            if not key.endswith(".qweight"):
                continue
            module = key.removesuffix(".qweight")
            optional = ("g_idx",) if self.method == "gptq" else ()
            needed = ("scales", "qzeros") if self.method == "gptq" or self.awq.zero_point else ("scales",)
            missing = [n for n in needed if f"{module}.{n}" not in infos]
            if missing:
                raise SourceFormatError(f"{key} has no {module}.{missing[0]} beside it; the checkpoint is "
                                        "incomplete: download it again")  # fmt: skip
            self._check(module, shape, infos)
            keys = [key, *(f"{module}.{n}" for n in (*needed, *optional) if f"{module}.{n}" in infos)]
            parts[f"{module}.weight"] = Part(tuple(keys))
        return parts

    def _check(self, module: str, qweight: tuple[int, ...], infos: Infos) -> None:
        """The scales: one row per group of inputs, one column per output."""
        per = WORD // self.bits
        inputs, outputs = (
            (qweight[0], qweight[1] * per) if self.method == "awq" else (qweight[0] * per, qweight[1])
        )
        scales = infos[f"{module}.scales"][1]
        want = [-(-inputs // self.group) if self.group > 0 else 1, outputs]
        if list(scales) != want:
            raise SourceFormatError(f"{module}.scales has shape {list(scales)}, expected {want} ({inputs} inputs "
                                    f"in groups of {self.group}, {outputs} outputs, from qweight "
                                    f"{list(qweight)}); check group_size in config.json or the file")  # fmt: skip

    def dequantize(self, name: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        module = name.removesuffix(".weight")
        local = {key.removeprefix(module + "."): t for key, t in tensors.items()}
        if self.method == "awq":
            from compressed_tensors.compressors import BaseCompressor

            converted = self.awq.process({f"m.{k}": t for k, t in local.items()})
            state = {k.removeprefix("m."): t for k, t in converted.items()}
            compressor = BaseCompressor.get_value_from_registry(self.scheme.format)
            return compressor.decompress(state, self.scheme)["weight"].to(dtype)
        return self._gptq(local, dtype)

    def _gptq(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q = unpack_int32(t["qweight"], self.bits, dim=0)  # [in, out]
        zeros = unpack_int32(t["qzeros"], self.bits, dim=1)  # [groups, out]
        if self.config.get("checkpoint_format", "gptq") == "gptq":
            zeros = zeros + 1  # GPTQ's original format stores the zero point minus one
        g_idx = t.get("g_idx")
        if g_idx is None:
            g_idx = torch.arange(q.shape[0]) // self.group
        g_idx = g_idx.long()
        scales = t["scales"]
        w = (q - zeros[g_idx]).to(scales.dtype) * scales[g_idx]  # [in, out]
        return w.T.contiguous().to(dtype)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-bit values packed low bits first in int32 words along ``dim`` (the result is wider there)."""
    shifts = torch.arange(0, WORD, bits, dtype=torch.int32)
    moved = packed.to(torch.int32).movedim(dim, -1)
    values = (moved[..., None] >> shifts) & ((1 << bits) - 1)  # [..., words, per word]
    return values.reshape(*moved.shape[:-1], -1).movedim(-1, dim)
