"""llm-compressor's example recipes (FP8, KV cache, W8A8, NVFP4), retyped into recipes/llmc_*.yaml, run
unchanged on a tiny model; those needing what seqcal lacks are refused with its name (strict xfail)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recipe_helpers import NEEDS_MISSING
from save_helpers import checkpoint_tensors
from seqcal.entrypoint import oneshot
from seqcal.recipe.parse import RecipeError, parse_recipe
from test_save_recipes import WORDS, _text, _tiny_llama
from tokenizer_helpers import word_level

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("llmc_*.yaml"))


def _case(path: Path):
    if path.name in NEEDS_MISSING:
        reason = f"needs {NEEDS_MISSING[path.name]}, which seqcal does not implement yet"
        return pytest.param(path, marks=pytest.mark.xfail(strict=True, raises=RecipeError, reason=reason))
    return path


def test_every_kind_of_example_is_there() -> None:
    assert {"llmc_fp8_dynamic.yaml", "llmc_fp8_kv_cache.yaml", "llmc_fp8_dynamic_kv_head.yaml",
            "llmc_w8a8_int8.yaml", "llmc_nvfp4.yaml"} <= {p.name for p in RECIPES}  # fmt: skip


@pytest.mark.parametrize("path", [p for p in RECIPES if p.name in NEEDS_MISSING], ids=lambda p: p.stem)
def test_missing_pieces_are_named(path: Path) -> None:
    with pytest.raises(RecipeError) as err:
        parse_recipe(str(path))
    assert NEEDS_MISSING[path.name] in str(err.value) and f"{path.name}:" in str(err.value)


@pytest.mark.parametrize("path", [_case(p) for p in RECIPES], ids=lambda p: p.stem)
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
