"""Sparse checkpoints: the ``sparsity_config`` block, and compressed-tensors' bitmask formats.

Pruned modules (``RunState.sparsity``, set by SparseGPTModifier / WandaPruningModifier) are recorded in
``quantization_config.sparsity_config`` (compressed-tensors' ``SparsityCompressionConfig``: format, global
sparsity, structure, and the pruned modules as ``targets``). By default their weights are stored as the
quantization format stores them (``format: dense``): zeros in the weight, or zero codes in packed int4. That is
also what llm-compressor 0.14 writes, and the only sparse layout that compressed-tensors 0.20 and transformers
load: compressed-tensors removed its sparse compressors after 0.14.

:func:`write_sparse_format` rewrites a finished checkpoint in the formats those older compressed-tensors
versions (and vLLM's 2:4 kernels) read, tensor names and layouts as their compressors wrote them:

- ``sparse-24-bitmask`` (2:4): ``<module>.compressed`` ``[out, in / 2]`` the kept values (the 2 of every 4
  with the largest magnitude, in order; fp8 codes stay fp8), ``<module>.bitmask`` uint8 ``[out, ceil(in / 8)]``
  (little-endian bits, 1 = kept), ``<module>.shape`` int64 ``[2, 1]``; a -0.0 takes a free slot before a +0.0,
  so that it survives where the group has room (a pruned slot has no sign: the format stores none);
- ``sparse-bitmask`` (unstructured): ``compressed`` 1-D the non-zeros row by row, ``bitmask`` as above,
  ``row_offsets`` int64 ``[out]`` (where each row starts in ``compressed``), ``shape`` int64 ``[2]``.

They apply to weights stored whole (dense, int8 or fp8 codes under ``weight``); ``pack-quantized`` int4
weights keep their zero codes packed and are refused. :func:`read_sparse_weight` inverts both exactly.

Example:
    >>> write_sparse_format("out")  # doctest: +SKIP
    'sparse-24-bitmask'
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy
import torch
from compressed_tensors.config import SparsityCompressionConfig
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from seqcal.modifiers.base import RunState

SPARSE_FORMATS = ("sparse-24-bitmask", "sparse-bitmask")
_FP8 = torch.float8_e4m3fn


def sparsity_block(
    model: torch.nn.Module, state: RunState, names: dict[str, list[str]] | None = None
) -> dict:
    """The ``sparsity_config`` of ``config.json`` for the modules ``state.results.sparsity`` lists ({} when none).

    Args:
        model: the model (only shapes are read; weights may be offloaded).
        state: the run's state.
        names: module name -> its checkpoint names (``ModelLayout.checkpoint_names``), default the name itself.

    Returns:
        compressed-tensors' dense ``SparsityCompressionConfig`` as a dict: global_sparsity over all the model's
        parameters, sparsity_structure ("2:4" when every module is 2:4, else "unstructured"), targets = the
        pruned modules by name.
    """
    if not state.results.sparsity:
        return {}
    structures = set(state.results.sparsity.values())
    structure = structures.pop() if len(structures) == 1 else "unstructured"
    zeros = 0.0
    for name in state.results.sparsity:
        weight = model.get_submodule(name).weight
        zeros += state.results.module_errors.get(name, {}).get("sparsity", 0.0) * weight.numel()
    total = sum(p.numel() for p in model.parameters())
    targets = sorted(a for n in state.results.sparsity for a in (names or {}).get(n, [n]))
    config = SparsityCompressionConfig.load_from_registry(
        "dense", global_sparsity=zeros / max(total, 1), sparsity_structure=structure, targets=targets
    )
    return json.loads(config.model_dump_json())


def bitmask_compress(W: Tensor, fmt: str) -> dict[str, Tensor]:
    """The tensors of one weight ``W [out, in]`` in ``fmt`` (local names: compressed, bitmask, shape, ...).

    Raises:
        ValueError: ``sparse-24-bitmask`` and a group of 4 with more than 2 non-zeros.
    """
    raw = W.view(torch.int8) if W.dtype == _FP8 else W  # fp8: gather the bytes
    value = W.float()  # exact for every dtype here
    negative_zero = (value == 0) & torch.signbit(value)  # -0.0 is stored like a non-zero where there is room
    if fmt == "sparse-24-bitmask":
        if W.shape[1] % 4 or int(((value != 0).reshape(-1, 4).sum(1) > 2).sum()):
            raise ValueError(f"sparse-24-bitmask: weight {list(W.shape)} is not 2:4 sparse")
        # the 2 largest magnitudes of each group; zeros fill short groups, -0.0 before +0.0
        key = torch.where(value == 0, negative_zero.float() * 0.5 - 1, value.abs()).reshape(-1, 4)
        kept = torch.zeros_like(key, dtype=torch.bool).scatter_(1, key.topk(2, dim=1).indices, True)
        kept = kept.reshape(W.shape)
        values = raw[kept].reshape(W.shape[0], W.shape[1] // 2)
        out = {"shape": torch.tensor(list(W.shape)).reshape(-1, 1)}
    else:
        kept = (value != 0) | negative_zero
        values = raw[kept]
        counts = kept.sum(dim=1)
        out = {"shape": torch.tensor(list(W.shape)), "row_offsets": torch.cumsum(counts, 0) - counts}
    out["compressed"] = values.view(_FP8) if W.dtype == _FP8 else values
    out["bitmask"] = torch.from_numpy(numpy.packbits(kept.numpy(), axis=-1, bitorder="little"))
    return out


def read_sparse_weight(tensors: dict[str, Tensor]) -> Tensor:
    """The dense weight of one module from its bitmask tensors (local names, either format)."""
    shape = [int(s) for s in tensors["shape"].flatten()]
    bits = numpy.unpackbits(tensors["bitmask"].numpy(), axis=-1, count=shape[-1], bitorder="little")
    kept = torch.from_numpy(bits.reshape(shape).astype(bool))
    values = tensors["compressed"]
    dense = torch.zeros(shape, dtype=values.dtype)
    if values.dtype == _FP8:
        dense.view(torch.int8)[kept] = values.flatten().view(torch.int8)
    else:
        dense[kept] = values.flatten()
    return dense


def write_sparse_format(output_dir: str | Path) -> str:
    """Rewrite the pruned weights of a finished checkpoint in a bitmask format, shard by shard.

    2:4 checkpoints become ``sparse-24-bitmask``, others ``sparse-bitmask``; ``sparsity_config.format`` says
    which. Note: compressed-tensors 0.20 and transformers cannot load these formats (see the module docstring).

    Args:
        output_dir: a checkpoint written by seqcal with a non-empty ``sparsity_config``.

    Returns:
        The format written.

    Raises:
        ValueError: no sparsity_config, or a pruned module stored packed (``pack-quantized``).
    """
    root = Path(output_dir)
    config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    block = config.get("quantization_config", {}).get("sparsity_config") or {}
    if block.get("format") != "dense":
        raise ValueError(
            f"{root}: config.json has no dense sparsity_config to compress (got {block or 'none'})"
        )
    fmt = SPARSE_FORMATS[0] if block.get("sparsity_structure") == "2:4" else SPARSE_FORMATS[1]
    targets = set(block["targets"])
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text(encoding="utf-8")) if index_path.is_file() else None
    shards = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    keys = {shard: set(safe_open(str(root / shard), "pt").keys()) for shard in shards}
    if missing := sorted(t for t in targets if not any(f"{t}.weight" in k for k in keys.values())):
        raise ValueError(
            f"{root}: {missing[0]} (and {len(missing) - 1} more) has no dense or 8-bit 'weight' (pack-quantized "
            f"int4 keeps its zero codes packed); {fmt} applies to dense, int8 and fp8 weights only"
        )
    for shard in shards:  # one shard in memory at a time
        tensors = load_file(str(root / shard))
        for name in sorted(t for t in targets if f"{t}.weight" in keys[shard]):
            for local, value in bitmask_compress(tensors.pop(f"{name}.weight"), fmt).items():
                tensors[f"{name}.{local}"] = value
                if index:
                    index["weight_map"][f"{name}.{local}"] = shard
            if index:
                del index["weight_map"][f"{name}.weight"]
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
    if index:
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True), encoding="utf-8")
    block["format"] = fmt
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
    return fmt
