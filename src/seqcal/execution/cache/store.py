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
here), the byte records in ``seqcal.execution.cache.entries``, the safetensors files in ``seqcal.execution.cache.spill``
and the tiers' devices in ``seqcal.execution.cache.tiers``.

Example:
    >>> with ActivationCache(offload="disk") as cache:
    ...     cache.put(0, "hidden", (torch.ones(2, 3), {"mask": None}))
    ...     cache.fetch(0, "hidden")[0].shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Literal, Self

import torch

from seqcal.execution.cache.entries import (
    _Alias,
    _ContentIndex,
    _Entry,
    _same_device,
    _Stored,
    _TensorRef,
    _view,
)
from seqcal.execution.cache.spill import SpillFolder
from seqcal.execution.cache.storage import EntryStorage
from seqcal.execution.cache.tiers import OFFLOAD_TIERS as OFFLOAD_TIERS  # re-exported: the tiers' own module
from seqcal.execution.cache.tiers import same_device as same_device
from seqcal.execution.cache.tiers import tier_device
from seqcal.execution.cache.transfers import Transfers
from seqcal.execution.cache.tree import flatten, unflatten

STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
DEDUP_MAX_BYTES = 4 << 20
# Copies to and from a CUDA device on side streams, overlapping the compute (transfers.py); False: on the compute
# stream, as torch's non-blocking copies go. The default of ActivationCache's ``overlap``.
OVERLAP = True


class CacheMissError(KeyError):
    """A (batch, name) the cache does not hold; the message lists what it holds."""

    def __str__(self) -> str:  # KeyError would repr() the message and escape its newlines
        return str(self.args[0])


class ActivationCache(EntryStorage):
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
