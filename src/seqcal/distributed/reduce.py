"""Partial statistics: folded in shard order, and named tensors as bytes (safetensors: nothing is unpickled)."""

from __future__ import annotations

import json
import tempfile
import weakref
from collections.abc import Mapping

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from seqcal.algorithms.kept_hessian import SPILL_BYTES, read_exactly
from seqcal.records import Partial as Partial  # re-exported: the fold moved to seqcal.records
from seqcal.records import Statistic
from seqcal.records import fold as fold
from seqcal.records import tensors_of as tensors_of

# A running sum of the shards' statistics of SPILL_BYTES or more (``kept_hessian.KeptHessian``'s threshold: SmolLM2's
# Hessians stay in RAM) waits in a temporary file while the next shard accumulates (``SpilledSum``): on the cpu the
# fold then holds one 8192-wide Hessian (268 MB) at a time, not the shard's beside the total.
_STRIP = 1 << 20  # bytes read back and added at a time
_SPILLABLE = (torch.float32, torch.float64, torch.int64, torch.int32)  # dtypes numpy writes as they are


class SpilledSum:
    """A statistic's running sum in an unnamed temporary file; :meth:`add_to` adds it into the next shard's sum.

    The fold's ``total += partial`` becomes ``partial += total``, read back a strip at a time: IEEE addition is
    commutative, so the bits are the same, and the process holds one of the two at a time.

    Example:
        >>> total, partial = torch.randn(1000), torch.randn(1000)
        >>> torch.equal(SpilledSum(total.clone()).add_to(partial.clone()), total + partial)
        True
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tensor.shape, tensor.dtype
        self.file = tempfile.TemporaryFile()  # unnamed: gone when closed, or when the process ends
        weakref.finalize(self, self.file.close)
        tensor.detach().contiguous().numpy().tofile(self.file)  # a contiguous tensor: written without a copy

    @staticmethod
    def takes(stat: Statistic) -> bool:
        """Whether ``stat`` is a sum large enough to spill, on the cpu, in a dtype the file holds."""
        t = stat.tensor
        return (stat.reduce == "sum" and t.device.type == "cpu" and t.dtype in _SPILLABLE
                and t.is_contiguous() and t.numel() * t.element_size() >= SPILL_BYTES)  # fmt: skip

    def add_to(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor += the spilled sum`` in place (same shape and dtype, contiguous on the cpu); the file is closed."""
        if tensor.shape != self.shape or tensor.dtype != self.dtype or not tensor.is_contiguous():
            raise ValueError(f"a spilled sum {self.dtype} {list(self.shape)} cannot be added to {tensor.dtype} "
                             f"{list(tensor.shape)}")  # fmt: skip
        flat = tensor.view(-1)
        strip = torch.empty(max(_STRIP // tensor.element_size(), 1), dtype=tensor.dtype)
        self.file.seek(0)
        for start in range(0, flat.numel(), strip.numel()):
            part = strip[: min(strip.numel(), flat.numel() - start)]
            read_exactly(self.file, part, "a spilled sum of the shards' statistics")
            flat[start : start + part.numel()].add_(part)
        self.file.close()
        return tensor

    def read(self) -> torch.Tensor:
        """The spilled sum as a new tensor; the file is closed."""
        out = torch.empty(self.shape, dtype=self.dtype)
        self.file.seek(0)
        read_exactly(self.file, out.view(-1), "a spilled sum of the shards' statistics")
        self.file.close()
        return out


def spill_sums(total: Partial, spilled: dict[tuple[str, str], SpilledSum]) -> None:
    """Move the large sums of ``total`` (``SpilledSum.takes``) into ``spilled``, keyed (key, statistic name),
    out of ``total``; a tensor two entries share stays in RAM."""
    ids = [id(s.tensor) for stats in total.values() for s in stats.values()]
    for key, stats in total.items():
        for name in [n for n, s in stats.items() if SpilledSum.takes(s) and ids.count(id(s.tensor)) == 1]:
            spilled[key, name] = SpilledSum(stats.pop(name).tensor)


def fold_spilled(
    total: Partial | None, partial: Partial, spilled: dict[tuple[str, str], SpilledSum]
) -> Partial:
    """``fold(total, partial)`` where some of the fold's sums wait in ``spilled`` (``spill_sums``): each is added
    into ``partial``'s tensor of the same name, which becomes the total's (same bits as the fold); the rest fold
    as usual. A spilled sum the partial has no tensor for stays spilled (``restore_sums`` brings it back)."""
    rest: Partial = {}
    ids = [id(s.tensor) for stats in partial.values() for s in stats.values()]
    total = {} if total is None else total
    for key, stats in partial.items():
        for name, stat in stats.items():
            file = spilled.get((key, name))
            if file is not None and stat.reduce == "sum" and ids.count(id(stat.tensor)) == 1:
                del spilled[key, name]
                total.setdefault(key, {})[name] = Statistic(file.add_to(stat.tensor), "sum")
            else:
                if file is not None:  # folded the usual way, which raises for another reduction
                    total.setdefault(key, {})[name] = Statistic(spilled.pop((key, name)).read(), "sum")
                rest.setdefault(key, {})[name] = stat
    return fold(total, rest)


def restore_sums(total: Partial | None, spilled: dict[tuple[str, str], SpilledSum]) -> Partial | None:
    """``total`` with every sum still in ``spilled`` read back (``spilled`` is emptied)."""
    if not spilled:
        return total
    total = {} if total is None else total
    for (key, name), file in spilled.items():
        total.setdefault(key, {})[name] = Statistic(file.read(), "sum")
    spilled.clear()
    return total


def partial_to_bytes(partial: Partial) -> bytes:
    """One shard's statistics as safetensors bytes (the reduction of each in the metadata)."""
    flat = {f"{key}|{name}": stat.tensor.detach().cpu().contiguous() for key, stats in partial.items()
            for name, stat in stats.items()}  # fmt: skip
    ops = {f"{key}|{name}": stat.reduce for key, stats in partial.items() for name, stat in stats.items()}
    return save_bytes(flat, metadata={"reduce": json.dumps(ops)})


def partial_from_bytes(data: bytes, device: torch.device) -> Partial:
    """The inverse of :func:`partial_to_bytes`, tensors on ``device``."""
    tensors, meta = named_from_bytes(data)
    ops = json.loads(meta["reduce"])
    out: Partial = {}
    for flat, tensor in tensors.items():
        key, _, name = flat.rpartition("|")
        out.setdefault(key, {})[name] = Statistic(tensor.to(device), ops[flat])
    return out


def named_to_bytes(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> bytes:
    """Named tensors and string metadata as safetensors bytes."""
    return save_bytes({k: t.detach().cpu().contiguous() for k, t in tensors.items()}, metadata=dict(meta))


def named_from_bytes(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of :func:`named_to_bytes`."""
    header = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + header]).get("__metadata__", {})
    return load_bytes(data), meta
