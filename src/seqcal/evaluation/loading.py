"""Load a checkpoint for evaluation, seqcal's own compressed-tensors checkpoints included.

Checkpoints written before ``quantization_config`` carried ``dequantize: true`` for asymmetric packed
weights (see ``seqcal.checkpoint.config.needs_dequantize_load``) do not load with a plain
``from_pretrained`` under transformers >= 5.24; this loader asks for ``dequantize=True`` for them. Minifloat
weights with quantized activations (NVFP4 W4A4, MXFP4) run in transformers in bfloat16 only: they are loaded so.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from seqcal.checkpoint.config import needs_dequantize_load, runs_only_in_bfloat16

logger = logging.getLogger("seqcal")


def load_causal_lm(path: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path)`` in eval mode, loading asymmetric packed checkpoints too.

    Args:
        path: a model directory (plain or compressed-tensors).
        dtype: the dtype to load in.

    Returns:
        The model in eval mode.

    Example:
        >>> model = load_causal_lm("llama-w4a16-asym", torch.float32)  # doctest: +SKIP
    """
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    kwargs: dict[str, Any] = {}
    config = Path(path) / "config.json"
    block = (
        json.loads(config.read_text(encoding="utf-8")).get("quantization_config")
        if config.is_file()
        else None
    )
    if isinstance(block, dict) and needs_dequantize_load(block) and not block.get("dequantize"):
        kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    if isinstance(block, dict) and runs_only_in_bfloat16(block) and dtype != torch.bfloat16:
        logger.warning(
            "seqcal: %s has fp4/MX weights with quantized activations, which transformers (compressed-tensors "
            "0.20) runs in bfloat16 only; loading it in bfloat16 instead of %s",
            path,
            dtype,
        )
        dtype = torch.bfloat16
    with warnings.catch_warnings():  # "the quantization_config from the model will be used": intended
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()
    if isinstance(block, dict):
        apply_online_transforms(model, block, Path(path))
    return model


ONLINE_LOCATIONS = ("input", "output")


def apply_online_transforms(model: torch.nn.Module, block: dict, path: Path) -> None:
    """The online rotations of ``block["transform_config"]`` (QuIP's, SpinQuant's R4), with the checkpoint's matrices.

    transformers 5.24 loads compressed-tensors checkpoints without their ``transform_config``; the rotations
    fused into the weights need nothing, the online ones are applied here by compressed-tensors, as vLLM does.

    Args:
        model: the loaded model.
        block: the checkpoint's ``quantization_config``.
        path: the checkpoint directory (its safetensors hold the matrices, ``<module>.<group>_<location>.weight``).
    """
    groups = (block.get("transform_config") or {}).get("config_groups") or {}
    online = {}
    for name, group in groups.items():
        if apply := [a for a in group.get("apply", []) if a.get("location") in ONLINE_LOCATIONS]:
            online[name] = {**group, "apply": apply}
    if not online:
        return
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from safetensors import safe_open

    apply_transform_config(model, TransformConfig.model_validate({"config_groups": online}))
    params = dict(model.named_parameters(remove_duplicate=False))
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f, torch.no_grad():
            for key in f.keys():
                if key in params and any(key.endswith(f"_{loc}.weight") for loc in ONLINE_LOCATIONS):
                    params[key].copy_(f.get_tensor(key))  # shared by every module of its size
