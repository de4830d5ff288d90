"""Activation cache: the values that cross a subgraph boundary, per calibration batch.

A value is split into a skeleton (containers, constants, opaque objects) and its tensors. Tensor bytes are
stored once per span of an underlying storage and refcounted by the keys that use them, so the attention
mask handed to every layer, or a view of a stored tensor, costs nothing more. Three tiers hold the bytes:

- ``offload="cpu"``: host RAM. CPU tensors are kept as they are (no copy); accelerator tensors are copied
  to pinned RAM. On CUDA those copies, and the copies back of the batch the executor will fetch next
  (``prefetch``), run on side streams beside the compute (``seqcal.execution.cache.transfers``).
- ``offload="device"`` (the execution device) or an accelerator's name (``"cuda:1"``): that device's memory.
  Values made on it are kept as they are; nothing crosses PCIe when it is the execution device. For GPUs
  with room for every cached value (the memory plan says how much that is): the fastest tier there.
- ``offload="disk"``: one safetensors file per stored span in a temporary folder, so resident memory stays
  flat however many batches are cached.

Three options trade memory for time or precision:

- ``max_memory``: a RAM budget (bytes) for the cpu tier. A new span that would push ``resident_bytes()``
  over it goes to a safetensors file instead (lossless; nothing moves back to RAM later).
- ``store_dtype`` (lossy, opt-in): float32/float64 tensors are stored as e.g. bfloat16 and cast back to
  their dtype on fetch, halving the cache. Integer and bool tensors, and narrower floats, are untouched.
- ``dedup_max_bytes``: a tensor up to this size whose bytes equal a span already stored under the same
  name (the rotary table or causal mask that subgraph 0 recomputes for every batch) shares that span.

Objects the cache cannot decompose (a transformers ``DynamicCache``, arbitrary objects) are kept by
reference in RAM and never pickled (DESIGN invariant 8); their tensors are not counted in
``resident_bytes`` and stay on whatever device they are on.

The value <-> skeleton structure code lives in ``seqcal.execution.cache.tree`` (``flatten``, ``unflatten``, re-exported
here), the byte records in ``seqcal.execution.cache.entries`` and the safetensors files in ``seqcal.execution.cache.spill``.

Example:
    >>> with ActivationCache(offload="disk") as cache:
    ...     cache.put(0, "hidden", (torch.ones(2, 3), {"mask": None}))
    ...     cache.fetch(0, "hidden")[0].shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from typing import Any, Literal, Self

import torch

from seqcal.execution.cache.entries import (
    ALIGNMENT,
    _Alias,
    _byte_span,
    _checksum,
    _ContentIndex,
    _copy_to_host,
    _decode,
    _encode,
    _Entry,
    _same_device,
    _Stored,
    _TensorRef,
    _view,
    aligned,
)
from seqcal.execution.cache.spill import SpillFolder
from seqcal.execution.cache.transfers import Transfers
from seqcal.execution.cache.tree import flatten, unflatten

OFFLOAD_TIERS = ("cpu", "disk", "device")  # or an accelerator's name, such as "cuda:1" (``tier_device``)
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
DEDUP_MAX_BYTES = 4 << 20  # comparing a 4 MiB tensor costs far less than the layer that needs it
# A name (per dtype and size) that has stored this many different contents holds per-batch values (hidden
# states at batch size 1 are under DEDUP_MAX_BYTES): later puts skip the checksum, which otherwise cost
# ~10% of a SmolLM2 GPTQ run (profiled).
DEDUP_MAX_DISTINCT = 4
# Copies to and from a CUDA device on side streams, overlapping the compute (transfers.py); False: on the compute
# stream, as torch's non-blocking copies go. The default of ActivationCache's ``overlap``.
OVERLAP = True


def tier_device(offload: str, device: torch.device | str) -> torch.device | None:
    """Where a cache with tier ``offload`` keeps its bytes: the host for "cpu", the execution ``device`` for
    "device", the named accelerator for a name such as "cuda:1"; None for "disk" (files).

    Raises:
        ValueError: ``offload`` is neither a tier nor an accelerator's name.

    Example:
        >>> tier_device("device", "cpu"), tier_device("cuda:1", "cpu"), tier_device("disk", "cpu")
        (device(type='cpu'), device(type='cuda', index=1), None)
    """
    if offload == "disk":
        return None
    if offload in ("cpu", "device"):
        return torch.device("cpu" if offload == "cpu" else device)
    try:
        named = torch.device(offload) if isinstance(offload, str) else None
    except RuntimeError:  # not a device name
        named = None
    if named is None or named.type in ("cpu", "meta"):
        raise ValueError(
            f"offload={offload!r} is not a tier of the activation cache: valid are {list(OFFLOAD_TIERS)} or an "
            "accelerator's name such as 'cuda:1'"
        )
    return named


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether two devices are one: an accelerator without an index is its current one ("cuda" is "cuda:0"
    while device 0 is current; where CUDA is absent, index 0). Stricter than ``entries._same_device``, which
    lets a device without an index match any index (a tensor's device against the cache's).

    Example:
        >>> same_device("cuda", "cuda:0"), same_device("cuda:1", "cuda:0"), same_device("cpu", "cpu")
        (True, False, True)
    """
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True

    def index(d: torch.device) -> int:
        if d.index is not None:
            return d.index
        return torch.cuda.current_device() if d.type == "cuda" and torch.cuda.is_initialized() else 0

    return index(a) == index(b)


