"""Tiny checkpoints written in the quantized formats models are published in, for tests/test_sources*.py.

Each writer starts from a full-precision checkpoint saved by transformers and stores its Linear weights the
way the real releases do: DeepSeek-V3's FP8 blocks (``weight`` e4m3 + float32 ``weight_scale_inv`` per 128 x 128
block, router and norms in bf16), gpt-oss's MXFP4 experts (``*_blocks`` + ``*_scales``). The weights are random;
the layout is what is under test.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

VOCAB = 256
FP8_MAX = 448.0


def token_data(n: int = 4, length: int = 24) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (torch.randint(-3, 4, (length,), generator=g).cumsum(0) % VOCAB).tolist()}
            for _ in range(n)]  # fmt: skip


def save_deepseek(path: Path, rope: int = 128) -> Path:
    """A tiny DeepSeek-V3 (MLA, one dense layer then routed + shared experts) saved in bf16.

    ``rope`` 128 keeps every FP8 block whole (kv_a_proj_with_mqa is kv_lora_rank + rope rows); 64 gives it
    192 rows, a partial block at the edge, as DeepSeek-V3's 576.
    """
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128,
        qk_rope_head_dim=rope, qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=128,
    )  # fmt: skip
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def fp8_targets(key: str, tensor: torch.Tensor) -> bool:
    """The tensors DeepSeek stores in FP8: every Linear weight but the router, the embeddings and lm_head."""
    layer = ".self_attn." in key or ".mlp." in key
    return tensor.dim() == 2 and layer and not key.endswith(".mlp.gate.weight")


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int], ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale per block) with DeepSeek's rule: scale = amax / 448 per block."""
    rows, cols = w.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.reshape(grid[0], block[0], grid[1], block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(padded.shape)[:rows, :cols].contiguous(), scale


def write_fp8_block(src: Path, out: Path, ue8m0: bool = False, scale_dtype: torch.dtype = torch.float32,
                    shards: int = 2) -> Path:  # fmt: skip
    """``src`` stored as DeepSeek ships it: FP8 blocks of 128 x 128 and ``quantization_config`` of method fp8."""
    out.mkdir(parents=True)
    tensors = load_file(str(src / "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if fp8_targets(key, tensor):
            q, scale = quantize_fp8_block(tensor, (128, 128), ue8m0)
            stored[key] = q
            stored[key.removesuffix(".weight") + ".weight_scale_inv"] = scale.to(scale_dtype)
        else:
            stored[key] = tensor
    write_shards(out, stored, shards)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}  # fmt: skip
    if ue8m0:
        config["quantization_config"]["scale_fmt"] = "ue8m0"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_shards(out: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """``tensors`` in ``shards`` safetensors files with an index (one file without one for ``shards`` 1)."""
    keys = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::shards]}
        save_file(part, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def copy_config(src: Path, out: Path) -> None:
    shutil.copy(src / "config.json", out / "config.json")


FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def save_gpt_oss(path: Path) -> Path:
    """A tiny gpt-oss (sliding and full attention, 4 experts of 64 -> 2 x 64 with biases) saved in bf16."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, sliding_window=8, max_position_embeddings=128)  # fmt: skip
    GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[experts, rows, cols]`` -> (blocks ``[experts, rows, cols / 32, 16]`` uint8, scales ``[..., cols / 32]``
    uint8): per group of 32 an e8m0 exponent putting its largest value in [4, 8), values rounded to e2m1."""
    groups = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    exp = torch.floor(torch.log2(amax)) - 2
    x = groups / torch.exp2(exp)[..., None]
    index = (x.abs()[..., None] - FP4_GRID).abs().argmin(-1)  # nearest e2m1 magnitude
    nibbles = (index + 8 * (x < 0)).to(torch.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)  # the first value in the low nibble
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def write_mxfp4(src: Path, out: Path) -> Path:
    """``src`` (a gpt-oss) stored as OpenAI ships it: experts in MXFP4, everything else in bf16."""
    out.mkdir(parents=True)
    stored = {}
    for key, tensor in load_file(str(src / "model.safetensors")).items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # stored [experts, out, in]
            stored[key + "_blocks"], stored[key + "_scales"] = blocks, scales
        else:
            stored[key] = tensor
    write_shards(out, stored, 1)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_dequantized_copy(quantized: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The full-precision checkpoint ``quantized`` stands for: every tensor as seqcal reads it, no
    quantization_config (the reference a run from the quantized source must equal byte for byte)."""
    from seqcal.sources import QuantizedCheckpoint

    ckpt = QuantizedCheckpoint.open(quantized)
    out.mkdir(parents=True)
    save_file({n: ckpt.read(n, dtype).contiguous() for n in ckpt.names()}, str(out / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def save_llama(path: Path) -> Path:
    """A tiny Llama in bf16 (128 wide: whole groups of 128 for W4A16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def checkpoint_bytes(path: Path) -> dict[str, bytes]:
    """Every tensor of a checkpoint directory's safetensors files, by name, as bytes."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        for key, tensor in load_file(str(file)).items():
            out[key] = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return out


def write_fp8_per_tensor(src: Path, out: Path) -> Path:
    """``src`` with each Linear weight in FP8 and one float32 ``weight_scale_inv`` per tensor (no block size)."""
    out.mkdir(parents=True)
    stored = {}
    for key, tensor in load_file(str(src / "model.safetensors")).items():
        if fp8_targets(key, tensor):
            scale = tensor.float().abs().amax().reshape(1) / FP8_MAX
            stored[key] = (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            stored[key.removesuffix(".weight") + ".weight_scale_inv"] = scale
        else:
            stored[key] = tensor
    write_shards(out, stored, 1)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": None}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
