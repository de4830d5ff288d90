"""Partial statistics: folded in shard order, and named tensors as bytes (safetensors: nothing is unpickled)."""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from seqcal.modifiers.base import Statistic

Partial = dict[str, dict[str, Statistic]]  # key (a unit of modifier state) -> statistic name -> value
_OPS = {"sum": torch.Tensor.add_, "max": lambda a, b: torch.maximum(a, b, out=a),
        "min": lambda a, b: torch.minimum(a, b, out=a)}  # fmt: skip


def fold(total: Partial | None, partial: Partial) -> Partial:
    """``total`` combined with the next shard's ``partial``, in place: ``total[k] = op(total[k], partial[k])``.

    Called once per shard, in shard order, by whichever process folds (one process, or a subgraph's owner):
    the same float operations in the same order, so the same bits. A key only one side has is taken as is
    (an expert that got no token in a shard has no partial there).

    Args:
        total: the fold of the shards before, or None for the first.
        partial: the next shard's statistics (``Modifier.partial_statistics``); its tensors are taken over.

    Returns:
        The fold so far.

    Example:
        >>> a = {"h": {"n": Statistic(torch.tensor([1.0]))}}
        >>> fold(fold(None, a), {"h": {"n": Statistic(torch.tensor([2.0]))}})["h"]["n"].tensor
        tensor([3.])
    """
    total = {} if total is None else total
    taken = {id(s.tensor) for stats in total.values() for s in stats.values()}
    for key, stats in partial.items():
        mine = total.setdefault(key, {})
        for name, stat in stats.items():
            if (
                name not in mine
            ):  # taken over, unless another key holds the same tensor (it is added in place)
                mine[name] = (
                    stat if id(stat.tensor) not in taken else Statistic(stat.tensor.clone(), stat.reduce)
                )
                taken.add(id(mine[name].tensor))
                continue
            if mine[name].reduce != stat.reduce:
                raise ValueError(
                    f"statistic {key}/{name}: reduce {stat.reduce!r} after {mine[name].reduce!r}"
                )
            _OPS[stat.reduce](mine[name].tensor, stat.tensor.to(mine[name].tensor.device))
    return total


def tensors_of(total: Partial) -> dict[str, dict[str, torch.Tensor]]:
    """The folded values, as ``Modifier.load_statistics`` takes them."""
    return {key: {name: stat.tensor for name, stat in stats.items()} for key, stats in total.items()}


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
