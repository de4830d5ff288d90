"""A quantized source seqcal cannot use is refused in one sentence before any calibration, nothing written.

A scale tensor missing or of the wrong shape, an unknown ``quant_method``, a 4-bit source quantized to 4 bits
without ``requantize=True``, an index naming a shard that is not there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from seqcal.entrypoint import oneshot
from seqcal.modifiers import GPTQModifier, QuantizationModifier
from seqcal.sources import SourceFormatError
from sources_helpers import save_deepseek, save_llama, token_data, write_fp8_block

SCALE = "model.layers.0.self_attn.o_proj.weight_scale_inv"


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    return write_fp8_block(save_deepseek(root / "bf16"), root / "fp8")


def edited(fp8: Path, tmp_path: Path, edit: callable) -> Path:
    """A copy of ``fp8`` whose shard holding ``SCALE`` went through ``edit`` (a dict of tensors -> None)."""
    out = tmp_path / "edited"
    shutil.copytree(fp8, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = out / index["weight_map"][SCALE]
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard))
    if SCALE not in tensors:  # the index lists what the shards hold
        del index["weight_map"][SCALE]
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def refused(model: Path, tmp_path: Path, recipe: object = None, **kw: object) -> str:
    """The one-sentence error of a run from ``model``; checks nothing was written."""
    recipe = recipe or GPTQModifier(scheme="W4A16", targets=["Linear"], ignore=["lm_head", "re:.*mlp.gate$"])
    with pytest.raises(SourceFormatError) as err:
        oneshot(
            model=str(model), dataset=token_data(2, 16), recipe=recipe, output_dir=str(tmp_path / "out"), **kw
        )
    assert not (tmp_path / "out").exists()
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_missing_scale_is_named(fp8: Path, tmp_path: Path) -> None:
    message = refused(edited(fp8, tmp_path, lambda t: t.pop(SCALE)), tmp_path)
    assert message.startswith("model.layers.0.self_attn.o_proj.weight is stored in FP8 but its scale")
    assert SCALE in message and "download it again" in message


def test_a_scale_of_the_wrong_shape_is_named(fp8: Path, tmp_path: Path) -> None:
    def wrong(tensors: dict[str, torch.Tensor]) -> None:
        tensors[SCALE] = torch.ones(1, 2)

    message = refused(edited(fp8, tmp_path, wrong), tmp_path)
    assert message.startswith(
        f"{SCALE} has shape [1, 2], expected [2, 1] (one per 128 x 128 block of [256, 128])"
    )


def test_an_unknown_quant_method_is_refused(fp8: Path, tmp_path: Path) -> None:
    model = tmp_path / "hqq"
    shutil.copytree(fp8, model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    (model / "config.json").write_text(json.dumps(config))
    message = refused(model, tmp_path)
    assert "quantization_config has quant_method 'hqq', which seqcal cannot dequantize" in message


def test_a_four_bit_source_is_requantized_to_four_bits_only_when_asked(tmp_path: Path) -> None:
    nvfp4 = tmp_path / "nvfp4"
    oneshot(model=str(save_llama(tmp_path / "bf16")), dataset=token_data(2, 16), max_seq_length=16,
            recipe=QuantizationModifier(scheme="NVFP4", targets=["Linear"], ignore=["lm_head"]), output_dir=str(nvfp4))  # fmt: skip
    message = refused(nvfp4, tmp_path, GPTQModifier(scheme="W4A16", targets=["Linear"], ignore=["lm_head"]))
    assert (
        "stored as nvfp4 (4-bit float), at or below the precision of the recipe's GPTQModifier group_0 (4-bit"
        in message
    )
    assert "compounds the two rounding errors: pass requantize=True (--requantize)" in message
    fp8_to_w4 = QuantizationModifier(
        scheme="W4A16", targets=["Linear"], ignore=["lm_head"]
    )  # 8 -> 4 bits runs
    oneshot(
        model=str(nvfp4),
        recipe=fp8_to_w4,
        pipeline="datafree",
        output_dir=str(tmp_path / "w4"),
        requantize=True,
    )
    assert json.loads((tmp_path / "w4" / "config.json").read_text())["quantization_config"]["source_format"] == {
        "quant_method": "compressed-tensors", "format": "nvfp4", "weight_bits": 4, "weight_type": "float",
        "requantized": True}  # fmt: skip


def test_an_index_naming_a_missing_shard_is_refused(fp8: Path, tmp_path: Path) -> None:
    model = tmp_path / "partial"
    shutil.copytree(fp8, model)
    (model / "model-00002-of-00002.safetensors").unlink()
    message = refused(model, tmp_path)
    assert "the index names shard 'model-00002-of-00002.safetensors', which is not in" in message


def test_the_command_line_requantizes_only_with_the_flag(
    fp8: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from seqcal.cli import main

    recipe = tmp_path / "w8.yaml"
    recipe.write_text("quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      ignore: [lm_head, 're:.*mlp.gate$']\n"
                      "      config_groups:\n        g:\n          targets: [Linear]\n"
                      "          weights: {num_bits: 8, type: int, symmetric: true, strategy: channel}\n")  # fmt: skip
    args = ["oneshot", "--model", str(fp8), "--recipe", str(recipe), "--pipeline", "datafree"]
    assert main([*args, "--output-dir", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert "stored as fp8-block (8-bit float), at or below" in err and "--requantize" in err
    assert not (tmp_path / "refused").exists()
    assert main([*args, "--output-dir", str(tmp_path / "out"), "--requantize", "--plot", "none"]) == 0
    block = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert block["source_format"]["format"] == "fp8-block" and block["source_format"]["requantized"]
