"""Recipes: seqcal's recipes/, llm-compressor's recipe files as they are, round trips, and errors that name
file:line, the problem and the valid choices."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from seqcal.modifiers import GPTQModifier, QuantizationModifier
from seqcal.recipe import Recipe, RecipeError, parse_recipe

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
EXPECTED_RECIPES = {
    "gptq_w4a16.yaml",
    "gptq_w4a16_g64.yaml",
    "gptq_w8a16.yaml",
    "rtn_w4a16.yaml",
    "rtn_w8a8.yaml",
    "rtn_fp8_dynamic.yaml",
    "gptq_w4a16_asym_actorder.yaml",
}


def _assert_same(a: Recipe, b: Recipe) -> None:
    assert [type(m) for m in a.modifiers] == [type(m) for m in b.modifiers]
    assert [m.to_dict() for m in a.modifiers] == [m.to_dict() for m in b.modifiers]


def _round_trip(recipe: Recipe) -> None:
    _assert_same(recipe, parse_recipe(recipe.to_yaml()))


def _weights(modifier: QuantizationModifier, group: str = "group_0") -> QuantizationArgs:
    return modifier.groups[group].weights


# --- seqcal's recipes/ ------------------------------------------------------------------------------------


def test_recipes_dir_holds_the_expected_files() -> None:
    assert EXPECTED_RECIPES <= {p.name for p in RECIPES_DIR.glob("*.yaml")}


@pytest.mark.parametrize("path", sorted(RECIPES_DIR.glob("*.y*ml")), ids=lambda p: p.name)
def test_every_recipe_file_parses_and_round_trips(path: Path) -> None:
    first_line = path.read_text().splitlines()[0]
    assert first_line.startswith("# ") and len(first_line) > 20, "each recipe starts with a one-line comment"
    recipe = parse_recipe(path)
    assert recipe.source == str(path)
    assert recipe.modifiers and all(m.ignore == ["lm_head"] for m in recipe.modifiers)
    _round_trip(recipe)


def test_recipes_mean_what_their_names_say() -> None:
    def only(name: str) -> QuantizationModifier:
        (modifier,) = parse_recipe(RECIPES_DIR / name).modifiers
        return modifier

    w = _weights(gptq := only("gptq_w4a16.yaml"))
    assert type(gptq) is GPTQModifier and (w.num_bits, w.strategy, w.group_size, w.symmetric) == (
        4,
        "group",
        128,
        True,
    )
    w = _weights(only("gptq_w4a16_g64.yaml"))
    assert (w.num_bits, w.strategy, w.group_size, w.type) == (4, "group", 64, "int")
    w = _weights(only("gptq_w8a16.yaml"))
    assert (w.num_bits, w.strategy, w.symmetric) == (8, "channel", True)
    w = _weights(rtn := only("rtn_w4a16.yaml"))
    assert type(rtn) is QuantizationModifier and (w.num_bits, w.group_size) == (4, 128)
    scheme = only("rtn_w8a8.yaml").groups["group_0"]
    assert (scheme.weights.num_bits, scheme.weights.type, scheme.weights.strategy) == (8, "int", "channel")
    acts = scheme.input_activations
    assert (acts.num_bits, acts.type, acts.strategy, acts.dynamic) == (8, "int", "token", True)
    scheme = only("rtn_fp8_dynamic.yaml").groups["group_0"]
    assert (scheme.weights.type, scheme.weights.strategy) == ("float", "channel")
    assert (scheme.input_activations.type, scheme.input_activations.dynamic) == ("float", True)
    asym = only("gptq_w4a16_asym_actorder.yaml")
    assert type(asym) is GPTQModifier and asym.actorder == "weight" and _weights(asym).symmetric is False


# --- llm-compressor's recipe files (Apache-2.0, vllm-project/llm-compressor), re-typed as they are --------

LLMC_OK = {
    "examples/quantization_w4a16/deepseekv2_lite_recipe.yaml": r"""
DEFAULT_stage:
  DEFAULT_modifiers:
    GPTQModifier:
      sequential_update: true
      ignore: [lm_head, 're:.*block_sparse_moe\.gate']
      config_groups:
        group_0:
          weights: {num_bits: 4, type: int, symmetric: true, strategy: channel, dynamic: false}
          targets: [Linear]
