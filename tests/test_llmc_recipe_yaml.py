"""The recipe.yaml llm-compressor 0.14 writes beside every model it quantizes loads and runs unchanged.

``tests/data/llmc_0_14/`` holds recipe.yaml files written by llm-compressor 0.14.0.1 (``make_recipes.py`` there
says how): they hold Python tags for enums, tuples and devices, its Modifier base fields
(``requires_calibration_data``) and its new arguments (``bypass_divisibility_checks``, ``batched_quantization``,
``algorithm``). The tags are read as plain values; no other tag is, and nothing is ever executed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from save_helpers import checkpoint_tensors
from seqcal.entrypoint import oneshot
from seqcal.evaluation.loading import load_causal_lm
from seqcal.modifiers import (
    AWQModifier,
    GPTQModifier,
    LogarithmicEqualizationModifier,
    QuantizationModifier,
    QuIPModifier,
    SmoothQuantModifier,
    SpinQuantModifier,
)
from seqcal.modifiers.activations import quantizes_activations
from seqcal.recipe.llmc_format import _load
from seqcal.recipe.parse import RecipeError, parse_recipe
from test_oneshot import probe, tiny_llama, token_data

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
    "gptq_w4a16_g64_asym": [GPTQModifier],
    "rtn_w8a8_int8": [QuantizationModifier],
    "quip_gptq_w4a16": [QuIPModifier, GPTQModifier],
    "quip_uv_b64_gptq_w4a16": [QuIPModifier, GPTQModifier],
    "spinquant_gptq_w4a16": [SpinQuantModifier, GPTQModifier],
    "spinquant_r1r2_rtn_w4a16": [SpinQuantModifier, QuantizationModifier],
}
# written by llm-compressor's oneshot (make_recipes.py's RUN): each replays in seqcal and its output reloads
SAVED = ["awq_w4a16_asym", "awq_w4a16_mappings", "config_groups_w4a16", "gptq_w4a16_actorder_static",
         "gptq_w4a16_actorder_weight", "gptq_w4a16_g64_asym", "quip_gptq_w4a16", "quip_uv_b64_gptq_w4a16",
         "rtn_fp8_dynamic", "rtn_w8a8_int8", "smoothquant_gptq_w8a8", "spinquant_gptq_w4a16",
         "spinquant_r1r2_rtn_w4a16"]  # fmt: skip
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


def test_every_recipe_llmc_ran_is_kept() -> None:
    text = (DATA / "make_recipes.py").read_text()
    run = text[text.index("RUN = {") : text.index("WRITE = {")]
    assert sorted(SAVED) == sorted(name for name in EXPECTED if f'"{name}":' in run)
    assert all(
        "transform_config:" in (DATA / f"{n}.yaml").read_text() for n in SAVED if "quip" in n or "spin" in n
    )


@pytest.mark.parametrize("name", SAVED)
def test_every_saved_recipe_replays_and_its_output_reloads(name: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    model = oneshot(model=tiny_llama(), dataset=token_data(2, 8), recipe=str(DATA / f"{name}.yaml"),
                    output_dir=str(out), max_seq_length=8)  # fmt: skip
    recipe = parse_recipe(str(out))  # seqcal's recipe.yaml reads back to the same modifiers
    assert [type(m) for m in recipe.modifiers] == EXPECTED[name]
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    given = _load((DATA / f"{name}.yaml").read_text(), name)[0]["default_stage"]["default_modifiers"]
    rotated = [m["transform_config"]["config_groups"] for m in given.values() if "transform_config" in m]
    assert set(block.get("transform_config", {}).get("config_groups", {})) == {g for c in rotated for g in c}
    loaded = load_causal_lm(out, torch.float32)
    with torch.no_grad():
        got, want = loaded(**probe()).logits, model(**probe()).logits
    assert torch.isfinite(got).all()
    if not quantizes_activations(recipe.modifiers):  # the returned model does not quantize its inputs
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def _quip(**changes: object) -> dict:
    """QuIP's arguments with the transform_config llm-compressor saves for them, changed by ``changes``."""
    given = _load((DATA / "quip_gptq_w4a16.yaml").read_text(), "q")[0]["default_stage"]["default_modifiers"]
    args = given["QuIPModifier"]
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = args["transform_config"]["config_groups"]
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        node[last] = value
    return {k: v for k, v in args.items() if k != "requires_calibration_data"}


def test_a_transform_config_equal_to_the_arguments_is_accepted() -> None:
    plain, given = QuIPModifier(rotations=["v"], transform_type="random-hadamard"), QuIPModifier(**_quip())
    assert plain.transform_groups(None) == given.transform_groups(None)


def test_a_transform_config_seqcal_can_honour_overrides_the_arguments(
    caplog: pytest.LogCaptureFixture,
) -> None:
    quip = QuIPModifier(**_quip(**{"v.head_dim": 64, "v.type": "hadamard"}))
    assert quip.transform_block_size == 64 and quip.transform_type == "hadamard"
    assert "transform_config gives transform_block_size=64 where the arguments give None" in caplog.text


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"v.apply.0.location": "output"}, "config_groups.v.apply[0].location"),
        ({"v.apply.1.targets": ["re:.*q_proj$"]}, "config_groups.v.apply[1].targets"),
        ({"v.randomize": True}, "config_groups.v.randomize is true"),
    ],  # fmt: skip
)
def test_a_transform_config_seqcal_cannot_honour_is_refused_naming_the_field(
    changes: dict, field: str
) -> None:
    with pytest.raises(ValueError, match=rf"QuIPModifier: transform_config\.{re.escape(field)}"):
        QuIPModifier(**_quip(**changes))


def test_spinquant_transform_config_is_checked_against_the_model_before_any_weight_is_read(
    tmp_path: Path,
) -> None:
    path = tmp_path / "recipe.yaml"
    text = (DATA / "spinquant_gptq_w4a16.yaml").read_text()
    path.write_text(text.replace("head_dim: 32", "head_dim: 16"))
    with pytest.raises(ValueError, match=r"transform_config\.config_groups\.R2\.head_dim is 16 where seqcal's "
                                         r"SpinQuantModifier builds 32"):  # fmt: skip
        parse_recipe(str(path)).validate(tiny_llama())
    moved = text.replace(
        "'re:.*o_proj$'", "'re:.*dense$'"
    )  # R1's and R2's targets: a model whose o_proj is dense
    path.write_text(moved)
    spin = parse_recipe(str(path)).modifiers[0]  # the mappings are read back from the targets
    assert spin.mappings == {"attn_o": "re:.*dense$"}
    with pytest.raises(ValueError, match=r"mapping attn_o='re:\.\*dense\$' matches no module"):
        spin.validate(tiny_llama())
