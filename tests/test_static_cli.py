"""Static activation settings that cannot work fail before calibrating, as one sentence, through the real
``seqcal oneshot`` command (and through ``oneshot`` in Python, tests/test_static_activations.py)."""

from __future__ import annotations

from pathlib import Path

from test_cli import SMALL, assert_user_error, seqcal, tiny_dir  # noqa: F401 (tiny_dir is a fixture)

RECIPE = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          weights: {{num_bits: 8, type: int, symmetric: true, strategy: channel}}
          input_activations: {{num_bits: 8, type: int, symmetric: true, {acts}}}
          targets: [Linear]
"""


def _oneshot(tiny: Path, tmp_path: Path, acts: str):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(acts=acts))
    out = tmp_path / "out"
    return seqcal("oneshot", "--model", str(tiny), "--recipe", str(recipe), "--output-dir", str(out), *SMALL)


def test_an_unknown_observer_is_refused_with_the_valid_names(tiny_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    result = _oneshot(tiny_dir, tmp_path, "strategy: tensor, observer: min_max")
    assert_user_error(
        result, "recipe.yaml:4:", "GPTQModifier group 'group_0'", "observer 'min_max' does not exist",
        "valid observers: minmax, static_minmax, memoryless_minmax, mse, memoryless_mse",
    )  # fmt: skip
    assert "cutting" not in result.stderr and not (tmp_path / "out").exists()


def test_an_activation_group_that_does_not_divide_a_module_is_refused(tiny_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    result = _oneshot(tiny_dir, tmp_path, "strategy: group, group_size: 48")
    assert_user_error(
        result, "group_size 48 does not divide the inputs of", "model.layers.0.self_attn.q_proj (128 inputs)",
        "choose a scheme whose group size divides them",
    )  # fmt: skip
    assert "cutting" not in result.stderr and not (tmp_path / "out" / "config.json").exists()


FP8 = str(Path(__file__).resolve().parents[1] / "recipes" / "rtn_fp8_static.yaml")


def test_eval_of_an_activation_recipe_without_output_dir_is_refused(tiny_dir: Path) -> None:  # noqa: F811
    # the returned model runs its inputs unquantized: only the checkpoint is the quantized model
    result = seqcal("oneshot", "--model", str(tiny_dir), "--recipe", FP8, "--eval", *SMALL)
    assert_user_error(result, "--eval of a recipe that quantizes activations", "add --output-dir")
    assert "cutting" not in result.stderr


def test_eval_of_an_activation_recipe_measures_the_checkpoint(tiny_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    text = tmp_path / "eval.txt"
    text.write_text(" The river runs past the old town and under its bridge. " * 40)
    window = ["--eval-seq-length", "32", "--eval-windows", "2"]
    out = tmp_path / "out"
    run = seqcal("oneshot", "--model", str(tiny_dir), "--recipe", FP8, "--output-dir", str(out), "--eval",
                 "--eval-dataset", str(text), "--dataset", str(text), "--plot", "none", *window, *SMALL, "-q")  # fmt: skip
    assert run.returncode == 0, run.stderr
    after = run.stdout.split("-> after ")[1].split()[0]
    saved = seqcal("eval", "ppl", "--model", str(out), "--dataset", str(text), "--seq-len", "32",
                   "--eval-windows", "2", "-q")  # fmt: skip
    assert saved.returncode == 0, saved.stderr
    assert f"{float(saved.stdout.split(': ')[-1]):.2f}" == after