""",
    "examples/quantizing_moe/deepseek_recipe_w4a16.yaml": """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: [lm_head, "re:.*mlp.gate$", "model.embed_tokens"]
      config_groups:
        group_0:
          weights: {num_bits: 4, type: int, symmetric: true, strategy: channel, dynamic: false}
          targets: [Linear]""",
    "tests/e2e/vLLM/recipes/actorder/recipe_w4a16_actorder_weight.yaml": """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head", "re:vision_tower.*", "re:multi_modal_projector.*", "re:visual.*", "re:vision_model.*", "re:model.visual.*"]
      config_groups:
        group_0:
          weights:
            num_bits: 4
            type: "int"
            symmetric: true
            strategy: "group"
            group_size: 128
            actorder: "weight"
          targets: ["Linear"]
""",
    "tests/e2e/vLLM/recipes/actorder/recipe_w4a16_actorder_none.yaml": """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head"]
      actorder: null
      config_groups:
        group_0:
          weights:
            num_bits: 4
            type: "int"
            symmetric: true
            strategy: "group"
            group_size: 128
          targets: ["Linear"]
""",
    "tests/e2e/vLLM/recipes/actorder/recipe_w4a16_actorder_weight_dampfrac1e-1.yaml": """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      dampening_frac: 0.1
      ignore: ["lm_head", "re:vision_tower.*", "re:multi_modal_projector.*", "re:visual.*", "re:vision_model.*"]
      config_groups:
        group_0:
          weights:
            num_bits: 4
            type: "int"
            symmetric: true
            strategy: "group"
            group_size: 128
            actorder: "weight"
          targets: ["Linear"]
""",
    "tests/e2e/vLLM/recipes/WNA16/recipe_w4a16_group_quant_first_10_layers.yaml": r"""
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: [
        "lm_head",
        # Ignore layers (10+)
        "re:.*model\\.layers\\.([1-9][0-9])\\..*",
        "re:.*mlp[.]gate[.].*"
      ]
      actorder: null
      config_groups:
        group_0:
          weights:
            num_bits: 4
            type: "int"
            symmetric: True
            strategy: "group"
            group_size: 128
          input_activations: null
          output_activations: null
          targets: ["Linear"]
""",
    "tests/e2e/vLLM/recipes/FP8/recipe_fp8_dynamic.yaml": """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head", "re:vision_tower.*", "re:multi_modal_projector.*", "re:visual.*", "re:vision_model.*", "re:model.visual.*"]
      config_groups:
        group_0:
          weights:
            num_bits: 8
            type: "float"
            symmetric: true
            strategy: "channel"
            dynamic: false
          input_activations:
            num_bits: 8
            type: "float"
            symmetric: true
            strategy: "token"
            dynamic: true
          targets: ["Linear"]
""",
    "tests/e2e/vLLM/recipes/WNA16/recipe_w4a16_channel_quant.yaml": """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      sequential_update: false
      ignore: [lm_head]
      config_groups:
        group_0:
          weights: {num_bits: 4, type: int, symmetric: true, strategy: channel, dynamic: false}
          targets: [Linear]
""",
    "tests/e2e/vLLM/recipes/WNA16/recipe_w8a16_channel_quant.yaml": """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      sequential_update: false
      ignore: [lm_head]
      config_groups:
        group_0:
          weights: {num_bits: 8, type: int, symmetric: true, strategy: channel, dynamic: false}
          targets: [Linear]
""",
    "tests/llmcompressor/transformers/compression/recipes/new_quant_fp8.yaml": """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head"]
      config_groups:
        group_0:
          weights:
            num_bits: 8
            type: "float"
            symmetric: true
            strategy: channel
          targets: ["Linear"]""",
    "tests/llmcompressor/transformers/compression/recipes/new_quant_group.yaml": """
test_stage:
    quant_modifiers:
        QuantizationModifier:
            ignore: ["lm_head", "model.layers.0.mlp.down_proj"]
            config_groups:
                group_0:
                    weights:
                        num_bits: 4
                        type: "int"
                        symmetric: False
                        strategy: "group"
                        group_size: 128
                    input_activations: null
                    output_activations: null
                    targets: ["Linear"]
        GPTQModifier:
            block_size: 128""",
    "tests/llmcompressor/transformers/compression/recipes/new_quant_weight.yaml": r"""
