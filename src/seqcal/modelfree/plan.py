"""What each source shard's job writes: its tensors grouped by module, in the checkpoint's order, and which
weights are quantized with which scheme (and, for NVFP4, with which fused partners' global scale).

The targets and ignore patterns resolve on the skeleton with ``QuantizationModifier.validate``, the recipe's own
resolution (the first group that matches wins, widths checked, ignore entries that match nothing reported). The
jobs are plain data, sent to the worker processes; an output file holds the tensors of the source file of the
same name, so the shards are independent and a run resumes by file.

Example:
    >>> plan = plan_jobs(source, skeleton, modifier)  # doctest: +SKIP
    >>> plan.jobs[0].units[1].quantize.module  # doctest: +SKIP
    'model.layers.0.self_attn.q_proj'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.utils.match import match_name

from seqcal.modelfree.skeleton import Skeleton, natural_key
from seqcal.modelfree.source import SourceCheckpoint, SourceError
from seqcal.modelfree.stored import SAFETENSORS_NAMES, Stored
from seqcal.modifiers.formats import fused_groups
from seqcal.modifiers.quantization import QuantizationModifier
from seqcal.modifiers.schemes import strategy_of


@dataclass(frozen=True)
class Quantize:
    """One weight to quantize.

    Attributes:
        module: the module's name in the skeleton (what the patterns matched).
        key: its weight's checkpoint key; the compressed tensors are written under the same module prefix.
        scheme: its scheme.
        fused: NVFP4: (module name, checkpoint key, file) of every member of its fused group (itself included),
            whose weights give the one global scale vLLM's merged weight has; empty otherwise.
        keep: the weight is written in the FP8 form the source stores it in, not rounded (``scheme`` describes
            that form; ``seqcal.modelfree.keep``).
        cast: the float dtype (torch name) transformers' model holds the weight in where the source stores another
            (a float32 file under a bfloat16 config): ``oneshot`` rounds that, so the weight and its fused
            partners are cast to it first; None: as stored.
    """

    module: str
    key: str
    scheme: QuantizationScheme
    fused: tuple[tuple[str, str, str], ...] = ()
    keep: bool = False
    cast: str | None = None


@dataclass(frozen=True)
class Unit:
    """The tensors of one module in one file, written together, sorted by key (as ``oneshot``'s writer does).

    Attributes:
        keys: the source keys (the quantized weight's among them).
        quantize: the weight to quantize, or None (every tensor copied as it is).
        casts: (key, torch dtype name) of the tensors written in another float dtype than the source stores them
            in: the one transformers' model holds them in, as ``oneshot`` writes them (``Skeleton.dtypes``).
    """

    keys: tuple[str, ...]
    quantize: Quantize | None = None
    casts: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Job:
    """One source file -> the output file of the same name.

    Attributes:
        file: the file name.
        units: its modules, in the checkpoint's order.
        stored: how the worker reads the tensors (a quantized source's weights dequantized).
    """

    file: str
    units: tuple[Unit, ...]
    stored: Stored = field(default_factory=Stored)


@dataclass
class Plan:
    """Every job, and which module gets which scheme (module name -> scheme, in the model's order)."""

    jobs: list[Job]
    modules: dict[str, QuantizationScheme] = field(default_factory=dict)


def plan_jobs(source: SourceCheckpoint, skeleton: Skeleton, modifier: QuantizationModifier) -> Plan:
    """Resolve the modifier's targets on the skeleton and lay out one job per source file.

    Raises:
        ValueError: a target matches nothing, a group size does not divide a module's inputs (the recipe's own
            checks), or a quantized module's weight is not a 2-D tensor of the source.
    """
    modifier.validate(skeleton.model)
    if not skeleton.known:
        _refuse_stacked(source, modifier)
    modules = dict(modifier.modules)
    keys = {name: skeleton.weight_key(name) for name in modules}
    for name, key in keys.items():
        info = source.info.get(key)
        if info is None or len(info.shape) != 2:
            found = "is not in the checkpoint" if info is None else f"has shape {list(info.shape)}"
            raise SourceError(
                f"model-free: the weight of {name} ({key}) {found}; model-free quantizes 2-D Linear weights stored "
                f"one per module, add {name} to ignore"
            )
    fused = _fused(modules, keys, source, skeleton)
    casts = _casts(source, skeleton)
    quantize = {keys[n]: Quantize(n, keys[n], s, fused.get(n, ()), cast=casts.pop(keys[n], None))
                for n, s in modules.items()}  # fmt: skip
    rank = _ranks(source, skeleton)
    jobs = []
    for file in source.files:
        units: dict[tuple, list[str]] = {}
        for key in source.keys_of(file):
            units.setdefault(rank[key], []).append(key)
        ordered = [tuple(units[r]) for r in sorted(units)]
        job_units = tuple(
            Unit(
                ks,
                next((quantize[k] for k in ks if k in quantize), None),
                tuple((k, casts[k]) for k in ks if k in casts),
            )
            for ks in ordered
        )
        read = {k for u in job_units for k in u.keys} | {
            m[1] for u in job_units if u.quantize for m in u.quantize.fused
        }
        jobs.append(Job(file, job_units, source.stored.subset(read)))
    return Plan(jobs, modules)


def _casts(source: SourceCheckpoint, skeleton: Skeleton) -> dict[str, str]:
    """Key -> torch dtype name, for each tensor whose float dtype in the model differs from the stored one."""
    names = {getattr(torch, n): code for n, code in SAFETENSORS_NAMES.items()}
    out = {}
    for key, dtype in skeleton.dtypes().items():
        info = source.info.get(key)
        if info is None or dtype not in names:
            continue
        if info.dtype in names.values() and info.dtype != names[dtype]:
            out[key] = str(dtype).removeprefix("torch.")
    return out


def _refuse_stacked(source: SourceCheckpoint, modifier: QuantizationModifier) -> None:
    """A 3-D weight the targets reach (experts stacked in one tensor) would stay in full precision unnoticed: in
    a tree built from names it is no Linear. Refused, with the ignore pattern that keeps it as it is."""
    targets = [t for group in modifier.groups.values() for t in group.targets]
    for key, info in source.info.items():
        module = key.rpartition(".")[0]
        if len(info.shape) != 3 or any(match_name(module, i) or match_name(key, i) for i in modifier.ignore):
            continue
        if any(not t.startswith("re:") and "." not in t or match_name(module, t) for t in targets):
            raise SourceError(
                f"model-free: {key} holds {info.shape[0]} experts' weights stacked in one {list(info.shape)} tensor, "
                f"which model-free does not take apart; add 're:{re.escape(module)}' to ignore to keep it in full "
                "precision, or quantize with oneshot (transformers' class takes the experts apart)"
            )


def _ranks(source: SourceCheckpoint, skeleton: Skeleton) -> dict[str, tuple]:
    """Source key -> its place in the output: its module's place in the model (``oneshot``'s order); keys the
    model does not have (tensors transformers would drop) after all others, by module, in natural order."""
    rank: dict[str, tuple] = {}
    for i, (_, keys) in enumerate(skeleton.module_keys()):
        for key in keys:
            rank[key] = (i,)
    extra = len(rank) + 1
    for key in source.info:
        if key not in rank:
            rank[key] = (extra, *natural_key(key.rpartition(".")[0]))
    return rank


def _fused(
    modules: dict[str, QuantizationScheme], keys: dict[str, str], source: SourceCheckpoint, skeleton: Skeleton
) -> dict[str, tuple[tuple[str, str, str], ...]]:
    """NVFP4 modules -> the members of their fused group (those oneshot shares one global scale over), each as
    (module name, checkpoint key, file); a module alone in its group is its own member."""
    nvfp4 = [n for n, s in modules.items() if strategy_of(s.weights) == "tensor_group"]
    out = {n: ((n, keys[n], source.info[keys[n]].file),) for n in nvfp4}
    for group in fused_groups(skeleton.model, nvfp4):
        members = tuple((m, keys[m], source.info[keys[m]].file) for m in group)
        out.update(dict.fromkeys(group, members))
    return out
