"""llm-compressor's example recipes (FP8, KV cache, W8A8, NVFP4), retyped into recipes/llmc_*.yaml, run
unchanged on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from save_helpers import checkpoint_tensors
from seqcal.entrypoint import oneshot
from seqcal.recipe.parse import parse_recipe
from test_save_recipes import WORDS, _text, _tiny_llama
from tokenizer_helpers import word_level

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("llmc_*.yaml"))


def test_every_kind_of_example_is_there() -> None:
    assert {"llmc_fp8_dynamic.yaml", "llmc_fp8_kv_cache.yaml", "llmc_fp8_dynamic_kv_head.yaml",
            "llmc_w8a8_int8.yaml", "llmc_nvfp4.yaml"} <= {p.name for p in RECIPES}  # fmt: skip


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_example_recipe_runs_unchanged(path: Path, tmp_path: Path) -> None:
    tokenizer = word_level(WORDS, eos_token="[UNK]")
    out = tmp_path / "out"
    data = [_text(48, seed) for seed in range(4)]
    oneshot(model=_tiny_llama(len(tokenizer)), tokenizer=tokenizer, dataset=data, recipe=str(path),
            output_dir=str(out), max_seq_length=48, num_calibration_samples=4)  # fmt: skip
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    tensors = checkpoint_tensors(out)
    assert block["ignore"] == ["lm_head"] and "lm_head.weight_scale" not in tensors
    assert "model.layers.1.mlp.down_proj.weight_scale" in tensors
    # NVFP4 (W4A4): fp4 activations under a calibrated global scale, one per module
    nvfp4 = block["format"] == "nvfp4-pack-quantized"
    assert ("model.layers.1.mlp.down_proj.input_global_scale" in tensors) is nvfp4
    kv = parse_recipe(str(path)).modifiers[-1].kv_cache_scheme
    if kv is None:
        assert block.get("kv_cache_scheme") is None and "model.layers.0.self_attn.k_scale" not in tensors
        return
    assert block["kv_cache_scheme"]["strategy"] == kv["strategy"]
    shape = (4, 1, 1) if kv["strategy"] == "attn_head" else (1,)
    for i in range(2):
        for kind in ("k", "v"):
            scale = tensors[f"model.layers.{i}.self_attn.{kind}_scale"]
            assert tuple(scale.shape) == shape and bool((scale > 0).all()) and scale.dtype == torch.float32