test_stage:
    quant_modifiers:
        QuantizationModifier:
            ignore: ["lm_head", "model.layers.0.mlp.down_proj"]
            config_groups:
                group_0:
                    weights:
                        num_bits: 8
                        type: "int"
                        symmetric: true
                        strategy: "tensor"
                    input_activations: null
                    output_activations: null
                    targets: ["Linear", "Embedding"]
        GPTQModifier:
            block_size: 128
            targets: ["re:model.layers.\\d+$"]""",
}


@pytest.mark.parametrize("name", list(LLMC_OK))
def test_llm_compressor_recipes_parse_and_round_trip(name: str) -> None:
    recipe = parse_recipe(LLMC_OK[name])
    assert len(recipe.modifiers) == 1 and "lm_head" in recipe.modifiers[0].ignore
    _round_trip(recipe)


def test_llm_compressor_recipe_details() -> None:
    (moe,) = parse_recipe(LLMC_OK["examples/quantization_w4a16/deepseekv2_lite_recipe.yaml"]).modifiers
    assert moe.ignore == ["lm_head", r"re:.*block_sparse_moe\.gate"] and _weights(moe).strategy == "channel"
    layers = parse_recipe(
        LLMC_OK["tests/e2e/vLLM/recipes/WNA16/recipe_w4a16_group_quant_first_10_layers.yaml"]
    )
    assert (
        layers.modifiers[0].ignore[1] == r"re:.*model\.layers\.([1-9][0-9])\..*"
        and layers.modifiers[0].actorder is None
    )
    damp = parse_recipe(
        LLMC_OK["tests/e2e/vLLM/recipes/actorder/recipe_w4a16_actorder_weight_dampfrac1e-1.yaml"]
    )
    assert damp.modifiers[0].dampening_frac == 0.1
    (fp8,) = parse_recipe(LLMC_OK["tests/e2e/vLLM/recipes/FP8/recipe_fp8_dynamic.yaml"]).modifiers
    assert type(fp8) is QuantizationModifier and fp8.groups["group_0"].input_activations.dynamic is True
    # `sequential_update` on a QuantizationModifier is deprecated in llm-compressor: accepted, dropped.
    (chan,) = parse_recipe(LLMC_OK["tests/e2e/vLLM/recipes/WNA16/recipe_w4a16_channel_quant.yaml"]).modifiers
    assert "sequential_update" not in chan.to_dict() and _weights(chan).num_bits == 4


def test_legacy_quantization_then_bare_gptq_becomes_one_gptq() -> None:
    """llm-compressor < 0.2: a GPTQModifier without a scheme used the QuantizationModifier before it."""
    (group,) = parse_recipe(
        LLMC_OK["tests/llmcompressor/transformers/compression/recipes/new_quant_group.yaml"]
    ).modifiers
    assert type(group) is GPTQModifier and group.ignore == ["lm_head", "model.layers.0.mlp.down_proj"]
    assert (_weights(group).symmetric, _weights(group).group_size) == (False, 128)
    (weight,) = parse_recipe(
        LLMC_OK["tests/llmcompressor/transformers/compression/recipes/new_quant_weight.yaml"]
    ).modifiers
    assert weight.sequential_targets == [r"re:model.layers.\d+$"]  # its old `targets` were the layers
    assert (
        weight.groups["group_0"].targets == ["Linear", "Embedding"] and _weights(weight).strategy == "tensor"
    )


LLMC_UNSUPPORTED = {
    "TinyLlama-1.1B-Chat-v1.0-fp8/recipe.yaml (saved by llm-compressor; FP8 = static activations)": (
        """
DEFAULT_stage:
  DEFAULT_modifiers:
    QuantizationModifier:
      ignore: [lm_head]
      targets: Linear
      scheme: FP8
""",
        ["<string>:4:", "static input activation quantization is not supported; use dynamic"],
    ),
    "tests/e2e/vLLM/recipes/actorder/recipe_w4a16_actorder_group.yaml (group actorder left compressed-tensors)": (
        """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head"]
      actorder: "group"
      config_groups:
        group_0:
          weights:
            num_bits: 4
            type: "int"
            symmetric: true
            strategy: "group"
            group_size: 128
            actorder: "group"
          targets: ["Linear"]
""",
        ["<string>:4:", "actorder='group' has been removed", "actorder='weight'"],
    ),
    "examples/quantization_w8a8_int8/recipe.yaml": (
        """
