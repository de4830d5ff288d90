"""Every modifier class llm-compressor 0.14 exports, with every argument of its signature: seqcal reads each one,
or refuses the modifier with the honest message.

The table is retyped from llm-compressor 0.14.0.1's pydantic fields (``Modifier.model_fields`` of each class its
ModifierFactory registers; private fields ending in ``_`` left out), each argument with the value its recipe.yaml
writes by default (or a typical one where it has no default). llm-compressor is never imported here.
"""

from __future__ import annotations

import pytest

from seqcal.modifiers import MODIFIERS
from seqcal.recipe.parse import RecipeError, parse_recipe

# The fields of llm-compressor's Modifier base class: every modifier has them.
BASE = {
    "index": 0,
    "group": "default",
    "start": -1,
    "end": -1,
    "update": 1.0,
    "requires_calibration_data": True,
}
# QuantizationMixin's fields (QuantizationModifier, GPTQModifier, AutoRoundModifier).
QUANT = {
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                                                      "strategy": "channel"}}},
    "targets": ["Linear"], "ignore": ["lm_head"], "scheme": "W4A16",
    "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
    "weight_observer": "minmax", "input_observer": None, "output_observer": None, "observer": None,
    "bypass_divisibility_checks": False,
}  # fmt: skip
SMOOTH = {"smoothing_strength": 0.5, "mappings": [[["re:.*q_proj"], "re:.*input_layernorm"]], "ignore": [],
          "num_calibration_steps": None, "calibration_function": None, "algorithm": "smoothquant"}  # fmt: skip
SPARSITY = {"sparsity": 0.5, "sparsity_profile": None, "mask_structure": "0:0", "owl_m": None, "owl_lmbda": None,
            "sequential_update": False, "targets": ["Linear"], "ignore": ["re:.*lm_head"]}  # fmt: skip
LLMC_0_14: dict[str, dict[str, object]] = {
    "QuantizationModifier": QUANT,
    "GPTQModifier": {
        **QUANT,
        "block_size": 128,
        "dampening_frac": 0.01,
        "actorder": "static",
        "batched_quantization": "auto",
    },  # fmt: skip
    "AWQModifier": {
        "mappings": [
            {
                "smooth_layer": "re:.*input_layernorm$",
                "balance_layers": ["re:.*q_proj$"],
                "activation_hook_target": None,
            }
        ],
        "offload_device": "cpu",
        "duo_scaling": True,
        "n_grid": 20,
    },  # fmt: skip
    "SmoothQuantModifier": SMOOTH,
    "LogarithmicEqualizationModifier": {**SMOOTH, "algorithm": "log_equalization"},
    "SparseGPTModifier": {
        **SPARSITY,
        "block_size": 128,
        "dampening_frac": 0.01,
        "preserve_sparsity_mask": False,
        "offload_hessians": False,
    },  # fmt: skip
    "WandaPruningModifier": SPARSITY,
    "MagnitudePruningModifier": {
        "targets": ["Linear"],
        "init_sparsity": 0.1,
        "final_sparsity": 0.5,
        "update_scheduler": "cubic",
        "scheduler_args": {},
        "mask_structure": "unstructured",
        "leave_enabled": False,
        "apply_globally": False,
    },  # fmt: skip
    "ConstantPruningModifier": {"targets": ["Linear"]},
    "AutoRoundModifier": {
        **QUANT,
        "iters": 200,
        "enable_torch_compile": True,
        "batch_size": 8,
        "lr": None,
        "device_ids": None,
        "disable_opt_rtn": False,
    },  # fmt: skip
    "QuIPModifier": {
        "rotations": ["v", "u"],
        "transform_type": "random-hadamard",
        "targets": "Linear",
        "randomize": False,
        "learnable": False,
        "precision": "torch.float64",
        "transform_block_size": None,
        "ignore": "lm_head",
        "transform_config": None,
    },  # fmt: skip
    "SpinQuantModifier": {
        "rotations": ["R1", "R2"],
        "transform_type": "hadamard",
        "randomize": False,
        "learnable": False,
        "precision": "torch.float64",
        "transform_block_size": None,
        "mappings": None,
        "norm_mappings": None,
        "transform_config": None,
    },  # fmt: skip
    "REAPPruningModifier": {"sparsity": 0.5, "ignore": [], "report_path": None},
}
# Arguments that need company: a modifier needs one of scheme / config_groups, pruning needs a sparsity.
REQUIRED = {
    "QuantizationModifier": {"scheme": "W4A16"}, "GPTQModifier": {"scheme": "W4A16"},
    "AWQModifier": {"scheme": "W4A16"}, "AutoRoundModifier": {"scheme": "W4A16"},
    "SparseGPTModifier": {"sparsity": 0.5}, "WandaPruningModifier": {"sparsity": 0.5},
    "MagnitudePruningModifier": {"targets": ["Linear"], "init_sparsity": 0.1, "final_sparsity": 0.5},
    "ConstantPruningModifier": {"targets": ["Linear"]}, "REAPPruningModifier": {"sparsity": 0.5},
}  # fmt: skip
EXCLUSIVE = {"config_groups": "scheme", "scheme": "config_groups"}  # one of the two, never both
NOT_YET: list[str] = []  # every llm-compressor 0.14 modifier is implemented


def _recipe(modifier: str, arg: str, value: object) -> dict:
    args = {k: v for k, v in REQUIRED.get(modifier, {}).items() if k != EXCLUSIVE.get(arg)}
    return {"quant_stage": {"quant_modifiers": {modifier: {**args, arg: value}}}}


CASES = [(m, a, v) for m, args in LLMC_0_14.items() for a, v in {**args, **BASE}.items()]


@pytest.mark.parametrize(("modifier", "arg", "value"), CASES, ids=[f"{m}.{a}" for m, a, _ in CASES])
def test_every_argument_of_every_llmc_modifier(modifier: str, arg: str, value: object) -> None:
    if modifier not in MODIFIERS:
        assert modifier in NOT_YET, f"{modifier} is neither implemented nor listed as not implemented yet"
        with pytest.raises(RecipeError) as err:
            parse_recipe(_recipe(modifier, arg, value))
        assert str(err.value).startswith(
            f"<dict>: {modifier} is an llm-compressor modifier that is not supported by seqcal yet; supported: "
            f"{', '.join(MODIFIERS)}. Remove it from the recipe, or run this recipe with llm-compressor"
        )
        return
    (built,) = parse_recipe(_recipe(modifier, arg, value)).modifiers
    assert type(built) is MODIFIERS[modifier]
    if arg in built.argument_names():
        assert getattr(built, arg) == value or arg in ("targets", "ignore", "kv_cache_scheme")


# seqcal's own modifiers, which llm-compressor 0.14 does not have
SEQCAL_ONLY = {"GPTAQModifier", "MixedPrecisionModifier", "KeepSourceFormatModifier"}


def test_the_table_covers_every_seqcal_modifier_and_the_ones_not_done() -> None:
    assert set(MODIFIERS) - SEQCAL_ONLY <= set(LLMC_0_14)
    assert set(LLMC_0_14) - set(MODIFIERS) <= set(NOT_YET)
