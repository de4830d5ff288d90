"""Tiny frontier architectures saved as their FP8 releases ship, for tests/test_frontier_models.py.

Each architecture is transformers' own class on a tiny config (``autozoo.tiny_config`` with the sizes that tell the
architecture apart: Kimi-K2's single expert group and routed scaling on DeepSeek-V3's classes, Qwen3-Next's linear
and full attention layers, MiniMax-M2's ``block_sparse_moe``). ``write_fp8_release`` stores every Linear weight of
its decoder layers in FP8 blocks of 128 x 128 with ``weight_scale_inv`` (DeepSeek-V3, Kimi-K2, Qwen3, GLM-4.5 and
MiniMax-M2 publish them so), routers in bf16. ``add_mtp_layer`` appends DeepSeek-V3's multi-token-prediction layer
(``model.layers.<num_hidden_layers>.*``), which transformers' model class does not hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from autozoo import tiny_config
from sources_helpers import quantize_fp8_block, write_shards

# Linears the FP8 releases keep in bf16: the routers (a few rows, read in float32 by the gate)
ROUTERS = ("mlp.gate", "block_sparse_moe.gate", "mlp.shared_expert_gate")


def _kimi_k2() -> transformers.PretrainedConfig:
    """Kimi-K2: DeepSeek-V3's classes with one expert group, top-k over all experts, routed scaling 2.827."""
    config = tiny_config("deepseek_v3")
    config.update({"num_hidden_layers": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827, "first_k_dense_replace": 1,
                   "n_routed_experts": 8, "num_experts_per_tok": 4, "n_shared_experts": 1})  # fmt: skip
    return config


def _two_layers(model_type: str, **kwargs: object) -> transformers.PretrainedConfig:
    config = tiny_config(model_type)
    config.update({"num_hidden_layers": 2, **kwargs})
    return config


# architecture -> (class name, its tiny config)
ARCHITECTURES = {
    "deepseek_v3": ("DeepseekV3ForCausalLM", lambda: _two_layers("deepseek_v3", first_k_dense_replace=1)),
    "kimi_k2": ("DeepseekV3ForCausalLM", _kimi_k2),
    "qwen3_next": ("Qwen3NextForCausalLM",
                   lambda: _two_layers("qwen3_next", layer_types=["linear_attention", "full_attention"])),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM",
                    lambda: _two_layers("qwen3_5_moe_text", layer_types=["linear_attention", "full_attention"])),
    "glm4_moe": ("Glm4MoeForCausalLM", lambda: _two_layers("glm4_moe", first_k_dense_replace=1)),
    "minimax_m2": ("MiniMaxM2ForCausalLM", lambda: _two_layers("minimax_m2")),
}  # fmt: skip


def save_bf16(arch: str, path: Path) -> Path:
    """The tiny ``arch`` with seeded random weights, saved by transformers in bf16."""
    class_name, config = ARCHITECTURES[arch]
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config())
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def is_fp8_weight(key: str, tensor: torch.Tensor) -> bool:
    """A decoder layer's Linear weight other than a router: what the FP8 releases store in FP8."""
    module = key.removesuffix(".weight")
    kept = module.endswith(
        (*ROUTERS, "embed_tokens", "shared_head.head")
    )  # an MTP layer's own embeddings and head
    return tensor.dim() == 2 and ".layers." in key and key.endswith(".weight") and not kept


def write_fp8_release(src: Path, out: Path) -> Path:
    """``src`` stored as the FP8 releases are: 128 x 128 blocks, float32 ``weight_scale_inv``, method fp8."""
    out.mkdir(parents=True)
    stored: dict[str, torch.Tensor] = {}
    for key, tensor in load_file(str(src / "model.safetensors")).items():
        if is_fp8_weight(key, tensor):
            stored[key], scale = quantize_fp8_block(tensor, (128, 128), ue8m0=False)
            stored[key.removesuffix(".weight") + ".weight_scale_inv"] = scale
        else:
            stored[key] = tensor
    write_shards(out, stored, 2)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def mtp_tensors(src: Path, layers: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's multi-token-prediction layer as its release stores it: a decoder layer (here a copy of the last
    one) under ``model.layers.<layers>``, with ``enorm``, ``hnorm``, ``eh_proj`` and its ``shared_head``."""
    tensors = load_file(str(src / "model.safetensors"))
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    out = {mtp + k.removeprefix(last): t.clone() for k, t in tensors.items() if k.startswith(last)}
    hidden = tensors["model.norm.weight"].shape[0]
    g = torch.Generator().manual_seed(2)
    out[mtp + "enorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    out[mtp + "hnorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    out[mtp + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=g) * 0.02).to(torch.bfloat16)
    out[mtp + "shared_head.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    out[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    out[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    return out


def add_mtp_layer(src: Path) -> Path:
    """``src`` (a bf16 DeepSeek-V3) with its multi-token-prediction layer added to the safetensors file."""
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update(mtp_tensors(src, config["num_hidden_layers"]))
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    return src
