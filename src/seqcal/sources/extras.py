"""Tensors a checkpoint holds beside the model class's: the multi-token-prediction (MTP) layers.

DeepSeek-V3/R1, GLM-4.5 and Qwen3-Next ship one or more MTP layers after the decoder stack: ``model.layers.<n>.*``
for ``n >= num_hidden_layers`` (DeepSeek, GLM) or ``mtp.*`` (Qwen3-Next, Qwen3.5). transformers' model classes do
not hold them (they list them in ``_keys_to_ignore_on_load_unexpected``) and load them apart, for speculative
decoding (``MtpModel``; vLLM's MTP drafts). A quantized checkpoint of such a model keeps them under their names,
as the source has them: each read as any other untargeted tensor (a quantized source's weights dequantized to the
run's dtype), never calibrated, and their Linear modules named in the quantization_config's ``ignore`` so that
loaders read them in full precision.

Example:
    >>> extra_tensor_names(model)[:2]  # doctest: +SKIP
    ['model.layers.61.eh_proj.weight', 'model.layers.61.embed_tokens.weight']
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from seqcal.sources.checkpoint import _read_copy, checkpoint_files, quantized_source

logger = logging.getLogger("seqcal")

_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")


def _source_dir(model: torch.nn.Module) -> Path | None:
    """The checkpoint directory the model was read from, if it names one."""
    path = getattr(model, "name_or_path", None)
    return Path(path) if path and Path(path, "config.json").is_file() else None


def _is_extra(name: str, layers: int) -> bool:
    """``name`` belongs to an MTP layer: ``mtp.*`` or a decoder layer index past the model's stack."""
    if name.startswith("mtp."):
        return True
    match = _LAYER.match(name)
    return match is not None and int(match.group(1)) >= layers


def extra_tensor_names(model: torch.nn.Module) -> list[str]:
    """The source checkpoint's MTP tensors the model does not hold, in name order (empty: none, or no source dir).

    Args:
        model: the model being quantized (its ``name_or_path`` is the checkpoint directory it was read from).

    Returns:
        Tensor names as the full-precision checkpoint names them (a quantized weight's, not its scales').
    """
    path = _source_dir(model)
    layers = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    if path is None or not isinstance(layers, int):
        return []
    source = quantized_source(path)
    names = source.names() if source is not None else list(checkpoint_files(path))
    held = set(model.state_dict(keep_vars=True))
    return sorted(n for n in names if _is_extra(n, layers) and n not in held)


def write_extra_tensors(writer: Any, model: torch.nn.Module) -> list[str]:
    """Add the source's MTP tensors (``extra_tensor_names``) to ``writer``, one at a time: a quantized weight
    dequantized, every floating point tensor in the model's dtype (the run's), others as stored.

    Args:
        writer: a ``CheckpointWriter`` (its ``add_tensor``).
        model: the model being quantized.

    Returns:
        The modules whose 2-D ``weight`` was written (Linears, embeddings, heads): what ``ignore_modules`` adds.
    """
    names = extra_tensor_names(model)
    if not names:
        return []
    dtype = getattr(model, "dtype", torch.float32)
    path = _source_dir(model)
    source = quantized_source(path)
    files = source.files if source is not None else checkpoint_files(path)
    modules = []
    for name in names:
        if source is not None:
            tensor = source.read(name, dtype)
        else:
            tensor = _read_copy(files[name], name)
            tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
        writer.add_tensor(name, tensor.contiguous())
        if name.endswith(".weight") and tensor.dim() == 2:
            modules.append(name.removesuffix(".weight"))
    logger.info(
        "seqcal: %d tensors of the source's multi-token-prediction layers kept (%s ...), unquantized",
        len(names),
        names[0],
    )
    return modules


def ignore_modules(config: dict[str, Any], modules: list[str]) -> dict[str, Any]:
    """``config`` (config.json's content) with ``modules`` added to its quantization_config's ``ignore``, so that
    compressed-tensors loaders (transformers, vLLM) read them unquantized; unchanged without one."""
    block = config.get("quantization_config")
    if isinstance(block, dict) and modules:
        known = set(block.get("ignore") or [])
        block["ignore"] = [*(block.get("ignore") or []), *(m for m in modules if m not in known)]
    return config
