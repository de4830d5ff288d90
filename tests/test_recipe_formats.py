"""Recipes: llm-compressor's recipe files parse as they are, mean what they say, and round-trip."""

from __future__ import annotations

import pytest

from recipe_helpers import group_weights, round_trip
from seqcal.modifiers import GPTQModifier, QuantizationModifier
from seqcal.recipe.parse import parse_recipe

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
    round_trip(recipe)


def test_llm_compressor_recipe_details() -> None:
    (moe,) = parse_recipe(LLMC_OK["examples/quantization_w4a16/deepseekv2_lite_recipe.yaml"]).modifiers
    assert (
        moe.ignore == ["lm_head", r"re:.*block_sparse_moe\.gate"] and group_weights(moe).strategy == "channel"
    )
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
    assert "sequential_update" not in chan.to_dict() and group_weights(chan).num_bits == 4


def test_legacy_quantization_then_bare_gptq_becomes_one_gptq() -> None:
    """llm-compressor < 0.2: a GPTQModifier without a scheme used the QuantizationModifier before it."""
    (group,) = parse_recipe(
        LLMC_OK["tests/llmcompressor/transformers/compression/recipes/new_quant_group.yaml"]
    ).modifiers
    assert type(group) is GPTQModifier and group.ignore == ["lm_head", "model.layers.0.mlp.down_proj"]
    assert (group_weights(group).symmetric, group_weights(group).group_size) == (False, 128)
    (weight,) = parse_recipe(
        LLMC_OK["tests/llmcompressor/transformers/compression/recipes/new_quant_weight.yaml"]
    ).modifiers
    assert weight.sequential_targets == [r"re:model.layers.\d+$"]  # its old `targets` were the layers
    assert (
        weight.groups["group_0"].targets == ["Linear", "Embedding"]
        and group_weights(weight).strategy == "tensor"
    )
