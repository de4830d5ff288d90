"""How the activation cache stores a tensor: as it is, cast (``store_dtype``), shared with an equal one stored
before (deduplication), in the tier's memory or spilled to files, and how it is read back and freed.

``EntryStorage`` holds these steps for ``ActivationCache`` (``seqcal.execution.cache.store``), whose
``__init__`` sets the state they work on (``home``, ``_values``, ``_contents``, ``_folder``, ...); the public
operations (put, fetch, drop, close) are there.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from seqcal.execution.cache.entries import (
    ALIGNMENT,
    _Alias,
    _byte_span,
    _checksum,
    _copy_to_host,
    _decode,
    _encode,
    _Entry,
    _same_device,
    _Stored,
    _TensorRef,
    aligned,
)

# comparing a 4 MiB tensor costs far less than the layer that needs it
# A name (per dtype and size) that has stored this many different contents holds per-batch values (hidden
# states at batch size 1 are under DEDUP_MAX_BYTES): later puts skip the checksum, which otherwise cost
# ~10% of a SmolLM2 GPTQ run (profiled).
DEDUP_MAX_DISTINCT = 4


class EntryStorage:
    """The storing half of :class:`~seqcal.execution.cache.store.ActivationCache` (see the module docstring)."""

    # ---- storing ------------------------------------------------------------------------------------------

    def _stores_as_is(self, t: torch.Tensor) -> bool:
        """Keep the tensor object itself where it already is where the tier keeps bytes (host tensors in the cpu
        tier, the execution device's in the device tier): the executor never mutates them."""
        return self.home is not None and _same_device(t.device, self.home)

    def _cast_for(self, t: torch.Tensor) -> torch.dtype | None:
        """The narrower dtype `t` is stored in, or None to store it exactly."""
        narrower = self.store_dtype is not None and t.element_size() > self.store_dtype.itemsize
        return self.store_dtype if narrower and t.is_floating_point() else None

    def _store_tensor(self, t: torch.Tensor, batch: int, name: str) -> _TensorRef:
        cast = self._cast_for(t)
        as_is = cast is None and self._stores_as_is(t)
        if not as_is and (t.is_conj() or t.is_neg()):  # lazy conj/neg bits are not in the bytes
            t = t.resolve_conj().resolve_neg()
        meta = {"dtype": t.dtype, "size": tuple(t.shape), "stride": tuple(t.stride())}
        if t.numel() == 0:
            return _TensorRef(None, **meta)
        storage = t.untyped_storage()
        start, end = _byte_span(t)
        found = self._lookup(storage, t, start, end)
        if found is None:
            found = self._new_entry(t, storage, start, end, as_is, cast, (batch, name))
        entry, entry_start = found
        # Kept as is only when the entry is this tensor's own storage (not spilled, cast or shared by content)
        keep = as_is and entry.payload is not None and entry.payload.data_ptr() == storage.data_ptr()
        return _TensorRef(
            entry, **meta, byte_offset=start - entry_start, span=end - start, tensor=t if keep else None
        )

    def _lookup(
        self, storage: torch.UntypedStorage, t: torch.Tensor, start: int, end: int
    ) -> tuple[_Entry, int] | None:
        """An entry already holding bytes [start, end) of this very storage, and where it starts."""
        key = (str(storage.device), storage.data_ptr())
        aliases = [a for a in self._aliases.pop(key, []) if a.source() is not None]  # prune freed storages
        if aliases:
            self._aliases[key] = aliases
        for alias in aliases:
            if (
                alias.source() is storage
                and alias.start <= start
                and end <= alias.start + alias.entry.span
                and (start - alias.start) % t.element_size() == 0
                and alias.version in (None, t._version)  # an in-place change since capture needs new bytes
                and (alias.entry.cast is None or alias.entry.cast[0] == t.dtype)  # cast bytes: same dtype
            ):
                return alias.entry, alias.start
        return None

    def _new_entry(
        self, t: torch.Tensor, storage: torch.UntypedStorage, start: int, end: int, as_is: bool,
        cast: torch.dtype | None, where: tuple[int, str],
    ) -> tuple[_Entry, int]:  # fmt: skip
        enc = _encode(t, storage, start, end, cast)  # (n,) uint8 as stored, on t's device
        key = None
        kind = (where[1], t.dtype, enc.numel())
        # Hidden states never reach the comparison: too big, or (batch size 1) seen to differ between batches.
        if end - start <= self.dedup_max_bytes and kind not in self._varies:
            key = (where[1], cast, t.dtype if cast else None, enc.numel(), _checksum(enc))
            entry = self._contents.find(key, where[0], enc, self._raw)
            if entry is not None:  # equal bytes under this name: [start, end) maps onto the whole entry
                self._add_alias(storage, start, t._version, entry)
                return entry, start
            self._distinct[kind] = self._distinct.get(kind, 0) + 1
            if self._distinct[kind] >= DEDUP_MAX_DISTINCT:
                self._varies.add(kind)  # a per-batch value, not a side input: stop paying for checksums
        if as_is and self._fits(storage.nbytes()):  # the ref keeps the tensor, which keeps its storage
            entry = _Entry(nbytes=storage.nbytes(), span=storage.nbytes())
            entry.payload = _encode(t, storage, 0, storage.nbytes(), None)
            self._resident += entry.nbytes
            self._add_alias(storage, 0, None, entry)
            entry_start = 0
        else:
            entry = _Entry(nbytes=enc.numel(), span=end - start, cast=(t.dtype, cast) if cast else None,
                           align=(storage.data_ptr() + start) % ALIGNMENT)  # fmt: skip
            if self.home is not None and self._fits(entry.nbytes):
                entry.payload, entry.ready = self._to_home(enc, cast is not None, where[0])
                self._resident += entry.nbytes
                if cast is None:  # the cast copy's storage holds other bytes than the tensors it stands for
                    self._add_alias(entry.payload.untyped_storage(), 0, entry.payload._version, entry)
            else:
                entry.path, _ = self._folder.write(enc)
            self._add_alias(storage, start, t._version, entry)
            entry_start = start
        if key is not None and entry_start == start and entry.span == end - start:
            self._contents.add(key, where[0], entry)  # only entries that are exactly this tensor's span
        return entry, entry_start

    def _to_home(self, enc: torch.Tensor, cast: bool, batch: int) -> tuple[torch.Tensor, Any]:
        """The (n,) uint8 bytes ``enc`` copied to where the tier keeps them, and the event of the copy's completion
        (None: complete). A cast already made there is a fresh copy itself."""
        assert self.home is not None
        if cast and _same_device(enc.device, self.home):
            return enc, None
        if self.home.type != "cpu":  # an accelerator's memory (another device's: the copy is stream-ordered)
            return enc.to(self.home, copy=True), None
        if self._transfers is not None and _same_device(enc.device, self.device):
            return self._transfers.copy_out(batch, enc)
        return _copy_to_host(enc)

    def _fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more stay within the RAM budget."""
        return self.max_memory is None or self._resident + nbytes <= self.max_memory

    def _add_alias(
        self, storage: torch.UntypedStorage, start: int, version: int | None, entry: _Entry
    ) -> None:
        key = (str(storage.device), storage.data_ptr())
        self._aliases.setdefault(key, []).append(_Alias(weakref.ref(storage), start, version, entry))
        entry.alias_keys.append(key)

    # ---- loading and freeing ------------------------------------------------------------------------------

    def _raw(self, entry: _Entry) -> torch.Tensor:
        """The entry's stored bytes, (nbytes,) uint8, in RAM or on the execution device (from a file)."""
        if entry.ready is not None:  # the host copy must be complete before the host reads it
            entry.ready.synchronize()
            entry.ready = None
        if entry.path is not None:
            return self._folder.read(entry.path, self.device)
        return entry.payload

    def _materialise(self, entry: _Entry) -> torch.Tensor:
        """The entry's decoded bytes on the execution device, (span,) uint8."""
        prefetched = self._prefetched.pop(id(entry), None)
        if prefetched is not None:
            raw, event = prefetched
            self._transfers.use(event)  # type: ignore[union-attr]  # only set with transfers
        else:
            raw = self._raw(entry)
            if entry.path is None and _same_device(raw.device, self.device) and entry.cast is None:
                return raw
        payload = _decode(raw.to(self.device, non_blocking=True), entry)  # cast back on the device
        if payload.device.type == "cpu":  # a file's or a cast's bytes: at the address its tensor had
            payload = aligned(payload, entry.align)
        # A fetched value put again (a pass-through) then reuses this entry instead of new bytes.
        self._add_alias(payload.untyped_storage(), payload.storage_offset(), payload._version, entry)
        return payload

    def _release(self, stored: _Stored) -> None:
        for entry in stored.entries:
            entry.refs -= 1
            if entry.refs == 0:
                self._free(entry)

    def _free(self, entry: _Entry) -> None:
        for key in set(entry.alias_keys):
            kept = [a for a in self._aliases.get(key, []) if a.entry is not entry]
            if kept:
                self._aliases[key] = kept
            else:
                self._aliases.pop(key, None)
        entry.alias_keys.clear()
        self._contents.remove(entry)
        self._prefetched.pop(id(entry), None)
        if entry.path is not None:
            self._folder.remove(entry.path)
            entry.path = None
        else:
            self._resident -= entry.nbytes
        entry.payload = entry.ready = None
