"""Partial statistics: folded in shard order, and named tensors as bytes (safetensors: nothing is unpickled)."""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from seqcal.records import Partial as Partial  # re-exported: the fold moved to seqcal.records
from seqcal.records import Statistic
from seqcal.records import fold as fold
from seqcal.records import tensors_of as tensors_of


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
