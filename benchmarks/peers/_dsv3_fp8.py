"""A synthetic DeepSeek-V3-shaped FP8-block checkpoint, written tensor by tensor (never the model in RAM).

The layout is DeepSeek's release: every Linear of the layers (attention, dense MLP, routed and shared experts) is
a float8_e4m3fn ``weight`` with a float32 ``weight_scale_inv`` per 128 x 128 block (scale = block amax / 448, as
DeepSeek's quantizer), the router (``mlp.gate``) bf16 with its float32 ``e_score_correction_bias``, norms,
embeddings and lm_head bf16; experts under their own names (``mlp.experts.{j}.gate_proj.weight``); numbered
safetensors files with ``model.safetensors.index.json``; ``quantization_config: {quant_method: fp8,
weight_block_size: [128, 128], fmt: e4m3, activation_scheme: dynamic}``. Weights are N(0, 0.02) before the FP8
rounding. Each file is written by hand (the 8-byte header size, the JSON header, then the tensors in header
order) so that only one tensor, or one slice of rows of a large one, is in memory at a time: safetensors'
``save_file`` needs the whole file's tensors at once.

The widths are DeepSeek-V3's (hidden 7168, q_lora_rank 1536, kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128,
moe_intermediate 2048, dense intermediate 18432); fewer heads, layers and experts (``Shape``) and SmolLM2's
tokenizer (vocabulary 49152) keep it to a few GB. The multi-token-prediction layer is not written.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

BLOCK = 128
FP8_MAX = 448.0
ROWS_AT_ONCE = 4096  # rows generated at once for bf16 tensors (the 49152 x 7168 embedding: 60 MB a slice)
DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}


@dataclass(frozen=True)
class Shape:
    """The model's size: DeepSeek-V3's widths, fewer of everything else."""

    layers: int = 4
    dense_layers: int = 1  # first_k_dense_replace (DeepSeek-V3: 3)
    experts: int = 8  # routed experts per MoE layer (DeepSeek-V3: 256)
    experts_per_token: int = 4  # (DeepSeek-V3: 8)
    heads: int = 32  # (DeepSeek-V3: 128)
    vocab: int = 49152  # SmolLM2's tokenizer (DeepSeek-V3: 129280)
    shard_bytes: int = 1 << 30

    def config(self) -> dict:
        """config.json as DeepSeek ships it (transformers' DeepseekV3Config fields) with the FP8 block config."""
        from transformers import DeepseekV3Config

        config = DeepseekV3Config(
            vocab_size=self.vocab, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            num_hidden_layers=self.layers, first_k_dense_replace=self.dense_layers, n_routed_experts=self.experts,
            num_experts_per_tok=self.experts_per_token, n_shared_experts=1, n_group=1, topk_group=1,
            num_attention_heads=self.heads, num_key_value_heads=self.heads, q_lora_rank=1536, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=4096,
            tie_word_embeddings=False, torch_dtype="bfloat16", architectures=["DeepseekV3ForCausalLM"],
        ).to_dict()  # fmt: skip
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip
        return config


def tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every stored tensor, in the model's order (an FP8 weight then its scale)."""
    h, heads = 7168, shape.heads

    def fp8(name: str, rows: int, cols: int) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
        yield f"{name}.weight", (rows, cols), torch.float8_e4m3fn
        yield f"{name}.weight_scale_inv", (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)), torch.float32

    def mlp(prefix: str, inter: int) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
        yield from fp8(f"{prefix}.gate_proj", inter, h)
        yield from fp8(f"{prefix}.up_proj", inter, h)
        yield from fp8(f"{prefix}.down_proj", h, inter)

    yield "model.embed_tokens.weight", (shape.vocab, h), torch.bfloat16
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), torch.bfloat16
        yield from fp8(f"{p}.self_attn.q_a_proj", 1536, h)
        yield f"{p}.self_attn.q_a_layernorm.weight", (1536,), torch.bfloat16
        yield from fp8(f"{p}.self_attn.q_b_proj", heads * (128 + 64), 1536)
        yield from fp8(f"{p}.self_attn.kv_a_proj_with_mqa", 512 + 64, h)
        yield f"{p}.self_attn.kv_a_layernorm.weight", (512,), torch.bfloat16
        yield from fp8(f"{p}.self_attn.kv_b_proj", heads * (128 + 128), 512)
        yield from fp8(f"{p}.self_attn.o_proj", h, heads * 128)
        yield f"{p}.post_attention_layernorm.weight", (h,), torch.bfloat16
        if i < shape.dense_layers:
            yield from mlp(f"{p}.mlp", 18432)
            continue
        yield f"{p}.mlp.gate.weight", (shape.experts, h), torch.bfloat16
        yield f"{p}.mlp.gate.e_score_correction_bias", (shape.experts,), torch.float32
        for j in range(shape.experts):
            yield from mlp(f"{p}.mlp.experts.{j}", 2048)
        yield from mlp(f"{p}.mlp.shared_experts", 2048)
    yield "model.norm.weight", (h,), torch.bfloat16
    yield "lm_head.weight", (shape.vocab, h), torch.bfloat16


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _fp8_block(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale per 128 x 128 block) of float32 ``rows`` [r, cols], r a multiple of 128 or the
    last rows: DeepSeek's rule, scale = amax / 448 per block (a partial block at the edge has its own)."""
    r, cols = rows.shape
    grid = (math.ceil(r / BLOCK), math.ceil(cols / BLOCK))
    padded = torch.zeros(grid[0] * BLOCK, grid[1] * BLOCK)
    padded[:r, :cols] = rows
    blocks = padded.view(grid[0], BLOCK, grid[1], BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(padded.shape)[:r, :cols].contiguous(), scale


def _values(name: str, shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> Iterator[bytes]:
    """The bytes of one tensor in slices of rows (an FP8 weight's scale comes with it: see ``_write_file``)."""
    if name.endswith(("norm.weight",)):
        yield torch.ones(shape, dtype=dtype).view(torch.uint8).numpy().tobytes()
    elif name.endswith("e_score_correction_bias"):
        yield torch.zeros(shape, dtype=dtype).view(torch.uint8).numpy().tobytes()
    else:
        for r0 in range(0, shape[0], ROWS_AT_ONCE):
            rows = torch.randn(min(ROWS_AT_ONCE, shape[0] - r0), *shape[1:], generator=g) * 0.02
            yield rows.to(dtype).view(torch.uint8).numpy().tobytes()


def _write_file(
    path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]], g: torch.Generator
) -> None:
    """One safetensors file, tensor by tensor: header (names, dtypes, shapes, offsets) first, then the data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in entries:
        size = nbytes(shape, dtype)
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    scales: dict[str, torch.Tensor] = {}
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, shape, dtype in entries:
            # an FP8 weight: rows of whole blocks, each with its scales (kept for the next entry, its scale)
            if dtype == torch.float8_e4m3fn:
                parts = []
                for r0 in range(0, shape[0], ROWS_AT_ONCE):
                    rows = torch.randn(min(ROWS_AT_ONCE, shape[0] - r0), shape[1], generator=g) * 0.02
                    q, s = _fp8_block(rows)
                    f.write(q.view(torch.uint8).numpy().tobytes())
                    parts.append(s)
                scales[name.removesuffix(".weight") + ".weight_scale_inv"] = torch.cat(parts)
            elif name in scales:
                f.write(scales.pop(name).numpy().tobytes())
            else:
                for chunk in _values(name, shape, dtype, g):
                    f.write(chunk)


def write(path: Path, shape: Shape, tokenizer_from: Path | None = None) -> int:
    """Write the checkpoint to ``path`` (config, files, index, tokenizer); returns its safetensors bytes."""
    entries = list(tensors(shape))
    files: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    for entry in entries:  # a weight and its scale stay in one file, as DeepSeek's files keep them
        if size >= shape.shard_bytes and not entry[0].endswith("weight_scale_inv"):
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes(entry[1], entry[2])
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, part in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        _write_file(path / name, part, g)
        weight_map.update({e[0]: name for e in part})
        total += sum(nbytes(e[1], e[2]) for e in part)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(shape.config(), indent=2))
    if tokenizer_from is not None:
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_from / file).is_file():
                shutil.copy(tokenizer_from / file, path / file)
    return total
