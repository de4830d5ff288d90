"""The recipe.yaml llm-compressor 0.14 writes beside every model it quantizes loads and runs unchanged.

``tests/data/llmc_0_14/`` holds recipe.yaml files written by llm-compressor 0.14.0.1 (``make_recipes.py`` there
says how): they hold Python tags for enums, tuples and devices, its Modifier base fields
(``requires_calibration_data``) and its new arguments (``bypass_divisibility_checks``, ``batched_quantization``,
``algorithm``). The tags are read as plain values; no other tag is, and nothing is ever executed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from save_helpers import checkpoint_tensors
from seqcal.entrypoint import oneshot
from seqcal.modifiers import (
    AWQModifier,
    GPTQModifier,
    LogarithmicEqualizationModifier,
    QuantizationModifier,
    QuIPModifier,
    SmoothQuantModifier,
    SpinQuantModifier,
)
from seqcal.recipe.parse import RecipeError, parse_recipe
from test_oneshot import tiny_llama, token_data

DATA = Path(__file__).parent / "data" / "llmc_0_14"
# file -> the seqcal modifiers it becomes (AWQ + QuantizationModifier bind into one AWQModifier)
EXPECTED = {
    "awq_w4a16_asym": [AWQModifier],
    "awq_w4a16_mappings": [AWQModifier],
    "config_groups_w4a16": [GPTQModifier],
    "gptq_kv_nvfp4_groups": [GPTQModifier],
    "gptq_w4a16_actorder_static": [GPTQModifier],
    "gptq_w4a16_actorder_weight": [GPTQModifier],
    "log_equalization": [LogarithmicEqualizationModifier, GPTQModifier],
    "rtn_fp8_dynamic": [QuantizationModifier],
    "smoothquant_gptq_w8a8": [SmoothQuantModifier, GPTQModifier],
    "quip_spinquant": [QuIPModifier, SpinQuantModifier, QuantizationModifier],
}
TAG = "!!python/object/apply:compressed_tensors.quantization.quant_args."


def test_every_file_is_here_and_holds_what_llmc_writes() -> None:
    assert {p.stem for p in DATA.glob("*.yaml")} == set(EXPECTED)
    texts = {p.stem: p.read_text() for p in DATA.glob("*.yaml")}
    assert f"actorder: {TAG}ActivationOrdering [" in texts["gptq_kv_nvfp4_groups"]
    assert "!!python/tuple" in texts["smoothquant_gptq_w8a8"]
    assert "offload_device: !!python/object/apply:torch.device [cpu]" in texts["awq_w4a16_mappings"]
    assert all("requires_calibration_data:" in t for t in texts.values())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_llmc_recipe_yaml_parses(name: str) -> None:
    recipe = parse_recipe(str(DATA / f"{name}.yaml"))
    assert [type(m) for m in recipe.modifiers] == EXPECTED[name]
    assert parse_recipe(recipe.to_yaml()).modifiers[0].to_dict() == recipe.modifiers[0].to_dict()


def test_tags_are_read_as_the_values_they_stand_for() -> None:
    gptq = parse_recipe(str(DATA / "gptq_kv_nvfp4_groups.yaml")).modifiers[0]
    assert gptq.actorder == "weight" and gptq.kv_cache_scheme["strategy"] == "tensor"
    sq = parse_recipe(str(DATA / "smoothquant_gptq_w8a8.yaml")).modifiers[0]
    assert sq.mappings == [[["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
                           [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"]]  # fmt: skip
    awq = parse_recipe(str(DATA / "awq_w4a16_mappings.yaml")).modifiers[0]
    assert awq.offload_device == "cpu" and awq.duo_scaling == "both"
    enum = parse_recipe(f"QuantizationModifier:\n  config_groups:\n    g:\n      targets: [Linear]\n      weights:\n"
                        f"        num_bits: 4\n        type: {TAG}QuantizationType [int]\n"
                        f"        strategy: {TAG}QuantizationStrategy [\n          group]\n"
                        f"        group_size: 32\n")  # fmt: skip
    assert enum.modifiers[0].groups["g"].weights.strategy == "group"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            '!!python/object/apply:os.system ["touch {marker}"]',
            "the tag '!!python/object/apply:os.system' would run",
        ),
        (
            '!!python/object/apply:subprocess.call [["touch", "{marker}"]]',
            "'!!python/object/apply:subprocess.call'",
        ),
        ("!!python/name:os.system", "could not determine a constructor for the tag"),
        ('!!python/object/new:os.system ["touch {marker}"]', "could not determine a constructor for the tag"),
        (
            f"{TAG}ActivationOrdering [evil]",
            "'evil' is not a value of ActivationOrdering; one of weight, static",
        ),
        (f"{TAG}ActivationOrdering [[weight]]", "ActivationOrdering holds nested values"),
        ("!!python/object/apply:torch.device [{marker}]", "is not a device"),
    ],
)
def test_other_tags_are_refused_and_nothing_runs(tmp_path: Path, value: str, message: str) -> None:
    marker = tmp_path / "executed"
    with pytest.raises(RecipeError, match=r"<string>:1: ") as err:
        parse_recipe(f"GPTQModifier: {{scheme: W4A16, actorder: {value.format(marker=marker)} }}")
    assert message in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["gptq_w4a16_actorder_weight", "rtn_fp8_dynamic"])
def test_llmc_recipe_yaml_runs_unchanged(name: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    oneshot(
        model=tiny_llama(), dataset=token_data(4, 16), recipe=str(DATA / f"{name}.yaml"), output_dir=str(out)
    )
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    assert block["ignore"] == [
        "lm_head"
    ] and "model.layers.1.mlp.down_proj.weight_scale" in checkpoint_tensors(out)
    assert [type(m) for m in parse_recipe(str(out)).modifiers] == EXPECTED[name]  # our recipe.yaml reads back


def test_llmc_base_arguments_are_accepted_for_every_modifier() -> None:
    base = "index: 0, group: g, start: -1, end: -1, update: 1.0, requires_calibration_data: true"
    for text in (f"GPTQModifier: {{scheme: W4A16, {base}}}", f"SmoothQuantModifier: {{{base}}}",
                 f"WandaPruningModifier: {{sparsity: 0.5, {base}}}"):  # fmt: skip
        (modifier,) = parse_recipe(text).modifiers
        assert not {"index", "start", "requires_calibration_data"} & set(modifier.argument_names())


def test_bypass_divisibility_checks_changes_nothing_where_groups_divide() -> None:
    runs = []
    for bypass in (False, True):
        model = tiny_llama()
        oneshot(model=model, dataset=token_data(2, 8),
                recipe=QuantizationModifier(scheme="W4A16", ignore=["lm_head"], bypass_divisibility_checks=bypass))  # fmt: skip
        runs.append(model.model.layers[1].mlp.down_proj.weight.detach().clone())
    assert torch.equal(*runs) and not torch.equal(runs[0], tiny_llama().model.layers[1].mlp.down_proj.weight)


def test_bypass_divisibility_checks_cannot_make_ragged_groups() -> None:
    recipe = "GPTQModifier: {scheme: W4A16, ignore: [lm_head], bypass_divisibility_checks: true}"
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=192, intermediate_size=256, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    with pytest.raises(ValueError, match=r"group_size 128 does not divide the inputs .*\(bypass_divisibility_checks "
                                         r"skips only llm-compressor's early check"):  # fmt: skip
        parse_recipe(recipe).validate(model)
    with pytest.raises(RecipeError, match="bypass_divisibility_checks must be true or false, got 'yes'"):
        parse_recipe("GPTQModifier: {scheme: W4A16, bypass_divisibility_checks: 'yes'}")


@pytest.mark.parametrize("value", ["auto", 4, None])
def test_batched_quantization_values_llmc_takes_are_accepted(value) -> None:
    assert GPTQModifier(scheme="W4A16", batched_quantization=value).batched_quantization == value


@pytest.mark.parametrize("value", [0, -2, "all", 2.0, True])
def test_batched_quantization_values_llmc_refuses_are_refused(value) -> None:
    with pytest.raises(ValueError, match="batched_quantization must be 'auto', a positive integer or null"):
        GPTQModifier(scheme="W4A16", batched_quantization=value)


def test_awq_mappings_as_llmc_writes_them() -> None:
    """AWQ's mappings carry activation_hook_target (null by default); another value is refused, not ignored."""
    for name in ("awq_w4a16_asym", "awq_w4a16_mappings"):
        parse_recipe(str(DATA / f"{name}.yaml")).validate(tiny_llama())
    mapping = {"smooth_layer": "re:.*input_layernorm$", "balance_layers": ["re:.*q_proj$"],
               "activation_hook_target": "re:.*self_attn$"}  # fmt: skip
    with pytest.raises(ValueError, match=r"mappings\[0\].activation_hook_target is not supported"):
        AWQModifier(scheme="W4A16", mappings=[mapping]).validate(tiny_llama())
