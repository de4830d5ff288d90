"""Tensors of safetensors files read into memory of their own: whole (``read_tensor``), a few rows
(``read_stored_rows``: an embedding's rows a batch names) or in pieces through one buffer (``stored_pieces``, and
``FileCopy`` cast on the way: a tensor copied to another file without holding it).

Why not safetensors' own reads: see ``read_tensor``. The file's layout is safetensors' (an 8-byte little-endian
header length, the JSON header, the data); dtypes ``_DTYPES`` does not list, and big-endian hosts, go through
safetensors (``read_tensor``) or are left to the caller (the others return None).
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

# safetensors' dtype names -> torch's, for ``read_tensor`` (others go through safetensors itself)
_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I8": torch.int8,
    "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def read_tensor(path: str, key: str) -> torch.Tensor:
    """Tensor ``key`` of the safetensors file ``path``, read into memory of its own (``readinto``, no mapping).

    Why not safetensors' ``get_tensor``: it returns a view of a mapping of the whole file, made anew by each
    ``safe_open``, which lives as long as the tensor. Every tensor read so keeps its own mapping of the file's
    header resident beside it (1.2 MB for a 512 MB shard of per-expert tensors), and its bytes count as the
    file's pages: a layer of 105 per-expert tensors (102 MB) held 237 MB of the shard's pages until released
    (benchmarks/RESULTS.md). Read into a buffer, a weight is its own bytes, in the process's memory, freed with it.
    The file's layout is safetensors' (an 8-byte little-endian header length, the JSON header, the data);
    dtypes it does not list, and big-endian hosts, go through safetensors.
    """
    span = stored_span(path, key)
    if span is None:
        with safe_open(path, framework="pt") as f:
            return owned_copy(f.get_tensor(key))
    offset, dtype, shape = span
    out = _own_memory(shape.numel() * dtype.itemsize)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        _fill(f, memoryview(out.numpy()), path, key)
    return out.view(dtype).reshape(shape)


def _fill(file: Any, view: memoryview, path: str, key: str) -> None:
    """Fill ``view`` from ``file``'s next bytes (an unbuffered read may return fewer than asked: read again).

    Raises:
        OSError: the file ends first (tensor ``key`` of ``path`` is truncated).
    """
    done = 0
    while done < len(view):
        count = file.readinto(view[done:])
        if not count:
            raise OSError(f"{path}: the data of {key!r} ends early; the file is truncated")
        done += count


def stored_span(path: str, key: str) -> tuple[int, torch.dtype, torch.Size] | None:
    """Where tensor ``key``'s data starts in the safetensors file ``path``, its dtype and shape; None for a key
    the file lacks, a dtype ``_DTYPES`` does not list or a big-endian host (read through safetensors then).
    The file's layout is safetensors' (an 8-byte little-endian header length, the JSON header, the data)."""
    stat = os.stat(path)
    start, header = _header(path, stat.st_mtime_ns, stat.st_size)
    info = header.get(key)
    if info is None or info["dtype"] not in _DTYPES or sys.byteorder != "little":
        return None
    return start + info["data_offsets"][0], _DTYPES[info["dtype"]], torch.Size(info["shape"])


def read_stored_rows(path: str, key: str, rows: torch.Tensor) -> torch.Tensor | None:
    """Rows ``rows`` (ascending, distinct int64) of tensor ``key`` of the safetensors file ``path``, read without
    the rest of it: a run of consecutive rows is one read. None where ``stored_span`` is None.

    Example:
        >>> read_stored_rows("model.safetensors", "model.embed_tokens.weight", torch.tensor([1, 2, 7]))  # doctest: +SKIP
    """
    span = stored_span(path, key)
    if span is None:
        return None
    offset, dtype, shape = span
    row_bytes = shape[1:].numel() * dtype.itemsize
    out = torch.empty((len(rows), row_bytes), dtype=torch.uint8)
    ids = rows.tolist()
    with open(path, "rb", buffering=0) as f:
        first = 0
        while first < len(ids):
            last = first  # the run of consecutive rows from ids[first]
            while last + 1 < len(ids) and ids[last + 1] == ids[last] + 1:
                last += 1
            f.seek(offset + ids[first] * row_bytes)
            _fill(f, memoryview(out[first : last + 1].numpy()).cast("B"), path, key)
            first = last + 1
    return out.view(dtype).reshape(len(rows), *shape[1:])


def stored_pieces(path: str, key: str, buffer: int) -> tuple[str, list[int], Iterator[memoryview]] | None:
    """Tensor ``key`` of the safetensors file ``path`` as it is stored: its dtype's safetensors name, its shape, and
    its bytes in pieces of at most ``buffer`` read into one reused buffer (a piece is valid until the next is
    asked for). For copying a tensor to another file without holding it (``_ShardFile.add_pieces``); None where
    ``read_tensor`` would go through safetensors (a dtype it does not list, a big-endian host).
    """
    span = stored_span(path, key)
    if span is None:
        return None
    offset, dtype, shape = span
    nbytes = shape.numel() * dtype.itemsize

    def pieces() -> Iterator[memoryview]:
        scratch = memoryview(bytearray(min(buffer, nbytes)))
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            left = nbytes
            while left:
                view = scratch[: min(left, len(scratch))]
                _fill(f, view, path, key)
                left -= len(view)
                yield view

    return _SAFETENSORS_NAMES[dtype], list(shape), pieces()


# Reads of this many bytes or more get a mapping of their own (``_own_memory``)
OWN_MAPPING_BYTES = 256 << 10


def _own_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` of writable host memory as a uint8 tensor, returned to the OS when the tensor is freed.

    Why not ``torch.empty``: a run holds one subgraph's weights at a time, but a MoE layer's are hundreds of 1 MB
    expert tensors, below glibc's mmap threshold (16 MB in a run, ``backend.host``), so they came from the heap;
    read and freed module by module while a model is traced, they left 2.1 GB of free heap resident (a 1.35B MoE,
    benchmarks/RESULTS.md). An anonymous mapping per weight is unmapped with it.
    """
    # (Windows' mmap has no private mappings: the heap there)
    if nbytes < OWN_MAPPING_BYTES or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # anonymous: not backed by any file
    return torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive


def owned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` (one safetensors read, a view of the file's mapping) in ``_own_memory``."""
    out = _own_memory(tensor.numel() * tensor.element_size()).view(tensor.dtype).reshape(tensor.shape)
    return out.copy_(tensor)


@functools.lru_cache(maxsize=16)
def _header(path: str, mtime_ns: int, size: int) -> tuple[int, dict[str, Any]]:
    """Where the data of safetensors file ``path`` starts, and its header (one read per file as it is now)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return 8 + length, json.loads(f.read(length))


@dataclass(frozen=True)
class FileCopy:
    """Tensor ``key`` of the safetensors file ``path``, to be written elsewhere in ``dtype`` without holding it
    (``checkpoint.shard_file``): an untouched weight a run never onloaded whole, such as an embedding read by rows.

    Example:
        >>> dtype, shape, pieces = FileCopy("model.safetensors", "lm_head.weight", torch.float32).pieces(64 << 20)  # doctest: +SKIP
    """

    path: str
    key: str
    dtype: torch.dtype

    def pieces(self, buffer: int) -> tuple[str, list[int], Iterator[memoryview]]:
        """``stored_pieces``' dtype name, shape and pieces, each cast to ``dtype`` when the file stores another
        (a piece is whole elements: ``buffer`` a multiple of 8; the cast, elementwise, is the whole tensor's)."""
        stored = stored_pieces(self.path, self.key, buffer)
        if stored is None or buffer % 8:
            raise ValueError(
                f"{self.path}: {self.key!r} cannot be copied in pieces (dtype, byte order or buffer)"
            )
        name, shape, pieces = stored
        source = _DTYPES[name]
        if source == self.dtype:
            return stored
        cast = (
            memoryview(torch.frombuffer(p, dtype=source).to(self.dtype).view(torch.uint8).numpy())
            for p in pieces
        )
        return _SAFETENSORS_NAMES[self.dtype], shape, cast