quant_stage:
    quant_modifiers:
        SmoothQuantModifier:
            smoothing_strength: 0.8
            mappings: [
                [["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
                [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"]
            ]
        GPTQModifier:
            # Set sequential_update: true to reduce memory consumption
            sequential_update: false
            ignore: ["lm_head"]
            config_groups:
                group_0:
                    weights:
                        num_bits: 8
                        type: "int"
                        symmetric: true
                        strategy: "channel"
                    input_activations:
                        num_bits: 8
                        type: "int"
                        symmetric: true
                        dynamic: true
                        strategy: "token"
                    targets: ["Linear"]
""",
        ["<string>:4:", "SmoothQuantModifier", "not supported by seqcal yet", "GPTQModifier"],
    ),
    "tests/e2e/vLLM/recipes/non_uniform/recipe_gptq_awq.yaml": (
        """
quant_stage:
  quant_modifiers:
    AWQModifier:
      ignore: ["lm_head"]
      duo_scaling: true
      scheme: "W4A16"
      targets:
        - "re:.*self_attn\\\\.(k|q|o|v)_proj$"
      mappings:
        - smooth_layer: "re:.*input_layernorm$"
          balance_layers: ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]

    GPTQModifier:
      ignore: ["lm_head"]
      scheme: "W8A8"
      targets:
        - "re:.*mlp\\\\.(down|gate|up)_proj$"
      block_size: 128
      dampening_frac: 0.001
      actorder: null
""",
        ["<string>:4:", "AWQModifier", "not supported by seqcal yet"],
    ),
    "tests/e2e/vLLM/recipes/kv_cache/gptq.yaml": (
        """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      sequential_update: false
      ignore: ["lm_head", "re:vision_tower.*", "re:multi_modal_projector.*", "re:visual.*", "re:vision_model.*"]
      config_groups:
          group_0:
              weights:
                  num_bits: 4
                  type: "int"
                  symmetric: true
                  strategy: "channel"
                  actorder: False
              targets: ["Linear"]
      kv_cache_scheme:
        {num_bits: 8, type: float, symmetric: true, strategy: tensor}""",
        ["<string>:16:", "GPTQModifier: kv_cache_scheme is not supported"],
    ),
    "tests/llmcompressor/transformers/compression/recipes/new_quant_full.yaml": (
        """
test_stage:
    quant_modifiers:
        GPTQModifier:
            block_size: 128
            ignore: ["lm_head", "model.layers.0.mlp.down_proj"]
            config_groups:
                group_0:
                    weights:
                        num_bits: 8
                        type: "int"
                        symmetric: false
                        strategy: "channel"
                    input_activations:
                        num_bits: 8
                        type: "int"
                        symmetric: false
                        strategy: "tensor"
                    output_activations: null
                    targets: ["Linear"]""",
        ["<string>:4:", "static input activation quantization is not supported; use dynamic"],
    ),
    "examples/llama_1.1b/example_quant_recipe.yaml (sparseml-era scheme_overrides)": (
        """
test_stage:
    quant_modifiers:
        QuantizationModifier:
            ignore:
                - model.layers.0.mlp.down_proj
                - LlamaRotaryEmbedding
                - LlamaRMSNorm
                - SiLU
                - MatMulLeftInput_QK
                - MatMulRightInput_QK
                - MatMulOutput_QK
                - MatMulLeftInput_PV
                - MatMulRightInput_PV
                - MatMulOutput_PV
            scheme_overrides:
                Linear:
                    weights:
                        num_bits: 8
                        symmetric: true
                        strategy: "tensor"
""",
        ["<string>:16:", "unknown argument 'scheme_overrides' for QuantizationModifier", "config_groups"],
    ),
    "examples/quantization_2of4_sparse_w4a16/2of4_w4a16_group-128_recipe.yaml": (
        """
sparsity_stage:
  run_type: oneshot
  sparsity_modifiers:
    SparseGPTModifier:
      sparsity: 0.5
      mask_structure: "2:4"
      targets: ["Linear"]
      ignore: ["re:.*lm_head"]
finetuning_stage:
  run_type: train
  finetuning_modifiers:
    ConstantPruningModifier:
      targets: [
        're:.*q_proj.weight',
        're:.*k_proj.weight',
      ]
      start: 0
quantization_stage:
  run_type: oneshot
  quantization_modifiers:
    GPTQModifier:
      ignore: ["lm_head"]
      config_groups:
        group_0:
          weights:
            num_bits: 4
            type: "int"
            symmetric: true
            strategy: "group"
            group_size: 128
          targets: ["Linear"]
""",
        ["<string>:11:", "run_type 'train' is not supported", "oneshot"],
    ),
}


@pytest.mark.parametrize("name", list(LLMC_UNSUPPORTED))
def test_llm_compressor_recipes_seqcal_cannot_run_fail_clearly(name: str) -> None:
    text, expected = LLMC_UNSUPPORTED[name]
    with pytest.raises(RecipeError) as info:
        parse_recipe(text)
    for part in expected:
        assert part in str(info.value)
    assert "unknown modifier" not in str(info.value)


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
    _round_trip(recipe)  # the same modifier twice goes to separate groups, order kept


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
    _assert_same(as_str_path, parse_recipe(tmp_path / "ckpt"))  # a checkpoint directory reads its recipe.yaml
    as_str_path.save(tmp_path / "mine.yml")
    _assert_same(as_str_path, parse_recipe(str(tmp_path / "mine.yml")))


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


# --- bad recipes: each error names where, what and the valid choices --------------------------------------

BAD = {
    "unknown modifier": (
        "quant_stage:\n  quant_modifiers:\n    GPTQModifer:\n      scheme: W4A16\n",
        [
            "<string>:3:",
            "unknown modifier 'GPTQModifer'",
            "did you mean 'GPTQModifier'",
            "QuantizationModifier",
        ],
    ),
    "unsupported modifier": (
        "SmoothQuantModifier: {smoothing_strength: 0.8}\nGPTQModifier: {scheme: W4A16}\n",
        [
            "<string>:1:",
            "SmoothQuantModifier",
            "not supported by seqcal yet",
            "supported: QuantizationModifier",
        ],
    ),
    "unknown argument": (
        "GPTQModifier:\n  scheme: W4A16\n  dampening_fraction: 0.1\n",
        [
            "<string>:3:",
            "unknown argument 'dampening_fraction' for GPTQModifier",
            "did you mean 'dampening_frac'",
            "block_size",
        ],
    ),
    "bad value": (
        "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {scheme: W4A16, block_size: -1}\n",
        ["<string>:3:", "GPTQModifier: block_size must be a positive integer, got -1"],
    ),
    "bad value (type)": (
        "GPTQModifier: {scheme: W4A16, dampening_frac: [1]}\n",
        ["<string>:1:", "GPTQModifier:"],
    ),
    "unknown scheme": (
        "QuantizationModifier: {scheme: W4A17}\n",
        ["<string>:1:", "unknown scheme 'W4A17'", "W4A16", "FP8_DYNAMIC"],
    ),
    "kv cache": (
        "QuantizationModifier:\n  scheme: FP8\n  kv_cache_scheme: {num_bits: 8, type: float}\n",
        ["<string>:3:", "kv_cache_scheme is not supported yet"],
    ),
    "yaml syntax": (
        "quant_stage:\n  quant_modifiers:\n    GPTQModifier:\n      ignore: [lm_head\n      scheme: W4A16\n",
        ["<string>:5:", "invalid YAML", "flow sequence"],
    ),
    "yaml tag": (
        "modifiers:\n  - !GPTQModifier\n    scheme: W4A16\n",
        ["<string>:2:", "invalid YAML", "'!GPTQModifier'", "GPTQModifier: {scheme: W4A16}"],
    ),
    "empty": ("# nothing here\n", ["<string>: the recipe is empty", "quant_stage"]),
    "no modifiers": (
        "version: 1.1.0\nmetadata: {}\n",
        ["<string>: the recipe has no modifiers", "quant_stage"],
    ),
    "top-level list": (
        "- GPTQModifier: {scheme: W4A16}\n",
        ["<string>: a recipe must be a mapping", "got list"],
    ),
    "modifier twice in a group": (
        "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {scheme: W4A16}\n    GPTQModifier: {scheme: W8A16}\n",
        ["<string>:4:", "'GPTQModifier' is given twice in one group (lines 3 and 4)", "_modifiers' group"],
    ),
    "run_type train": (
        "train_stage:\n  run_type: train\n  quant_modifiers:\n    GPTQModifier: {scheme: W4A16}\n",
        ["<string>:2:", "run_type 'train' is not supported", "run_type: oneshot"],
    ),
    "unknown top-level key": (
        "quant_stag:\n  quant_modifiers:\n    GPTQModifier: {scheme: W4A16}\n",
        [
            "<string>:1:",
            "unknown top-level key 'quant_stag'",
            "'<name>_stage'",
            "'<name>_modifiers'",
            "GPTQModifier",
        ],
    ),
    "unknown key in stage": (
        "quant_stage:\n  quant_modifier:\n    GPTQModifier: {scheme: W4A16}\n",
        ["<string>:2:", "unknown key 'quant_modifier' in stage 'quant_stage'", "'<name>_modifiers' groups"],
    ),
    "stage not a mapping": ("quant_stage: GPTQModifier\n", ["<string>:1:", "stage 'quant_stage' must map"]),
    "group not a mapping": (
        "quant_modifiers: GPTQModifier\n",
        ["<string>:1:", "group 'quant_modifiers' must map modifier names", "got str"],
    ),
    "arguments not a mapping": (
        "GPTQModifier: [W4A16]\n",
        ["<string>:1:", "the arguments of GPTQModifier must be a mapping", "got list"],
    ),
    "two modifiers in one list item": (
        "quant_modifiers:\n  - GPTQModifier: {scheme: W4A16}\n    QuantizationModifier: {scheme: W8A8}\n",
        ["<string>:3:", "exactly one modifier", "GPTQModifier", "QuantizationModifier"],
    ),
    "eval expression": (
        "args: {damp: 0.01}\nGPTQModifier: {scheme: W4A16, dampening_frac: 'eval(damp * 2)'}\n",
        ["<string>:2:", "GPTQModifier.dampening_frac", "eval(...)", "never evaluates"],
    ),
    "old and new argument name": (
        "GPTQModifier: {scheme: W4A16, percdamp: 0.1, dampening_frac: 0.1}\n",
        ["<string>:1:", "'percdamp' is the old name of 'dampening_frac'"],
    ),
    "bare gptq alone": (
        "GPTQModifier: {block_size: 64}\n",
        ["<string>:1:", "give exactly one of `scheme`", "config_groups"],
    ),
    "repeated argument": (
        "GPTQModifier:\n  scheme: W4A16\n  scheme: W8A16\n",
        ["<string>:3:", "key 'scheme' is given twice", "lines 2 and 3"],
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_recipe_errors_say_where_what_and_choices(case: str) -> None:
    text, expected = BAD[case]
    with pytest.raises(RecipeError) as info:
        parse_recipe(text)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    assert isinstance(info.value, ValueError)


def test_errors_in_files_name_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "my_recipe.yaml"
    path.write_text(
        "# comment\nquant_stage:\n  quant_modifiers:\n    GPTQModifier:\n      scheme: W4A16\n      blocksize: 64\n"
    )
    with pytest.raises(
        RecipeError, match=rf"^{path}:6: unknown argument 'blocksize' .*did you mean 'block_size'"
    ):
        parse_recipe(path)
    with pytest.raises(RecipeError, match=r"missing\.yaml: recipe file not found"):
        parse_recipe(tmp_path / "missing.yaml")
    with pytest.raises(RecipeError, match=r"missing\.yaml: recipe file not found"):
        parse_recipe("missing.yaml")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("quant_stage:\n  quant_modifiers:\n    GPTQModifier: {scheme: W4A16\n")
    with pytest.raises(RecipeError, match=rf"^{bad_yaml}:\d+: invalid YAML"):
        parse_recipe(bad_yaml)


def test_wrong_python_inputs() -> None:
    with pytest.raises(RecipeError, match="got int"):
        parse_recipe(42)  # type: ignore[arg-type]
    with pytest.raises(RecipeError, match="the recipe list is empty"):
        parse_recipe([])
    with pytest.raises(RecipeError, match=r"modifiers\[1\] is a str, not a seqcal Modifier"):
        Recipe([GPTQModifier(scheme="W4A16"), "GPTQModifier"])  # type: ignore[list-item]
    with pytest.raises(RecipeError, match="if it was meant as a file path, no such file exists"):
        parse_recipe("recipes/not_a_recipe")
