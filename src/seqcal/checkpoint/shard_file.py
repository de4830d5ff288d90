"""One safetensors file written tensor by tensor (the shards of a checkpoint): each tensor's bytes go to disk when
it is added, the JSON header into room reserved at the start when the file is finished.

``CheckpointWriter`` (``seqcal.checkpoint.writer``) decides which tensor goes to which shard and writes the
index; this module knows only the file format.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

HEADER_RESERVE = 1024**2  # bytes kept free at the start of a shard for its JSON header (~7000 tensors)


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


class _ShardFile:
    """A safetensors file written tensor by tensor: the bytes go to disk when added, the header at the end.

    The header's room is reserved up front and filled with the JSON padded by spaces (the format allows
    trailing whitespace), so no tensor waits in RAM for its shard to fill: streaming the checkpoint costs
    no memory beyond the tensor being written.
    """

    def __init__(self, path: Path, reserve: int = HEADER_RESERVE) -> None:
        self.path, self.reserve = path, reserve
        self.entries: dict[str, dict[str, Any]] = {}
        self.size = 0  # data bytes so far
        self._header_bytes = 64  # braces, separators and the format metadata
        self._file = open(path, "wb")  # noqa: SIM115 - closed by finish() or discard()
        self._file.write(b"\0" * (8 + reserve))

    def fits(self, name: str, dims: int) -> bool:
        """Whether the header has room for one more entry, of a tensor of ``dims`` dimensions."""
        return self._header_bytes + len(name) + 32 + 8 * dims + 48 <= self.reserve

    def add(self, name: str, tensor: Tensor) -> int:
        """Write ``tensor``'s bytes; returns how many."""
        t = tensor.detach().to("cpu").contiguous()
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(
                f"CheckpointWriter: {name!r} has dtype {t.dtype}, which safetensors cannot store"
            )
        data = t.reshape(-1).view(torch.uint8).numpy()  # the tensor's own bytes, no copy
        self._file.write(memoryview(data))
        return self._entry(name, _SAFETENSORS_DTYPES[t.dtype], list(t.shape), data.nbytes)

    def add_pieces(self, name: str, dtype: str, shape: list[int], pieces: Iterable[memoryview]) -> int:
        """Write a tensor given as its bytes in pieces (``seqcal.sources.files.stored_pieces``: a tensor copied
        from another safetensors file without holding it), ``dtype`` its safetensors name; returns how many."""
        if dtype not in _SAFETENSORS_DTYPES.values():
            raise ValueError(
                f"CheckpointWriter: {name!r} has dtype {dtype}, which this writer does not store"
            )
        nbytes = 0
        for piece in pieces:
            self._file.write(piece)
            nbytes += len(piece)
        return self._entry(name, dtype, list(shape), nbytes)

    def _entry(self, name: str, dtype: str, shape: list[int], nbytes: int) -> int:
        """The header entry of the tensor whose ``nbytes`` were just written."""
        entry = {"dtype": dtype, "shape": shape, "data_offsets": [self.size, self.size + nbytes]}
        self.entries[name] = entry
        self._header_bytes += len(json.dumps({name: entry}, separators=(",", ":")))
        self.size += nbytes
        return nbytes

    def finish(self, metadata: dict[str, str]) -> None:
        """Write the header into its reserved room and close the file."""
        header = json.dumps({"__metadata__": metadata, **self.entries}, separators=(",", ":")).encode()
        if len(header) > self.reserve:  # fits() keeps this from happening
            raise AssertionError(f"{self.path}: header of {len(header)} bytes exceeds its {self.reserve}")
        self._file.seek(0)
        self._file.write(struct.pack("<Q", self.reserve) + header.ljust(self.reserve, b" "))
        self._file.close()

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)