class CacheMissError(KeyError):
    """A (batch, name) the cache does not hold; the message lists what it holds."""

    def __str__(self) -> str:  # KeyError would repr() the message and escape its newlines
        return str(self.args[0])


class ActivationCache:
    """Per-batch store of subgraph boundary values with cpu or disk tiers and refcounted tensors.

    Args:
        offload: where stored tensor bytes live: "cpu" (host RAM), "device" (``device``'s memory), an
            accelerator's name ("cuda:1"), or "disk" (safetensors files in a temporary folder, removed on
            close(), on leaving a ``with`` block, and at garbage collection).
        offload_dir: parent folder of the temporary folder (disk tier, or spill of the cpu tier with
            ``max_memory``); default: the system temp dir.
        device: the execution device; fetch() returns tensors there.
        max_memory: RAM budget in bytes of the cpu tier; spans that do not fit go to safetensors files in
            a temporary folder made on the first spill. None: no budget.
        store_dtype: torch.bfloat16 or torch.float16 to store wider float tensors narrower (lossy; cast
            back on fetch); None stores every tensor exactly.
        dedup_max_bytes: tensors up to this size are compared with the spans stored under the same name
            and share an equal one; 0 turns this off.
        overlap: on a CUDA device with the cpu tier, copy on side streams (``put`` without waiting for the
            compute, ``prefetch`` of the next batch); None: the module's ``OVERLAP``.

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
        offload: Literal["cpu", "disk", "device"] | str = "cpu",
        offload_dir: str | os.PathLike | None = None,
        device: torch.device | str = "cpu",
        max_memory: int | None = None,
        store_dtype: torch.dtype | None = None,
        dedup_max_bytes: int = DEDUP_MAX_BYTES,
        overlap: bool | None = None,
    ) -> None:
        _check_args(offload, offload_dir, max_memory, store_dtype, dedup_max_bytes)
        self.offload = offload
        self.device = torch.device(device)
        self.home = tier_device(offload, self.device)  # where the bytes of the memory tiers live; None: files
        self.max_memory = max_memory
        self.store_dtype = store_dtype
        self.dedup_max_bytes = dedup_max_bytes
        self._values: dict[tuple[int, str], _Stored] = {}
        self._batches: dict[str, set[int]] = {}
        self._aliases: dict[tuple[str, int], list[_Alias]] = {}
        self._contents = _ContentIndex()
        self._distinct: dict[tuple, int] = {}  # (name, dtype, bytes) -> contents stored so far
        self._varies: set[tuple] = set()  # (name, dtype, bytes) with DEDUP_MAX_DISTINCT different contents
        self._resident = 0
        self._closed = False
        overlap = OVERLAP if overlap is None else overlap
        to_host = self.home is not None and self.home.type == "cpu" and self.device.type == "cuda"
        self._transfers = Transfers(self.device) if overlap and to_host else None
        # id(entry) -> (its bytes being copied to the device, the copy's event); _free drops an entry's record
        self._prefetched: dict[int, tuple[torch.Tensor, Any]] = {}
        # The disk tier's folder exists from the start; the cpu tier's only once a span spills.
        self._folder = SpillFolder(offload_dir, create=offload == "disk")

    # ---- public API -------------------------------------------------------------------------------------

    @property
    def directory(self) -> str | None:
        """The temporary folder of the safetensors files (cpu tier: None until a span spills)."""
        return self._folder.path

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
            ref = self._store_tensor(t, batch, name)
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
            if ref.tensor is not None:  # kept as is
                if _same_device(ref.tensor.device, self.device):
                    return ref.tensor
                return ref.tensor.to(self.device, non_blocking=True)
            if id(ref.entry) not in payloads:
                payloads[id(ref.entry)] = self._materialise(ref.entry)
            return _view(payloads[id(ref.entry)], ref)

        return unflatten(stored.node, load)

    def prefetch(self, batch: int, names: Iterable[str]) -> None:
        """Start copying the values of (batch, name) for each name to the device, beside the compute.

        The executor calls it for the next batch before it runs the current one; ``fetch`` then only makes the
        compute stream wait for the copy. It does nothing off CUDA, without overlap, or for values not in pinned
        RAM (kept as they are, spilled, or absent).
        """
        if self._transfers is None or self._closed:
            return
        for name in names:
            stored = self._values.get((batch, name))
            for entry in stored.entries if stored is not None else ():
                host = entry.payload  # None when spilled; not pinned when kept as is
                if host is None or id(entry) in self._prefetched or not host.is_pinned():
                    continue
                device_bytes, event = self._transfers.copy_in(host, entry.ready)
                self._prefetched[id(entry)] = (device_bytes, event)

    def settle(self) -> None:
        """Order the compute stream after every copy to the host so far (before weights change in place), and
        free prefetched copies nobody fetched. A no-op without side streams."""
        if self._transfers is not None:
            self._transfers.settle()
        self._prefetched.clear()

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

    @property
    def copy_wait_seconds(self) -> float:
        """Seconds puts waited on the host for earlier batches' copies to the host (CUDA side streams; else 0)."""
        return self._transfers.waited if self._transfers is not None else 0.0

    def disk_bytes(self) -> int:
        """Bytes of the cache's safetensors files on disk (disk tier, or spans spilled over max_memory)."""
        return self._folder.nbytes

    def close(self) -> None:
        """Free everything and remove the disk tier's folder; idempotent. put/fetch then raise."""
        if self._closed:
            return
        if self._transfers is not None:
            self._transfers.finish()
        self._prefetched.clear()
        for stored in self._values.values():
            self._release(stored)
        self._values.clear()
        self._batches.clear()
        self._aliases.clear()
        self._closed = True
        self._folder.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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


