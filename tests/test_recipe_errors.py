"""Recipes: what seqcal cannot run, and bad recipes, fail with errors that name file:line, the problem and
the valid choices."""

from __future__ import annotations

from pathlib import Path

import pytest

from seqcal.modifiers import GPTQModifier
from seqcal.recipe.parse import Recipe, RecipeError, parse_recipe

# --- llm-compressor's recipe files seqcal cannot run (Apache-2.0, vllm-project/llm-compressor) -----------

LLMC_UNSUPPORTED = {
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
        "OutputDistillationModifier: {comparison: l2}\nGPTQModifier: {scheme: W4A16}\n",
        [
            "<string>:1:",
            "OutputDistillationModifier",
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
        "QuantizationModifier:\n  scheme: FP8\n  kv_cache_scheme: {num_bits: 4, type: int, strategy: group, group_size: 64}\n",
        [
            "<string>:3:",
            "kv_cache_scheme (num_bits 4, type int, strategy group",
            "supported: fp8 with static scales",
        ],
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
    "unsupported num_bits": (
        "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      config_groups:\n        group_0:\n"
        "          targets: [Linear]\n          weights: {num_bits: 16, type: int, strategy: channel}\n",
        ["<string>:7:", "weights num_bits 16 is not supported for int codes", "1 to 8 bits", "ignore"],
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


@pytest.mark.parametrize(
    ("modifier", "part", "line"),
    [
        ("QuantizationModifier", "weights", 9),
        ("GPTQModifier", "weights", 9),
        ("AWQModifier", "weights", 9),
        ("GPTQModifier", "input_activations", 11),
    ],  # fmt: skip
)
def test_unsupported_num_bits_is_refused_with_the_recipe_line(
    tmp_path: Path, modifier: str, part: str, line: int
) -> None:
    bits = {"weights": 4, "input_activations": 8, part: 16}
    path = tmp_path / "w16.yaml"
    path.write_text(
        f"quant_stage:\n  quant_modifiers:\n    {modifier}:\n      ignore: [lm_head]\n      config_groups:\n"
        f"        group_0:\n          targets: [Linear]\n          weights:\n            num_bits: {bits['weights']}\n"
        f"          input_activations:\n            num_bits: {bits['input_activations']}\n"
        "            dynamic: true\n            strategy: token\n"
    )
    with pytest.raises(RecipeError) as info:
        parse_recipe(path)
    assert str(info.value).startswith(f"{path}:{line}: {modifier} group 'group_0': {part} num_bits 16 ")
    assert "1 to 8 bits" in str(info.value)
    with pytest.raises(ValueError, match="weights num_bits 12 is not supported"):  # from Python too
        GPTQModifier(config_groups={"g": {"targets": ["Linear"], "weights": {"num_bits": 12}}})


def test_wrong_python_inputs() -> None:
    with pytest.raises(RecipeError, match="got int"):
        parse_recipe(42)  # type: ignore[arg-type]
    with pytest.raises(RecipeError, match="the recipe list is empty"):
        parse_recipe([])
    with pytest.raises(RecipeError, match=r"modifiers\[1\] is a str, not a seqcal Modifier"):
        Recipe([GPTQModifier(scheme="W4A16"), "GPTQModifier"])  # type: ignore[list-item]
    with pytest.raises(RecipeError, match="if it was meant as a file path, no such file exists"):
        parse_recipe("recipes/not_a_recipe")
