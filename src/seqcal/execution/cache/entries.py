"""Records of the activation cache's stored bytes: refcounted entries, their aliases, tensor leaves.

``seqcal.execution.cache.store.ActivationCache`` creates and frees these; they hold no logic beyond viewing bytes as a
tensor again (``_view``) and the byte span a tensor reads (``_byte_span``).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

from seqcal.execution.cache.tree import _Node


@dataclasses.dataclass(eq=False)
class _Entry:
    """Bytes of one storage span, shared (refcounted) by every key whose tensors read them.

    With a cast (``store_dtype``) the entry holds the span's elements in the narrower dtype; refs and
    aliases still address the decoded span, whose bytes are ``span`` long, in the original dtype.
    """

    nbytes: int  # bytes held (in RAM or in the file)
    span: int = 0  # bytes of the decoded span; equals nbytes without a cast
    cast: tuple[torch.dtype, torch.dtype] | None = None  # (original dtype, stored dtype)
    payload: torch.Tensor | None = (
        None  # (nbytes,) uint8 in RAM (cpu tier; the storage itself when kept as is)
    )
    path: str | None = None  # safetensors file (disk tier or spilled over the RAM budget)
    ready: Any = None  # cuda Event of a pending non-blocking device-to-host copy
    refs: int = 0  # keys holding this entry
    alias_keys: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    dedup_key: tuple | None = None  # where this entry sits in the cache's content index, if anywhere
    # Address of the span's first byte in its storage modulo ALIGNMENT: a fetched copy (read back from a file,
    # or cast back) is placed the same way (``aligned``), since matmul kernels choose their code path by the
    # operands' alignment and an operand aligned otherwise can come out different in the last bits (MKL on AMD
    # CPUs does).
    align: int = 0


@dataclasses.dataclass(eq=False)
class _Alias:
    """Storage bytes [start, start + entry.nbytes) of a live storage equal the entry's bytes."""

    source: weakref.ref  # the storage; dead once it is freed, so a reused address never matches
    start: int  # byte offset of the span in the storage; bytes up to start + entry.span (decoded) match
    version: int | None  # tensor version counter when the bytes were captured; None: kept as is
    entry: _Entry


class _ContentIndex:
    """Entries by (name, cast, stored bytes, checksum) and batch: spans found again by their content."""

    def __init__(self, per_key: int = 4) -> None:
        self._entries: dict[tuple, list[tuple[int, _Entry]]] = {}
        self._per_key = per_key  # candidates kept per key, newest first: bounds the comparisons of a put

    def find(
        self, key: tuple, batch: int, enc: torch.Tensor, raw: Callable[[_Entry], torch.Tensor]
    ) -> _Entry | None:
        """An entry of another batch whose stored bytes `raw(entry)` equal (n,) uint8 `enc` exactly."""
        for other, entry in self._entries.get(key, ()):
            if other == batch:
                continue
            stored = raw(entry)
            if torch.equal(stored, enc.to(stored.device)):
                return entry
        return None

    def add(self, key: tuple, batch: int, entry: _Entry) -> None:
        entries = self._entries.setdefault(key, [])
        entries.insert(0, (batch, entry))
        for _, old in entries[self._per_key :]:
            old.dedup_key = None
        del entries[self._per_key :]
        entry.dedup_key = key

    def remove(self, entry: _Entry) -> None:
        if entry.dedup_key is None:
            return
        entries = [(b, e) for b, e in self._entries[entry.dedup_key] if e is not entry]
        if entries:
            self._entries[entry.dedup_key] = entries
        else:
            del self._entries[entry.dedup_key]
        entry.dedup_key = None


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


def _copy_to_host(flat: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(n,) uint8 host copy of `flat`; pinned and non-blocking from cuda, with its completion event."""
    # Pinned only for what comes from the GPU (and goes back there): pinning is slow to allocate and is no
    # use for a host-to-host copy (a run on the CPU of a machine that has CUDA).
    non_blocking = flat.device.type == "cuda"
    host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=non_blocking)
    host.copy_(flat, non_blocking=non_blocking)
    if not non_blocking:
        return host, None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(flat.device))
    return host, event


ALIGNMENT = 64  # bytes: torch's own CPU allocations start on such a boundary


def aligned(flat: torch.Tensor, offset: int) -> torch.Tensor:
    """(n,) uint8 ``flat``, or a copy of it whose address is ``offset`` modulo ``ALIGNMENT``.

    Example:
        >>> aligned(torch.arange(8, dtype=torch.uint8)[3:], 3).data_ptr() % ALIGNMENT
        3
    """
    if flat.data_ptr() % ALIGNMENT == offset:
        return flat
    room = torch.empty(flat.numel() + ALIGNMENT, dtype=torch.uint8, device=flat.device)
    start = (offset - room.data_ptr()) % ALIGNMENT
    return room[start : start + flat.numel()].copy_(flat)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same type, and the same index where both have one (``store.same_device`` resolves a missing index)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _view(payload: torch.Tensor, ref: _TensorRef) -> torch.Tensor:
    """Rebuild the tensor of `ref` as a view of the entry bytes `payload`, (nbytes,) uint8."""
    chunk = payload[ref.byte_offset : ref.byte_offset + ref.span]
    if chunk.storage_offset() % ref.dtype.itemsize:  # view(dtype) needs an aligned start
        chunk = chunk.clone()
    return chunk.view(ref.dtype).as_strided(ref.size, ref.stride)


def _encode(t: torch.Tensor, storage: torch.UntypedStorage, start: int, end: int, cast: Any) -> torch.Tensor:
    """Bytes [start, end) of `storage` as stored: (end - start,) uint8 view, or their cast copy.

    The cast clamps finite values to the stored dtype's range: a float32 mask filled with
    finfo(float32).min would otherwise become -inf in bfloat16, and a fully masked (padding) row of
    attention would turn into NaN. Infinite values stay infinite.
    """
    if cast is None:  # (end - start,) uint8 view on the tensor's device, no copy
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, start, (end - start,), (1,))
    size = t.element_size()
    wide = torch.empty(0, dtype=t.dtype, device=t.device).set_(
        storage, start // size, ((end - start) // size,), (1,)
    )
    info = torch.finfo(cast)
    narrow = torch.where(wide.isinf(), wide, wide.clamp(info.min, info.max)).to(cast)  # (n,) stored dtype
    return narrow.view(torch.uint8)


def _decode(raw: torch.Tensor, entry: _Entry) -> torch.Tensor:
    """(span,) uint8 bytes of the original dtype from an entry's stored (nbytes,) uint8 bytes."""
    if entry.cast is None:
        return raw
    original, stored = entry.cast
    return raw.view(stored).to(original).view(torch.uint8)


def _checksum(enc: torch.Tensor, chunks: int = 64) -> tuple[int, ...]:
    """Sums of `chunks` slices of (n,) uint8 `enc`: finds candidates only, equality is checked after.

    The bytes are summed as int64 words (wrapping on overflow, which does not depend on the order): a sum
    of uint8 into int64 runs about a hundred times slower, and the first batches of every cached value pay it.
    """
    n = enc.numel() // (8 * chunks) * (8 * chunks)
    if n:
        body = enc[:n] if enc.storage_offset() % 8 == 0 else enc[:n].clone()  # int64 words need alignment
        sums = body.view(torch.int64).view(chunks, -1).sum(1)
    else:
        sums = enc[:0].sum(dtype=torch.int64)[None]
    tail = enc[n:].sum(dtype=torch.int64)[None]
    return tuple(torch.cat([sums, tail]).tolist())
