"""What a module writes to the checkpoint, ready for the writer's thread: its tensors as host copies, and a weight
the run never onloaded copied from its file in pieces (``FileCopy``) rather than read whole.

A weight still on meta when its module is written was not changed by the run (a changed one is on the module or
in the store's overrides): an embedding read by rows (``execution.embedding_rows``), the lm_head after the last
quantized layer, a vision tower run in opaque code. Where the store reads it as a file stores it, the checkpoint
gets the file's bytes (cast to the run's dtype on the way, as onloading casts them), so a 1.85 GB vocabulary is
never in memory; other weights (a quantized source's, dequantized as they are read) are onloaded on the cpu for
the moment of the copy, as before.

Example:
    >>> tensors = module_tensors_for_write(writer, weights, model, ["model.embed_tokens"], {})  # doctest: +SKIP
    >>> tensors[0]["model.embed_tokens.weight"]
    FileCopy(path='.../model.safetensors', key='model.embed_tokens.weight', dtype=torch.bfloat16)
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from seqcal.checkpoint.writer import CheckpointWriter
from seqcal.sources.files import FileCopy


def _file_copies(weights: Any, name: str, module: torch.nn.Module) -> dict[int, FileCopy] | None:
    """id(parameter) -> its FileCopy, for ``module``'s own parameters on meta; None when one of them is not
    stored as the store reads it (it is onloaded instead)."""
    copies = {}
    for local, param in module.named_parameters(recurse=False):
        if param.device.type != "meta":
            continue
        where = weights.store.stored_in_file(f"{name}.{local}" if name else local)
        if where is None:
            return None
        copies[id(param)] = FileCopy(*where, param.dtype)
    return copies


def module_tensors_for_write(
    writer: CheckpointWriter,
    weights: Any,
    model: torch.nn.Module,
    names: Sequence[str],
    quantized: Mapping[str, Any],
) -> list[dict[str, torch.Tensor | FileCopy]]:
    """Each module of ``names``'s checkpoint tensors (``CheckpointWriter.module_tensors``) as host copies, or file
    copies for its weights on meta; ``weights``: the run's ``SubgraphWeights`` (None: every weight in memory)."""
    modules = {name: model.get_submodule(name) for name in names}
    copies = {}
    if weights is not None:
        copies = {  # a quantized module's weight is checked against its codes: onloaded
            n: c
            for n, m in modules.items()
            if n not in quantized and (c := _file_copies(weights, n, m)) is not None
        }
    onloaded = [n for n in names if n not in copies]
    # host copies: the writer's thread never touches device memory nor a parameter released later
    with weights.modules_onloaded(onloaded) if weights is not None else contextlib.nullcontext():
        return [
            _host_tensors(writer, weights, name, module, quantized, copies.get(name))
            for name, module in modules.items()
        ]


def _host_tensors(writer: CheckpointWriter, weights: Any, name: str, module: torch.nn.Module,
                  quantized: Mapping[str, Any], files: dict[int, FileCopy] | None) -> dict[str, torch.Tensor | FileCopy]:  # fmt: skip
    """One module's checkpoint tensors: host copies, its weights on meta as their ``files``; a value on meta that
    is none of them (a key conversion that computes its tensor) has the module onloaded for it instead."""
    tensors = writer.module_tensors(name, module, quantized.get(name))
    if files and any(v.device.type == "meta" and id(v) not in files for v in tensors.values()):
        with weights.modules_onloaded([name]):
            return _host_tensors(writer, weights, name, module, quantized, None)
    files = files or {}
    return {k: files[id(v)] if id(v) in files else v.detach().to("cpu") for k, v in tensors.items()}
