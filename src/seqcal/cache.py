"""Activation cache: the values that cross a subgraph boundary, per calibration batch.

A value is split into a skeleton (containers, constants, opaque objects) and its tensors. Tensor bytes are
stored once per span of an underlying storage and refcounted by the keys that use them, so the attention
mask handed to every layer, or a view of a stored tensor, costs nothing more. Two tiers hold the bytes:

- ``offload="cpu"``: host RAM. CPU tensors are kept as they are (no copy); accelerator tensors are copied
  to (pinned) RAM with non-blocking transfers.
- ``offload="disk"``: one safetensors file per stored span in a temporary folder, so resident memory stays
  flat however many batches are cached.

Objects the cache cannot decompose (a transformers ``DynamicCache``, arbitrary objects) are kept by
reference in RAM and never pickled (DESIGN invariant 8); their tensors are not counted in
``resident_bytes`` and stay on whatever device they are on.

The value <-> skeleton structure code lives in ``seqcal.cache_tree`` (``flatten``, ``unflatten``, re-exported
here) and the byte records in ``seqcal.cache_entries``.

Example:
    >>> with ActivationCache(offload="disk") as cache:
    ...     cache.put(0, "hidden", (torch.ones(2, 3), {"mask": None}))
    ...     cache.fetch(0, "hidden")[0].shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Any, Literal, Self

import torch
from safetensors.torch import load_file, save_file

from seqcal.cache_entries import _Alias, _byte_span, _Entry, _same_device, _Stored, _TensorRef, _view
from seqcal.cache_tree import flatten, unflatten

OFFLOAD_TIERS = ("cpu", "disk")


class CacheMissError(KeyError):
    """A (batch, name) the cache does not hold; the message lists what it holds."""

    def __str__(self) -> str:  # KeyError would repr() the message and escape its newlines
        return str(self.args[0])


class ActivationCache:
    """Per-batch store of subgraph boundary values with cpu or disk tiers and refcounted tensors.

    Args:
        offload: where stored tensor bytes live, "cpu" (host RAM) or "disk" (safetensors files in a
            temporary folder, removed on close(), on leaving a ``with`` block, and at garbage collection).
        offload_dir: parent folder of the temporary folder (disk tier only); default: the system temp dir.
        device: the execution device; fetch() returns tensors there.

    Fetched tensors may share memory with the cache (cpu tier, or several tensors of one value): callers
    must not modify them in place.

    Example:
        >>> cache = ActivationCache(offload="cpu")
        >>> cache.put(0, "mask", torch.ones(1, 4))
        >>> (0, "mask") in cache, cache.resident_bytes()
        (True, 16)
        >>> cache.drop(0, "mask"); cache.close()
    """

    def __init__(
        self,
        offload: Literal["cpu", "disk"] = "cpu",
        offload_dir: str | os.PathLike | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if offload not in OFFLOAD_TIERS:
            raise ValueError(
                f"ActivationCache: offload={offload!r} is not a tier; valid: {list(OFFLOAD_TIERS)}"
            )
        if offload_dir is not None and offload != "disk":
            raise ValueError(
                f"ActivationCache: offload_dir={str(offload_dir)!r} only applies to offload='disk' "
                f"(got offload={offload!r}); pass offload='disk' or drop offload_dir."
            )
        self.offload = offload
        self.device = torch.device(device)
        self._values: dict[tuple[int, str], _Stored] = {}
        self._batches: dict[str, set[int]] = {}
        self._aliases: dict[tuple[str, int], list[_Alias]] = {}
        self._resident = 0
        self._disk = 0
        self._files = 0
        self._closed = False
        self._dir: str | None = None
        if offload == "disk":
            if offload_dir is not None:
                os.makedirs(offload_dir, exist_ok=True)
            self._dir = tempfile.mkdtemp(prefix="seqcal-cache-", dir=offload_dir)
            # Safety net: the folder goes even if close() is never called; must not reference self.
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)

    # ---- public API -------------------------------------------------------------------------------------

    @property
    def directory(self) -> str | None:
        """The temporary folder of the disk tier (None for the cpu tier)."""
        return self._dir

    def put(self, batch: int, name: str, value: Any) -> None:
        """Store `value` for (batch, name), replacing any previous value of that key.

        Args:
            batch: calibration batch index.
            name: value name (the graph node name).
            value: a tensor or nested tuple/list/dict/namedtuple/dataclass/ModelOutput of them; other
                objects are kept by reference.
        """
        self._check_open("put", batch, name)
        entries: dict[int, _Entry] = {}

        def store(t: torch.Tensor) -> _TensorRef:
            ref = self._store_tensor(t)
            if ref.entry is not None:
                entries[id(ref.entry)] = ref.entry
            return ref

        try:
            node = flatten(value, store)
        except BaseException:  # undo entries created before the failure, then re-raise
            for entry in entries.values():
                if entry.refs == 0:
                    self._free(entry)
            raise
        for entry in entries.values():
            entry.refs += 1
        old = self._values.pop((batch, name), None)
        self._values[(batch, name)] = _Stored(node, tuple(entries.values()))
        self._batches.setdefault(name, set()).add(batch)
        if old is not None:  # released after storing the new value, so shared bytes are not rewritten
            self._release(old)

    def fetch(self, batch: int, name: str) -> Any:
        """Return the value stored for (batch, name), same structure, tensors on `device`.

        Raises:
            CacheMissError: nothing stored for that key; the message lists the names present.
        """
        self._check_open("fetch", batch, name)
        stored = self._values.get((batch, name))
        if stored is None:
            raise CacheMissError(self._miss_message("fetch", batch, name))
        payloads: dict[int, torch.Tensor] = {}  # entry id -> bytes on device, once per fetch

        def load(ref: _TensorRef) -> torch.Tensor:
            if ref.entry is None:
                return torch.empty_strided(ref.size, ref.stride, dtype=ref.dtype, device=self.device)
            if ref.tensor is not None:
                if _same_device(ref.tensor.device, self.device):
                    return ref.tensor
                return ref.tensor.to(self.device, non_blocking=True)
            if id(ref.entry) not in payloads:
                payloads[id(ref.entry)] = self._materialise(ref.entry)
            return _view(payloads[id(ref.entry)], ref)

        return unflatten(stored.node, load)

    def drop(self, batch: int, name: str) -> None:
        """Forget (batch, name); tensor bytes are freed when no other key uses them.

        Raises:
            CacheMissError: nothing stored for that key (a wrong last-use computation).
        """
        stored = self._values.pop((batch, name), None)
        if stored is None:
            raise CacheMissError(self._miss_message("drop", batch, name))
        batches = self._batches[name]
        batches.discard(batch)
        if not batches:
            del self._batches[name]
        self._release(stored)

    def drop_name(self, name: str) -> None:
        """Forget every batch's value of `name` (no-op when none is stored)."""
        for batch in sorted(self._batches.get(name, ())):
            self.drop(batch, name)

    def __contains__(self, key: tuple[int, str]) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def names(self) -> set[str]:
        """Names with a value stored for at least one batch."""
        return set(self._batches)

    def resident_bytes(self) -> int:
        """Bytes of tensor data the cache holds in RAM or on a device (opaque objects not counted)."""
        return self._resident

    def disk_bytes(self) -> int:
        """Bytes of the cache's safetensors files on disk."""
        return self._disk

    def close(self) -> None:
        """Free everything and remove the disk tier's folder; idempotent. put/fetch then raise."""
        if self._closed:
            return
        for stored in self._values.values():
            self._release(stored)
        self._values.clear()
        self._batches.clear()
        self._aliases.clear()
        self._closed = True
        if self._dir is not None:
            self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- storing ------------------------------------------------------------------------------------------

    def _stores_as_is(self, t: torch.Tensor) -> bool:
        """Keep the tensor object itself: host tensors in the cpu tier (the executor never mutates them)."""
        return self.offload == "cpu" and t.device.type == "cpu"

    def _store_tensor(self, t: torch.Tensor) -> _TensorRef:
        as_is = self._stores_as_is(t)
        if not as_is and (t.is_conj() or t.is_neg()):  # lazy conj/neg bits are not in the bytes
            t = t.resolve_conj().resolve_neg()
        meta = {"dtype": t.dtype, "size": tuple(t.shape), "stride": tuple(t.stride())}
        if t.numel() == 0:
            return _TensorRef(None, **meta)
        storage = t.untyped_storage()
        start, end = _byte_span(t)
        found = self._lookup(storage, t, start, end)
        if found is None:
            found = self._new_entry(t, storage, start, end, as_is)
        entry, entry_start = found
        return _TensorRef(
            entry, **meta, byte_offset=start - entry_start, span=end - start, tensor=t if as_is else None
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
                and end <= alias.start + alias.entry.nbytes
                and (start - alias.start) % t.element_size() == 0
                and alias.version in (None, t._version)  # an in-place change since capture needs new bytes
            ):
                return alias.entry, alias.start
        return None

    def _new_entry(
        self, t: torch.Tensor, storage: torch.UntypedStorage, start: int, end: int, as_is: bool
    ) -> tuple[_Entry, int]:
        if as_is:  # the ref keeps the tensor, which keeps its whole storage alive
            entry = _Entry(nbytes=storage.nbytes())
            self._resident += entry.nbytes
            self._add_alias(storage, 0, None, entry)
            return entry, 0
        # (end - start,) uint8 view of the span on the tensor's device, no copy yet
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, start, (end - start,), (1,))
        entry = _Entry(nbytes=end - start)
        if self.offload == "disk":
            entry.path = os.path.join(self._dir, f"{self._files}.safetensors")
            self._files += 1
            save_file({"bytes": flat.cpu()}, entry.path)
            self._disk += os.path.getsize(entry.path)
        else:
            entry.payload, entry.ready = self._copy_to_host(flat)
            self._resident += entry.nbytes
            self._add_alias(entry.payload.untyped_storage(), 0, entry.payload._version, entry)
        self._add_alias(storage, start, t._version, entry)
        return entry, start

    @staticmethod
    def _copy_to_host(flat: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(n,) uint8 host copy of `flat`; pinned and non-blocking from cuda, with its completion event."""
        pin = torch.cuda.is_available()
        host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=pin)
        non_blocking = pin and flat.device.type == "cuda"
        host.copy_(flat, non_blocking=non_blocking)
        if not non_blocking:
            return host, None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(flat.device))
        return host, event

    def _add_alias(
        self, storage: torch.UntypedStorage, start: int, version: int | None, entry: _Entry
    ) -> None:
        key = (str(storage.device), storage.data_ptr())
        self._aliases.setdefault(key, []).append(_Alias(weakref.ref(storage), start, version, entry))
        entry.alias_keys.append(key)

    # ---- loading and freeing ------------------------------------------------------------------------------

    def _materialise(self, entry: _Entry) -> torch.Tensor:
        """The entry's bytes on the execution device, (nbytes,) uint8."""
        if entry.ready is not None:  # the host copy must be complete before the host reads it
            entry.ready.synchronize()
            entry.ready = None
        if entry.path is not None:
            payload = load_file(entry.path, device=str(self.device))["bytes"]
        elif _same_device(entry.payload.device, self.device):
            return entry.payload
        else:
            payload = entry.payload.to(self.device, non_blocking=True)
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
        if entry.path is not None:
            self._disk -= os.path.getsize(entry.path)
            os.remove(entry.path)
            entry.path = None
        else:
            self._resident -= entry.nbytes
        entry.payload = entry.ready = None

    # ---- errors -------------------------------------------------------------------------------------------

    def _check_open(self, op: str, batch: int, name: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"ActivationCache.{op}(batch={batch}, name={name!r}): the cache is closed; "
                "create a new ActivationCache (closing frees all values and the disk folder)."
            )

    def _miss_message(self, op: str, batch: int, name: str) -> str:
        in_batch = sorted(n for (b, n) in self._values if b == batch)
        batches = sorted(self._batches.get(name, ()))
        return (
            f"ActivationCache.{op}: no value for batch {batch}, name {name!r}. "
            f"Names present for batch {batch}: {in_batch}; batches holding {name!r}: {batches}; "
            f"all names: {sorted(self._batches)}. The value was never put or was dropped before its last "
            "use; check the subgraph outputs and the last-use computation."
        )
