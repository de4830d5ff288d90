"""One job: a source file's tensors read one module at a time, the targeted weights quantized with round to
nearest, everything written to the output file of the same name.

The quantization is ``QuantizationModifier``'s (``rtn_quantize_weight``, its codes without the fake-quantized
weight, taken a chunk of rows at a time: ``seqcal.modelfree.rows``), the NVFP4 global scale of a fused group
``QuantizationModifier``'s (``shared_global_scales``), the stored tensors the checkpoint writer's (``_compressed``
and ``_ShardFile``): the same functions ``oneshot`` runs, so the bytes agree by construction. The file is written
as ``<name>.partial`` and renamed when complete, so a killed run leaves no file that looks finished.

Example:
    >>> run_job(plan.jobs[0], "llama", "llama-w4a16")  # doctest: +SKIP
    JobResult(file='model.safetensors', ...)
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

from seqcal.checkpoint.shard_file import HEADER_RESERVE, _ShardFile
from seqcal.checkpoint.tensors import _compressed
from seqcal.modelfree.plan import Job, Quantize
from seqcal.modelfree.rows import rtn_by_rows
from seqcal.modelfree.stored import Stored
from seqcal.modifiers.formats import shared_global_scales
from seqcal.modifiers.keep_source import compressed_scale
from seqcal.records import QuantizedWeight
from seqcal.sources.files import read_tensor
from seqcal.sources.fp8 import scale_key

PARTIAL = ".partial"  # suffix of an output file being written
# per header entry: the key, its JSON punctuation, dtype, shape and offsets (``_ShardFile.fits``' bound)
_ENTRY_BYTES = 32 + 48 + 8 * 4
_COMPRESSED_ENTRIES = 5  # at most: packed/weight, scale, zero point, shape, global scale
_SUFFIX = len("weight_global_scale")


@dataclass(frozen=True)
class JobResult:
    """What a finished job wrote.

    Attributes:
        file: the output file's name.
        keys: its tensor keys.
        nbytes: its tensors' bytes.
        peak_rss: the peak resident memory of the process that ran it, in bytes.
    """

    file: str
    keys: tuple[str, ...]
    nbytes: int
    peak_rss: int


def run_job(job: Job, source_dir: str, output_dir: str, device: str = "cpu") -> JobResult:
    """Write ``job``'s output file in ``output_dir`` from the source file in ``source_dir``.

    Args:
        job: from ``plan_jobs``.
        source_dir: the source checkpoint directory.
        output_dir: the output directory (exists).
        device: where the weights are quantized ("cpu", "cuda:0", ...).

    Returns:
        The file's keys and size.
    """
    source, out = Path(source_dir), Path(output_dir)
    partial = out / (job.file + PARTIAL)
    shard = _ShardFile(partial, reserve=_reserve(job))
    scales: dict[str, Tensor] = {}  # NVFP4 global scales of this file's fused groups, each computed once
    keys: list[str] = []
    try:
        for unit in job.units:
            tensors: dict[str, Tensor | None] = dict.fromkeys(unit.keys)  # None: copied as stored
            if unit.quantize is not None and unit.quantize.keep:
                del tensors[unit.quantize.key]
                tensors.update(_kept(unit.quantize, job.stored, source))
            elif unit.quantize is not None:
                q = unit.quantize
                del tensors[q.key]
                weight = job.stored.read(source, q.key, job.file)
                tensors.update(_quantized(q, weight, job.stored, source, scales, torch.device(device)))
                del weight
            casts = dict(unit.casts)
            for key in sorted(tensors):
                tensor = tensors[key]
                if tensor is None:  # as stored, or in the dtype transformers' model holds it in
                    job.stored.copy(source, key, job.file, shard, casts.get(key))
                else:
                    shard.add(key, tensor)
                keys.append(key)
            del tensors
        shard.finish({"format": "pt"})
    except BaseException:
        shard.discard()
        raise
    os.replace(partial, out / job.file)  # complete: from now on a resumed run keeps it
    return JobResult(job.file, tuple(keys), shard.size, peak_rss())


def _quantized(q: Quantize, weight: Tensor, stored: Stored, source: Path, scales: dict[str, Tensor],
               device: torch.device) -> dict[str, Tensor]:  # fmt: skip
    """The tensors compressed-tensors stores for ``q``'s weight, under its checkpoint keys."""
    dtype = getattr(torch, q.cast) if q.cast else None  # the model's dtype, which oneshot rounds
    W = weight.to(device=device, dtype=dtype)  # [out, in]
    global_scale = None
    if q.fused:  # NVFP4: one global scale over the fused group, from the weights before any is quantized
        files = {m: (key, file) for m, key, file in q.fused}

        def read(name: str) -> Tensor:
            key, file = files[name]
            return W if name == q.module else stored.read(source, key, file).to(device=device, dtype=dtype)

        shared_global_scales(_Members(read), [q.module], [tuple(files)], scales)
        global_scale = scales[q.module]
    qw = rtn_by_rows(W, q.scheme, global_scale)  # a chunk of rows at a time: the same codes
    prefix = q.key.removesuffix("weight")
    return {prefix + k: v.to("cpu") for k, v in _compressed(q.module, qw, tuple(weight.shape)).items()}


def _kept(q: Quantize, stored: Stored, source: Path) -> dict[str, Tensor]:
    """The tensors compressed-tensors stores for a weight kept in its FP8 source form (``seqcal.modelfree.keep``):
    the float8 weight and its scales as stored, as ``KeepSourceFormatModifier`` records them."""
    parts = {key: read_tensor(str(source / file), key) for key, file in stored.parts[q.key]}
    codes = parts[q.key]
    qw = QuantizedWeight(q=codes, scale=compressed_scale(parts[scale_key(q.key)]), zero_point=None, g_idx=None,
                         scheme=q.scheme)  # fmt: skip
    prefix = q.key.removesuffix("weight")
    return {prefix + k: v for k, v in _compressed(q.module, qw, tuple(codes.shape)).items()}


class _Members:
    """The fused group's weights as ``shared_global_scales`` reads them (``model.get_submodule(name).weight``),
    each read from its file when asked."""

    def __init__(self, read: Callable[[str], Tensor]) -> None:
        self.read = read

    def get_submodule(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(weight=self.read(name))


def _reserve(job: Job) -> int:
    """Header room of the output file: the checkpoint writer's, or more for a file of very many tensors."""
    need = 64
    for unit in job.units:
        for key in unit.keys:
            if unit.quantize is not None and key == unit.quantize.key:
                need += _COMPRESSED_ENTRIES * (len(key) + _SUFFIX + _ENTRY_BYTES)
            else:
                need += len(json.dumps(key)) + _ENTRY_BYTES
    mib = 1024**2
    return HEADER_RESERVE if need <= HEADER_RESERVE else -(-need // mib) * mib


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
