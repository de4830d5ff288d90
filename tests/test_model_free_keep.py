"""Model-free with ``keep_source_format``: an FP8 source's Linears the scheme leaves alone are written in their
stored FP8 form, byte for byte what ``oneshot(..., pipeline="datafree", keep_source_format=True)`` writes (the
weights and config.json), for DeepSeek's 128 x 128 blocks and for one scale per tensor; a source that has no FP8
form to keep is refused in one sentence before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from seqcal import model_free_ptq, oneshot
from seqcal.cli import main as cli_main
from sources_helpers import save_deepseek, save_llama, write_fp8_block, write_fp8_per_tensor

MLP = "re:.*mlp\\.(experts\\.\\d+\\.|shared_experts\\.)?(gate|up|down)_proj$"


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("deepseek")
    return write_fp8_block(save_deepseek(root / "bf16"), root / "fp8-block", shards=1)  # oneshot writes one file


def _same_as_oneshot(source: Path, tmp_path: Path, scheme: str, targets: str) -> Path:
    ref = tmp_path / "oneshot"
    recipe = f"QuantizationModifier: {{scheme: {scheme}, targets: ['{targets}'], ignore: [lm_head]}}"
    oneshot(model=str(source), recipe=recipe, pipeline="datafree", output_dir=str(ref), keep_source_format=True)
    out = model_free_ptq(source, tmp_path / "mf", scheme=scheme, targets=[targets], ignore=["lm_head"],
                         keep_source_format=True)  # fmt: skip
    names = sorted(p.name for p in ref.glob("*.safetensors")) + ["config.json"]
    assert names == sorted(p.name for p in out.glob("*.safetensors")) + ["config.json"]
    for name in names:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    return out


@pytest.mark.parametrize("scheme", ["NVFP4A16", "W4A16"])
def test_deepseek_attention_keeps_its_fp8_blocks(deepseek: Path, tmp_path: Path, scheme: str) -> None:
    out = _same_as_oneshot(deepseek, tmp_path, scheme, MLP)
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    assert block["format"] == "mixed-precision"
    assert any(g["weights"]["strategy"] == "block" for g in block["config_groups"].values())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.o_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.self_attn.o_proj.weight_scale").dtype == torch.float32


def test_per_tensor_fp8_llama_keeps_its_form(tmp_path: Path) -> None:
    source = write_fp8_per_tensor(save_llama(tmp_path / "bf16"), tmp_path / "fp8")
    _same_as_oneshot(source, tmp_path, "W4A16", "re:.*mlp\\.(gate|up|down)_proj$")


def test_nothing_to_keep_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    source = save_llama(tmp_path / "bf16")
    with pytest.raises(ValueError, match="^model-free: keep_source_format: .* full-precision weights"):
        model_free_ptq(source, tmp_path / "out", scheme="W4A16", keep_source_format=True)
    assert not (tmp_path / "out").exists()
    code = cli_main(["model-free", "--model", str(source), "--output-dir", str(tmp_path / "out"), "--scheme",
                     "W4A16", "--keep-source-format"])  # fmt: skip
    assert code != 0 and not (tmp_path / "out").exists()
