"""A quantized checkpoint read as a full-precision one, one tensor at a time.

``QuantizedCheckpoint`` lists the checkpoint's tensors from the safetensors headers alone (no weight is read),
asks the format's family (``fp8``, ``mxfp4``, ``compressed``, ``int_packed``) which stored tensors make each
weight (an FP8 ``weight`` and its ``weight_scale_inv``; gpt-oss's ``*_blocks`` and ``*_scales``; ...) and
checks them then, so a missing or misshapen scale is refused before any calibration. ``read`` dequantizes one
weight to the asked dtype exactly as transformers' own dequantizing load does; a weight stored with the experts'
index first (gpt-oss) is read one expert at a time (``experts``). Every other tensor is read as it is.

Example:
    >>> ckpt = QuantizedCheckpoint.open("DeepSeek-V3")  # doctest: +SKIP
    >>> ckpt.read("model.layers.3.mlp.experts.7.down_proj.weight", torch.bfloat16).dtype  # doctest: +SKIP
    torch.bfloat16
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from seqcal.sources.detect import detect_source
from seqcal.sources.format import Family, Infos, Part, SourceFormat, SourceFormatError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# reads one stored tensor: (safetensors file, key) -> tensor
Reader = Callable[[str, str], torch.Tensor]


def family_for(source: SourceFormat) -> Family:
    """The family that reads ``source``'s tensors."""
    if source.method == "fp8":
        from seqcal.sources.fp8 import Fp8Family

        return Fp8Family(source)
    if source.method == "mxfp4":
        from seqcal.sources.mxfp4 import Mxfp4Family

        return Mxfp4Family(source)
    if source.method == "compressed-tensors":
        from seqcal.sources.compressed import CompressedFamily

        return CompressedFamily(source)
    from seqcal.sources.int_packed import IntPackedFamily

    return IntPackedFamily(source)


def index_weight_map(path: str | Path) -> dict[str, str] | None:
    """Stored key -> shard file name (relative to ``path``) from ``model.safetensors.index.json``, every shard it
    names checked to be there; None when ``path`` has no index (one ``model.safetensors``, or no weights).

    Raises:
        SourceFormatError: the index has no weight_map, or names a shard that is not in the directory.
    """
    path = Path(path)
    index = path / INDEX_NAME
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise SourceFormatError(f"{index} has no weight_map; regenerate the index")
    missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
    if missing:
        raise SourceFormatError(f"{index}: the index names shard {missing[0]!r}"
                                f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}, which is "
                                f"not in {str(path)!r}; download the missing shards again")  # fmt: skip
    return weight_map


def checkpoint_files(path: str | Path) -> dict[str, str]:
    """Stored key -> the safetensors file holding it, from ``model.safetensors.index.json`` or the one file.

    Raises:
        SourceFormatError: the index has no weight_map or names a shard that is not in the directory.
        FileNotFoundError: no safetensors weights at all.
    """
    path = Path(path)
    weight_map = index_weight_map(path)
    if weight_map is not None:
        return {key: str(path / file) for key, file in weight_map.items()}
    single = path / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{path} has no model.safetensors(.index.json); seqcal reads weights with "
                                "safetensors only (convert .bin checkpoints with transformers' save_pretrained "
                                "first)")  # fmt: skip
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), str(single))


def read_infos(files: dict[str, str]) -> Infos:
    """Each stored key's dtype and shape, from the safetensors headers (no tensor data is read)."""
    infos: Infos = {}
    by_file: dict[str, list[str]] = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        with safe_open(file, framework="pt") as f:
            present = set(f.keys())
            for key in keys:
                if key not in present:
                    raise SourceFormatError(f"{file}: the index puts {key!r} in this shard, which does not "
                                            "hold it; restore the checkpoint's index or its shards")  # fmt: skip
                part = f.get_slice(key)
                infos[key] = (part.get_dtype(), tuple(part.get_shape()))
    return infos


