"""compressed-tensors checkpoints (W4A16 pack-quantized, W8A8 int-quantized, FP8 float-quantized, NVFP4, MX).

Each config group's compressor (compressed-tensors' registry, by the group's format) names the tensors a
quantized module stores (``compression_param_names``: ``weight_packed``, ``weight_scale``, ``weight_shape``,
...) and decompresses one module's tensors (``decompress``): seqcal asks it per weight, as compressed-tensors'
own ``CompressedTensorsDequantizer`` does per file, and casts the result to the run's dtype. Modules are matched
to groups with compressed-tensors' own name matching (``match_quantizable_tensors``), targets and ignore as in
the config. Online rotations (``transform_config``) and sparse formats are refused: the stored weights alone
are not the model's.
"""

from __future__ import annotations

import math
from typing import Any

import pydantic
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.utils.match import match_quantizable_tensors

from seqcal.sources.format import Infos, Part, SourceFormat, SourceFormatError

# compressed-tensors format -> the short name seqcal records (with the weights' type and bits)
FORMAT_NAMES = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4", "mxfp8-quantized": "mxfp8"}


def parse_config(quant: dict[str, Any], where: str) -> QuantizationConfig:
    """compressed-tensors' own reading of the block, with each group's format filled in as it infers it."""
    try:
        config = QuantizationConfig.model_validate(quant)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        raise SourceFormatError(f"{where}: quantization_config is not a valid compressed-tensors config "
                                f"({'.'.join(map(str, first['loc']))}: {first['msg']}); restore config.json") from err  # fmt: skip
    for scheme in config.config_groups.values():
        if scheme.format is None:
            scheme.format = config.format if config.format not in (None, "mixed-precision") else None
        scheme.format = scheme.format or infer_module_format(torch.nn.Linear, scheme)
    return config


def compressed_format(quant: dict[str, Any], where: str) -> SourceFormat:
    """The SourceFormat of a compressed-tensors block: its lowest-precision group's weights."""
    if quant.get("transform_config"):
        raise SourceFormatError(f"{where}: the checkpoint applies online rotations (transform_config), so its "
                                "stored weights alone are not the model's; start from the model before rotation")  # fmt: skip
    sparsity = (quant.get("sparsity_config") or {}).get("format", "dense")
    if sparsity not in ("dense", None):
        raise SourceFormatError(f"{where}: weights stored in the sparse format {sparsity!r}, which seqcal does "
                                "not read; start from the dense model")  # fmt: skip
    config = parse_config(quant, where)
    schemes = [s for s in config.config_groups.values() if s.weights is not None]
    if not schemes:
        raise SourceFormatError(f"{where}: a compressed-tensors quantization_config without quantized weights "
                                "(no config_groups with weights); remove it to read the model as full precision")  # fmt: skip
    low = min(schemes, key=lambda s: s.weights.num_bits)
    kind = "float" if low.weights.type == "float" else "int"
    fmt = str(getattr(low.format, "value", low.format))
    name = FORMAT_NAMES.get(fmt, f"{'fp' if kind == 'float' else 'int'}{low.weights.num_bits}-{fmt}")
    return SourceFormat("compressed-tensors", name, int(low.weights.num_bits), kind, quant)


class CompressedFamily:
    """Modules matched to config groups; their tensors decompressed by the group's compressor."""

    def __init__(self, source: SourceFormat) -> None:
        self.config = parse_config(source.config, "config.json")
        self.scheme_of: dict[str, QuantizationScheme] = {}

    def parts(self, infos: Infos) -> dict[str, Part]:
        parts: dict[str, Part] = {}
        for scheme in self.config.config_groups.values():
            if scheme.weights is None:
                continue
            compressor = BaseCompressor.get_value_from_registry(scheme.format)
            names = compressor.compression_param_names(scheme)
            for module, _ in match_quantizable_tensors(infos, ignore=self.config.ignore or [],
                                                       targets=scheme.targets, param_targets=[names[0]]):  # fmt: skip
                if f"{module}.weight" in parts or not _stored_quantized(module, names[0], infos):
                    continue  # the first group that targets it, as compressed-tensors resolves it
                keys = [f"{module}.{n}" for n in names if n.startswith("weight") or f"{module}.{n}" in infos]
                missing = [k for k in keys if k not in infos]
                if missing:
                    raise SourceFormatError(f"{missing[0]} is missing: {module} is quantized "
                                            f"({scheme.format}) and stores {', '.join(names)}; the checkpoint "
                                            "is incomplete: download it again")  # fmt: skip
                _check_scale(module, scheme, infos)
                parts[f"{module}.weight"] = Part(tuple(keys))
                self.scheme_of[f"{module}.weight"] = scheme
        return parts

    def dequantize(self, name: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        scheme = self.scheme_of[name]
        module = name.removesuffix(".weight")
        local = {key.removeprefix(module + "."): t for key, t in tensors.items()}
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        return compressor.decompress(local, scheme)["weight"].to(dtype)


def _stored_quantized(module: str, root: str, infos: Infos) -> bool:
    """Whether ``module``'s data tensor is stored quantized: ``weight_packed`` always is; a plain ``weight``
    (naive formats) is when it is integer or FP8. Names alone cannot tell an Embedding's weight from a Linear's
    where a group targets the class "Linear"; a floating point ``weight`` without a scale is a module left
    unquantized."""
    return root != "weight" or infos[f"{module}.weight"][0] not in ("BF16", "F16", "F32")


# stored weights per byte/element of the data tensor: packed int32 holds 32 / bits, packed fp4 bytes hold 2
def _per_element(dtype: str, bits: int) -> int:
    return {"I32": 32 // bits, "U8": 8 // bits if bits < 8 else 1}.get(dtype, 1)


def _check_scale(module: str, scheme: QuantizationScheme, infos: Infos) -> None:
    """The weight scale has a row per output row and, per group, one column per group of inputs."""
    data = next(infos[f"{module}.{n}"] for n in ("weight_packed", "weight") if f"{module}.{n}" in infos)
    scale_key = f"{module}.weight_scale"
    scale = infos[scale_key][1]
    rows, stored_cols = data[1][0], data[1][-1]
    cols = stored_cols * _per_element(data[0], scheme.weights.num_bits)
    group = scheme.weights.group_size
    if math.prod(scale) == 1:
        return  # one scale for the tensor
    ok = len(scale) == 2 and scale[0] == rows
    if ok and group:  # packing rounds the columns up to a whole element: the last group may be partial
        per = _per_element(data[0], scheme.weights.num_bits)
        ok = math.ceil((cols - per + 1) / group) <= scale[1] <= math.ceil(cols / group)
    if not ok:
        want = f"[{rows}, {math.ceil(cols / group)}]" if group else f"[{rows}, 1]"
        raise SourceFormatError(f"{scale_key} has shape {list(scale)}, expected {want} for {module}'s stored "
                                f"weight of shape {list(data[1])}; the checkpoint's scales do not match its "
                                "config: check config.json or the file")  # fmt: skip
