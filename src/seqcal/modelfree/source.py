"""The source checkpoint of a model-free run: its safetensors files and what each tensor is, from the headers.

Nothing here reads a tensor's data: a 1.6 TB checkpoint is described by its index and the JSON headers of its
shards (a few MB), so every check runs before any weight is read.

Example:
    >>> source = SourceCheckpoint.open("Kimi-K2")  # doctest: +SKIP
    >>> source.info["model.layers.3.mlp.experts.17.down_proj.weight"].shape  # doctest: +SKIP
    (7168, 2048)
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from seqcal.modelfree.stored import SAFETENSORS_NAMES, Stored, read_stored
from seqcal.sources.checkpoint import INDEX_NAME, SINGLE_FILE, index_weight_map
from seqcal.sources.format import SourceFormatError

# safetensors' dtype names -> bytes per element (header sizes without reading data)
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I64": 8, "I32": 4,
    "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F4": 1, "F6_E2M3": 1, "F6_E3M2": 1,
}  # fmt: skip


class SourceError(ValueError):
    """The source checkpoint cannot be read as a model-free run needs it (the message says why and the fix)."""


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor, from its file's header.

    Attributes:
        file: the shard's file name (relative to the checkpoint directory).
        dtype: safetensors' dtype name ("BF16", "F8_E4M3", ...).
        shape: the tensor's shape.
    """

    file: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * DTYPE_BYTES.get(self.dtype, 4)


@dataclass(frozen=True)
class SourceCheckpoint:
    """A safetensors checkpoint directory described from its headers.

    Attributes:
        path: the directory.
        files: its weight files, in the index's order of first appearance (or the one ``model.safetensors``).
        info: tensor key -> TensorInfo, every tensor of every file; for a quantized source (FP8), the tensors its
            full-precision form has (``seqcal.modelfree.stored``).
        config: ``config.json``'s content.
        stored: how its quantized weights are read dequantized (nothing for a full-precision source).
    """

    path: Path
    files: tuple[str, ...]
    info: dict[str, TensorInfo]
    config: dict
    stored: Stored = field(default_factory=Stored)

    @classmethod
    def open(cls, path: str | Path) -> SourceCheckpoint:
        """Read the index and the headers of the checkpoint in ``path``.

        Raises:
            SourceError: no such directory, no config.json, no safetensors weights, an index naming a file that is
                not there, or a tensor the index places in another file than the one holding it.
        """
        root = Path(path)
        if not root.is_dir():
            raise SourceError(f"model-free: {root} is not a directory; give a local checkpoint directory")
        if not (root / "config.json").is_file():
            raise SourceError(
                f"model-free: {root} has no config.json; give a transformers checkpoint directory"
            )
        weight_map = _weight_map(root)
        files = tuple(dict.fromkeys(weight_map.values())) if weight_map else (SINGLE_FILE,)
        info: dict[str, TensorInfo] = {}
        for name in files:
            for key, (dtype, shape) in read_header(root / name).items():
                if weight_map and weight_map.get(key, name) != name:
                    raise SourceError(
                        f"model-free: {root / INDEX_NAME} places {key!r} in {weight_map[key]} but it is stored in "
                        f"{name}; the index does not describe these files, regenerate it"
                    )
                info[key] = TensorInfo(name, dtype, shape)
        if missing := [k for k in weight_map if k not in info]:
            raise SourceError(
                f"model-free: {root / INDEX_NAME} lists {len(missing)} tensor(s) no file holds, e.g. {missing[0]!r} "
                f"in {weight_map[missing[0]]}; the download is incomplete, fetch the checkpoint again"
            )
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
        stored = read_stored(root, {k: t.file for k, t in info.items()}, config)
        for name, part in stored.parts.items():  # a quantized weight: under its own key, in the model's dtype
            data = info[part[0][0]]
            for key, _ in part:
                info.pop(key, None)
            info[name] = TensorInfo(data.file, SAFETENSORS_NAMES[stored.dtype], data.shape)
        return cls(root, files, info, config, stored)

    def keys_of(self, file: str) -> list[str]:
        """The tensor keys stored in ``file``."""
        return [key for key, t in self.info.items() if t.file == file]


def _weight_map(root: Path) -> dict[str, str]:
    """The index's key -> file map (empty for a one-file checkpoint); every file it names must be there."""
    try:
        weight_map = index_weight_map(root)  # the reader of quantized sources: the same checks
    except SourceFormatError as err:
        raise SourceError(f"model-free: {err}") from None
    if weight_map is None:
        if not (root / SINGLE_FILE).is_file():
            raise SourceError(
                f"model-free: {root} has neither {SINGLE_FILE} nor {INDEX_NAME}; model-free reads safetensors "
                "checkpoints (convert .bin weights with transformers' save_pretrained first)"
            )
        return {}
    return weight_map


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Key -> (dtype name, shape) of the safetensors file ``path``, in its header's order (no data read)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SourceError(f"model-free: {path} is not a safetensors file (too short); fetch it again")
        (length,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise SourceError(
                f"model-free: {path} has no readable safetensors header; fetch it again"
            ) from None
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}