class QuantizedCheckpoint:
    """A quantized checkpoint whose weights are read dequantized, one at a time.

    Args:
        path: the checkpoint directory (config.json and safetensors files).
        source: its format (``detect_source`` of its quantization_config).
        files: stored key -> safetensors file (default: ``checkpoint_files(path)``).
        read: reads one stored tensor (default: safetensors' read, copied out of the file's mapping;
            ``WeightStore`` passes ``read_tensor``, which reads into memory of the tensor's own).
    """

    def __init__(self, path: str | Path, source: SourceFormat, files: dict[str, str] | None = None,
                 read: Reader | None = None) -> None:  # fmt: skip
        self.path, self.source, self._read = Path(path), source, read or _read_copy
        self.files = files if files is not None else checkpoint_files(path)
        self.infos = read_infos(self.files)
        self.family = family_for(source)
        self.parts = self.family.parts(self.infos)
        consumed = {k for part in self.parts.values() for k in part.keys}
        # the weights as a full-precision checkpoint names them: dequantized ones and every tensor not consumed
        self.plain = [k for k in self.files if k not in consumed]

    @classmethod
    def open(cls, path: str | Path) -> QuantizedCheckpoint:
        """The checkpoint in ``path``, its format read from config.json (a full-precision one is refused)."""
        source = source_format(path)
        if source is None:
            raise SourceFormatError(f"{Path(path) / 'config.json'} has no quantization_config: {str(path)!r} "
                                    "holds full-precision weights; read them with safetensors as they are")  # fmt: skip
        return cls(path, source)

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint as its full-precision form would name it."""
        return list(self.parts) + self.plain

    def is_quantized(self, name: str) -> bool:
        """Whether ``name`` is a weight stored quantized (dequantized by ``read``)."""
        return name in self.parts

    def file_of(self, name: str) -> str:
        """The safetensors file holding ``name`` (its data tensor for a quantized weight)."""
        part = self.parts.get(name)
        return self.files[part.keys[0] if part else name]

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name``: a quantized weight dequantized to ``dtype``, any other tensor as stored (floating
        point ones cast to ``dtype``)."""
        part = self.parts.get(name)
        if part is None:
            if name not in self.files:
                raise KeyError(f"{self.path}: no tensor {name!r} in the checkpoint")
            tensor = self._read(self.files[name], name)
            return tensor.to(dtype) if tensor.is_floating_point() else tensor
        tensors = {key: self._read(self.files[key], key) for key in part.keys}
        return self.family.dequantize(name, tensors, dtype)

    def read_stored(self, key: str) -> torch.Tensor:
        """Stored tensor ``key`` as the file holds it (a quantized weight's codes or scales, not dequantized)."""
        if key not in self.files:
            raise KeyError(f"{self.path}: no stored tensor {key!r} in the checkpoint")
        return self._read(self.files[key], key)

    def experts(self, name: str, dtype: torch.dtype) -> ExpertSlices:
        """A stacked weight indexed by expert (``[e]``): each index reads and dequantizes one expert only."""
        part = self.parts[name]
        return ExpertSlices(lambda e: self._expert(name, part, e, dtype))

    def _expert(self, name: str, part: Part, e: int, dtype: torch.dtype) -> torch.Tensor:
        tensors = {}
        for key in part.keys:
            with safe_open(self.files[key], framework="pt") as f:
                tensors[key] = f.get_slice(key)[e : e + 1]  # this expert's bytes only
        return self.family.dequantize(name, tensors, dtype)[0]


def source_format(path: str | Path) -> SourceFormat | None:
    """The stored format of the checkpoint in directory ``path`` (None: full precision, or no config.json)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text(encoding="utf-8"))
    return detect_source(data.get("quantization_config") if isinstance(data, dict) else None, str(config))


def quantized_source(path: str | Path, read: Reader | None = None) -> QuantizedCheckpoint | None:
    """The checkpoint in ``path`` opened for dequantized reads when it is quantized, else None."""
    source = source_format(path)
    return QuantizedCheckpoint(path, source, read=read) if source is not None else None


def _read_copy(file: str, key: str) -> torch.Tensor:
    """Tensor ``key`` of ``file``, copied out of safetensors' mapping of the file (which then goes)."""
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(key).clone()


class ExpertSlices:
    """Stands for a fused tensor's safetensors slice where ``seqcal.experts.store`` reads one expert (``[e]``)."""

    def __init__(self, read: Callable[[int], torch.Tensor]) -> None:
        self._read = read

    def __getitem__(self, e: int) -> torch.Tensor:
        return self._read(e)


def dequantize_weight(path: str | Path, name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One named weight of a quantized checkpoint, dequantized to ``dtype``, reading only its own tensors.

    The values are those transformers' dequantizing load gives (``FineGrainedFP8Config(dequantize=True)``,
    ``Mxfp4Config(dequantize=True)``, compressed-tensors decompression), bit for bit. For many weights of one
    checkpoint, open it once with ``QuantizedCheckpoint.open(path)`` and call ``read(name, dtype)``: each call
    then reads only that weight's tensors, with the headers read once.

    Args:
        path: a checkpoint directory whose config.json has a quantization_config (FP8 block or per tensor,
            MXFP4, compressed-tensors, AutoAWQ, GPTQ).
        name: the weight's name as the full-precision checkpoint names it
            (``model.layers.0.self_attn.q_a_proj.weight``, not its ``weight_scale_inv``).
        dtype: the dtype of the result.

    Returns:
        The weight, shaped as in the full-precision model (``[out, in]`` for a Linear); a tensor the checkpoint
        stores unquantized (norms, embeddings) comes back as stored, cast to ``dtype`` when floating point.

    Raises:
        SourceFormatError: an unknown quant_method, a scale missing or of the wrong shape, a missing shard.
        KeyError: no such tensor.

    Example:
        >>> w = dequantize_weight("DeepSeek-V3", "model.layers.0.mlp.down_proj.weight")  # doctest: +SKIP
        >>> w.shape, w.dtype  # doctest: +SKIP
        (torch.Size([7168, 18432]), torch.bfloat16)
    """
    return QuantizedCheckpoint.open(path).read(name, dtype)
