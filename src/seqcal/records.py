"""The data that crosses stages: what modifiers produce and what checkpoint/ and distributed/ read.

Plain dataclasses with no behaviour beyond their own checks, at the bottom of the package's layers (they
import only torch and compressed-tensors), so that the checkpoint writer, the shard reduction and the modifiers
share them without importing one another:

    QuantizedWeight   one Linear's compressed weight (codes, scales, the scheme it follows); its scheme
                      travels with it (``scheme_record`` / ``scheme_from_record``: between processes, into
                      resume files), so nothing rebuilds a result from the recipe
    Statistic         one partial statistic of a virtual shard and how partials combine (sum, max, min);
                      ``fold`` combines them in shard order, ``tensors_of`` unwraps the result
    Mapping, Fold     a producer -> consumers pair, and smoothing scales folded into one
                      (``fold_records`` / ``folds_from``: their JSON form, saved and sent beside the scales)

``seqcal.modifiers.base``, ``seqcal.mappings`` and ``seqcal.distributed.reduce`` re-export these names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationScheme


@dataclass
class QuantizedWeight:
    """The compressed form of one Linear weight, produced by a modifier and written by ``save``.

    Attributes:
        q: integer codes (int8 storage; fp8 for float schemes) in the original column order, [out, in].
        scale: per tensor [1], channel [out, 1] or group [out, in // group_size].
        zero_point: same shape as scale (None for symmetric schemes).
        g_idx: group index of each input column ([in], int32) for activation ordering "group", else None.
        scheme: the compressed-tensors QuantizationScheme the codes follow (weights and activations). It is the
            module's own: a modifier may give each module another one (3, 4 or 8 bits by the module's error), and
            the other processes, a resumed run and ``config.json``'s config groups take it from here, never
            from the recipe.
        loss: the solver's objective (GPTQ loss), None for round-to-nearest.
        global_scale: float32 [1] NVFP4 global scale (``tensor_group`` schemes; scale is then fp8-valued and
            the effective scale is ``scale / global_scale``), else None.
        input_scale: calibrated static input scale ([1] per tensor, [in // group_size] per group) for schemes
            with static input activations, else None.
        input_zero_point: its zero point (int8 codes) when those activations are asymmetric, else None.
        input_global_scale: float32 [1] calibrated global scale of NVFP4 input activations (fp4 inputs whose
            fp8 group scales are computed at inference, ``dynamic: local``), else None.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    g_idx: torch.Tensor | None
    scheme: Any  # compressed_tensors.quantization.QuantizationScheme
    loss: float | None = None
    global_scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    input_zero_point: torch.Tensor | None = None
    input_global_scale: torch.Tensor | None = None


def scheme_record(scheme: Any, name: str = "a quantized module") -> dict[str, Any]:
    """``scheme`` as JSON-ready data (compressed-tensors' own field names), to send or save beside the codes.

    Args:
        scheme: a QuantizedWeight's scheme.
        name: the module it belongs to (for the error).

    Raises:
        TypeError: ``scheme`` is no QuantizationScheme.

    Example:
        >>> scheme_record(QuantizationScheme(targets=["Linear"]))["targets"]
        ['Linear']
    """
    if not isinstance(scheme, QuantizationScheme):
        raise TypeError(
            f"{name}: QuantizedWeight.scheme is a {type(scheme).__name__}, not a compressed-tensors "
            "QuantizationScheme; build it with QuantizationScheme(targets=..., weights=QuantizationArgs(...)) or "
            "take the module's from the modifier (self.modules[name])"
        )
    return scheme.model_dump(mode="json")


def scheme_from_record(record: dict[str, Any]) -> QuantizationScheme:
    """The QuantizationScheme ``scheme_record`` wrote (equal to the one it was written from)."""
    # a GGUF type's scheme (seqcal.gguf.scheme), which builds on compressed-tensors'
    if "gguf_type" in record:
        from seqcal.gguf.scheme import GGUFScheme

        return GGUFScheme.model_validate(record)
    return QuantizationScheme.model_validate(record)


# How partial statistics of virtual shards combine (``fold``): elementwise, in shard order.
REDUCTIONS = ("sum", "max", "min")


@dataclass
class Statistic:
    """One partial statistic a modifier accumulated over a virtual shard of the calibration batches.

    Attributes:
        tensor: the shard's partial value (a sum, or a running max / min).
        reduce: how partials of several shards combine, elementwise: "sum", "max" or "min".
    """

    tensor: torch.Tensor
    reduce: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"Statistic.reduce={self.reduce!r} is not one of {REDUCTIONS}")


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


@dataclass(frozen=True)
class Mapping:
    """A producer whose output the consumers read directly; smoothing scales fold between them.

    Attributes:
        producer: qualified name of the norm or Linear whose output is scaled by ``1 / s``.
        consumers: qualified names of the Linears reading that output (their columns are scaled by ``s``).
        kind: ``"norm"`` (1-D weight, optional bias) or ``"linear"`` (the producer's output rows).
    """

    producer: str
    consumers: tuple[str, ...]
    kind: str


@dataclass(frozen=True)
class Fold:
    """Scales folded into a mapping: its consumers now read ``X / scales`` (``scales [in]`` float32)."""

    mapping: Mapping
    scales: torch.Tensor


def fold_records(folds: list[Fold]) -> str:
    """The mappings of ``folds`` as JSON (saved, or sent, next to their scales)."""
    return json.dumps([[f.mapping.producer, list(f.mapping.consumers), f.mapping.kind] for f in folds])


def folds_from(records: str, scales: list[torch.Tensor]) -> list[Fold]:
    """The folds of ``fold_records`` with their scales, in order."""
    return [
        Fold(Mapping(p, tuple(c), k), s) for (p, c, k), s in zip(json.loads(records), scales, strict=True)
    ]