def _check_args(
    offload: str, offload_dir: Any, max_memory: int | None, store_dtype: Any, dedup_max_bytes: int
) -> None:
    where = "ActivationCache"
    try:
        tier_device(offload, "cpu")
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if offload_dir is not None and offload != "disk" and max_memory is None:
        raise ValueError(
            f"{where}: offload_dir={str(offload_dir)!r} only applies to offload='disk' or to the spill of "
            f"offload='cpu' with max_memory (got offload={offload!r}); pass one of them or drop offload_dir."
        )
    if max_memory is not None and (offload != "cpu" or isinstance(max_memory, bool) or max_memory < 0):
        raise ValueError(
            f"{where}: max_memory={max_memory!r} must be a number of bytes >= 0 with offload='cpu' (got "
            f"offload={offload!r}: the disk tier keeps nothing in RAM, a device tier keeps everything on its "
            "device); drop it or use offload='cpu'."
        )
    if store_dtype is not None and store_dtype not in STORE_DTYPES.values():
        raise ValueError(
            f"{where}: store_dtype={store_dtype!r} is not supported; valid: None or "
            f"{[f'torch.{n}' for n in STORE_DTYPES]}."
        )
    if dedup_max_bytes < 0:
        raise ValueError(f"{where}: dedup_max_bytes={dedup_max_bytes} must be >= 0 (0 turns sharing off).")
