"""When a streaming writer writes each module: after the last subgraph that holds it.

The safetensors checkpoint (``seqcal.checkpoint.streaming``) and the GGUF file (``seqcal.gguf.stream``) are
written as subgraphs finish: a module's tensors go out once no later subgraph can change them, and a module no
subgraph holds (a vision tower run inside opaque code, a tied output projection) at the end. On a layer of its
own below both, it reads a subgraph only through its ``index`` and ``holds(name)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def module_owners(model: torch.nn.Module, subgraphs: Sequence[Any], *, buffers: bool) -> dict[str, int]:
    """Module name -> index of the last subgraph that holds it (-1: none; written at the end).

    Args:
        model: the model being written.
        subgraphs: the run's subgraphs, in execution order (each with ``index`` and ``holds(name)``).
        buffers: count modules that hold buffers but no parameters too (the safetensors checkpoint stores
            buffers; the GGUF file only parameters).

    Returns:
        An entry for every module with parameters of its own (and, with ``buffers``, buffers), in the model's
        module order.

    Example:
        >>> module_owners(model, subgraphs, buffers=True)["lm_head"]  # doctest: +SKIP
        -1
    """
    owner: dict[str, int] = {}
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)) and not (buffers and module._buffers):
            continue
        owner[name] = -1
        for sg in subgraphs:
            if sg.holds(name):
                owner[name] = sg.index
    return owner
