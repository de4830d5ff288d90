"""Recipes: seqcal's recipes/, the accepted layouts and input kinds, round trips, and safe loading.

llm-compressor's recipe files are in test_recipe_formats.py; bad recipes and their errors in
test_recipe_errors.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from recipe_helpers import assert_same, group_weights, round_trip
from seqcal.modifiers import GPTQModifier, QuantizationModifier
from seqcal.modifiers.pruning import PruningModifier
from seqcal.modifiers.rotations import RotationModifier
from seqcal.recipe.parse import Recipe, RecipeError, parse_recipe

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
EXPECTED_RECIPES = {
    "gptq_w4a16.yaml",
    "gptq_w4a16_g64.yaml",
    "gptq_w8a16.yaml",
    "rtn_w4a16.yaml",
    "rtn_w8a8.yaml",
    "rtn_fp8_dynamic.yaml",
    "gptq_w4a16_asym_actorder.yaml",
    "rtn_fp8_static.yaml",
    "gptq_w8a8_static.yaml",
    "gptq_w8a8_static_asym.yaml",
    "rtn_w8a8_static_tensor.yaml",
}


# --- seqcal's recipes/ ------------------------------------------------------------------------------------


def test_recipes_dir_holds_the_expected_files() -> None:
    assert EXPECTED_RECIPES <= {p.name for p in RECIPES_DIR.glob("*.yaml")}


@pytest.mark.parametrize(
    "path",
    sorted(RECIPES_DIR.glob("*.y*ml")),
    ids=lambda p: p.name,
)
def test_every_recipe_file_parses_and_round_trips(path: Path) -> None:
    first_line = path.read_text().splitlines()[0]
    assert first_line.startswith("# ") and len(first_line) > 20, "each recipe starts with a one-line comment"
    recipe = parse_recipe(path)
    assert recipe.source == str(path)
    pruners = [m for m in recipe.modifiers if isinstance(m, PruningModifier)]
    rotations = [
        m for m in recipe.modifiers if isinstance(m, RotationModifier)
    ]  # rotate lm_head's inputs too
    quantizers = [
        m for m in recipe.modifiers if not m.transforms and m not in pruners and m not in rotations
    ]  # smoothing: no lm_head
    # llm-compressor's examples (llmc_*) keep their own ignore lists after lm_head (NVFP4's: MoE routers too)
    ignores = [m.ignore if not path.name.startswith("llmc_") else m.ignore[:1] for m in quantizers]
    assert recipe.modifiers and all(ignore == ["lm_head"] for ignore in ignores)
    for m in pruners:  # llm-compressor's pruning recipes keep lm_head dense by a pattern or by their targets
        assert m.ignore == ["re:.*lm_head"] or all(t.startswith("re:model.layers") for t in m.targets)
    round_trip(recipe)


def test_recipes_mean_what_their_names_say() -> None:
    def only(name: str) -> QuantizationModifier:
        (modifier,) = parse_recipe(RECIPES_DIR / name).modifiers
        return modifier

    w = group_weights(gptq := only("gptq_w4a16.yaml"))
    assert type(gptq) is GPTQModifier and (w.num_bits, w.strategy, w.group_size, w.symmetric) == (
        4,
        "group",
        128,
        True,
    )
    w = group_weights(only("gptq_w4a16_g64.yaml"))
    assert (w.num_bits, w.strategy, w.group_size, w.type) == (4, "group", 64, "int")
    w = group_weights(only("gptq_w8a16.yaml"))
    assert (w.num_bits, w.strategy, w.symmetric) == (8, "channel", True)
    w = group_weights(rtn := only("rtn_w4a16.yaml"))
    assert type(rtn) is QuantizationModifier and (w.num_bits, w.group_size) == (4, 128)
    scheme = only("rtn_w8a8.yaml").groups["group_0"]
    assert (scheme.weights.num_bits, scheme.weights.type, scheme.weights.strategy) == (8, "int", "channel")
    acts = scheme.input_activations
    assert (acts.num_bits, acts.type, acts.strategy, acts.dynamic) == (8, "int", "token", True)
    scheme = only("rtn_fp8_dynamic.yaml").groups["group_0"]
    assert (scheme.weights.type, scheme.weights.strategy) == ("float", "channel")
    assert (scheme.input_activations.type, scheme.input_activations.dynamic) == ("float", True)
    asym = only("gptq_w4a16_asym_actorder.yaml")
    assert type(asym) is GPTQModifier and asym.actorder == "weight" and group_weights(asym).symmetric is False


# --- layouts and input kinds ----------------------------------------------------------------------------


def test_stages_groups_and_top_level_forms_run_in_file_order() -> None:
    recipe = parse_recipe(
        textwrap.dedent("""\
        version: 1.1.0
        metadata: {author: someone}
        first_stage:
          b_modifiers:
            QuantizationModifier: {scheme: W8A8, targets: "re:.*mlp.*"}
          a_modifiers:
            GPTQModifier: {scheme: W4A16}
        second_stage:
          run_type: oneshot
          args: {unused: 1}
          modifiers:
            GPTQModifier: {scheme: W8A16, group: quant}
          QuantizationModifier: {scheme: W4A16_ASYM}
        top_modifiers:
          - QuantizationModifier: {scheme: FP8_DYNAMIC}
            group: top
        GPTQModifier: {scheme: W4A16_ASYM, percdamp: 0.05}
        """)
    )
    got = [(type(m).__name__, m.scheme) for m in recipe.modifiers]
    assert got == [
        ("QuantizationModifier", "W8A8"),
        ("GPTQModifier", "W4A16"),
        ("GPTQModifier", "W8A16"),
        ("QuantizationModifier", "W4A16_ASYM"),
        ("QuantizationModifier", "FP8_DYNAMIC"),
        ("GPTQModifier", "W4A16_ASYM"),
    ]
    assert recipe.modifiers[-1].dampening_frac == 0.05  # percdamp: llm-compressor's old name
    assert recipe.source == "<string>"
    round_trip(recipe)  # the same modifier twice goes to separate groups, order kept


def test_input_kinds(tmp_path: Path) -> None:
    gptq = GPTQModifier(scheme="W4A16", ignore=["lm_head"])
    assert parse_recipe(gptq).modifiers == [gptq]
    recipe = parse_recipe(
        [gptq, RECIPES_DIR / "rtn_w8a8.yaml", "QuantizationModifier: {scheme: FP8_DYNAMIC}"]
    )
    assert [type(m) for m in recipe.modifiers] == [GPTQModifier, QuantizationModifier, QuantizationModifier]
    assert recipe.source == f"{RECIPES_DIR / 'rtn_w8a8.yaml'}, <string>"
    assert parse_recipe(recipe) is recipe
    as_dict = parse_recipe({"quant_stage": {"quant_modifiers": {"GPTQModifier": {"scheme": "W8A16"}}}})
    assert as_dict.source == "<dict>" and as_dict.modifiers[0].scheme == "W8A16"
    as_json = parse_recipe('{"quant_stage": {"quant_modifiers": {"GPTQModifier": {"scheme": "W4A16"}}}}')
    assert as_json.modifiers[0].scheme == "W4A16"
    anchored = parse_recipe(
        "metadata: {common: &common {scheme: W4A16, ignore: [lm_head]}}\n"
        "GPTQModifier: {<<: *common, block_size: 64}\n"
        "QuantizationModifier: *common\n"
    )
    assert anchored.modifiers[0].to_dict() == {"scheme": "W4A16", "ignore": ["lm_head"], "block_size": 64}
    assert anchored.modifiers[1].to_dict() == {"scheme": "W4A16", "ignore": ["lm_head"]}
    as_str_path = parse_recipe(str(RECIPES_DIR / "gptq_w4a16.yaml"))
    parse_recipe(as_str_path).save(tmp_path / "ckpt")  # a directory: ckpt/recipe.yaml
    assert_same(as_str_path, parse_recipe(tmp_path / "ckpt"))  # a checkpoint directory reads its recipe.yaml
    as_str_path.save(tmp_path / "mine.yml")
    assert_same(as_str_path, parse_recipe(str(tmp_path / "mine.yml")))


def test_to_yaml_is_llm_compressor_staged_form_with_non_default_arguments() -> None:
    recipe = Recipe([GPTQModifier(scheme="W4A16", ignore=("lm_head",), block_size=64)])
    loaded = yaml.safe_load(recipe.to_yaml())
    assert loaded == {
        "DEFAULT_stage": {
            "DEFAULT_modifiers": {
                "GPTQModifier": {"scheme": "W4A16", "ignore": ["lm_head"], "block_size": 64}
            }
        }
    }
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, strategy="channel"))
    objects = Recipe([QuantizationModifier(config_groups={"group_0": scheme})])
    assert parse_recipe(objects.to_yaml()).modifiers[0].groups == objects.modifiers[0].groups


def test_unsafe_yaml_is_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    text = f'GPTQModifier: {{scheme: !!python/object/apply:os.system ["touch {marker}"]}}'
    with pytest.raises(RecipeError, match=r"<string>:1: invalid YAML: .*safe loader"):
        parse_recipe(text)
    assert not marker.exists()
