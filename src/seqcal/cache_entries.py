"""Records of the activation cache's stored bytes: refcounted entries, their aliases, tensor leaves.

``seqcal.cache.ActivationCache`` creates and frees these; they hold no logic beyond viewing bytes as a
tensor again (``_view``) and the byte span a tensor reads (``_byte_span``).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from seqcal.cache_tree import _Node


@dataclasses.dataclass(eq=False)
class _Entry:
    """Bytes of one storage span, shared (refcounted) by every key whose tensors read them."""

    nbytes: int
    payload: torch.Tensor | None = None  # (nbytes,) uint8 copy in RAM (cpu tier)
    path: str | None = None  # safetensors file (disk tier)
    ready: Any = None  # cuda Event of a pending non-blocking device-to-host copy
    refs: int = 0  # keys holding this entry
    alias_keys: list[tuple[str, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class _Alias:
    """Storage bytes [start, start + entry.nbytes) of a live storage equal the entry's bytes."""

    source: weakref.ref  # the storage; dead once it is freed, so a reused address never matches
    start: int
    version: int | None  # tensor version counter when the bytes were captured; None: kept as is
    entry: _Entry


@dataclasses.dataclass(frozen=True, eq=False)
class _TensorRef:
    """Skeleton leaf for one tensor: which entry, and how to view its bytes."""

    entry: _Entry | None  # None for a tensor with no elements
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    byte_offset: int = 0  # where the tensor's first element sits in the entry
    span: int = 0  # bytes from the first to past the last element the tensor reads
    tensor: torch.Tensor | None = None  # the tensor itself when stored as is


@dataclasses.dataclass(frozen=True, eq=False)
class _Stored:
    node: _Node
    entries: tuple[_Entry, ...]  # each entry once, whatever number of tensors use it


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes [start, end) of t's storage that t reads (strides are never negative in torch)."""
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * t.element_size(), (last + 1) * t.element_size()


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _view(payload: torch.Tensor, ref: _TensorRef) -> torch.Tensor:
    """Rebuild the tensor of `ref` as a view of the entry bytes `payload`, (nbytes,) uint8."""
    chunk = payload[ref.byte_offset : ref.byte_offset + ref.span]
    if chunk.storage_offset() % ref.dtype.itemsize:  # view(dtype) needs an aligned start
        chunk = chunk.clone()
    return chunk.view(ref.dtype).as_strided(ref.size, ref.stride)
