"""Writes the recipe.yaml files of this folder with llm-compressor 0.14 (not run by the tests).

    python -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0 && \
        /tmp/llmc/bin/pip install llmcompressor==0.14.0.1 "transformers<=5.17"
    /tmp/llmc/bin/python tests/data/llmc_0_14/make_recipes.py TOKENIZER_DIR

Recipes with RUN are applied by llm-compressor's oneshot to a tiny random Llama and the recipe.yaml it saves is
copied here (QuIP and SpinQuant with the transform_config they build from their arguments among them); the others
are written by the same serializer (``Recipe.from_modifiers(...).yaml()``) without a run (modifiers given enum
objects rather than strings, and rotations without the transform_config a run adds).
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from compressed_tensors.quantization import ActivationOrdering, QuantizationArgs, preset_name_to_scheme
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.awq import AWQModifier
from llmcompressor.modifiers.logarithmic_equalization import LogarithmicEqualizationModifier
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
from llmcompressor.modifiers.transform import QuIPModifier, SpinQuantModifier
from llmcompressor.pipelines.cache import IntermediatesCache
from llmcompressor.recipe import Recipe
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).parent
QKV, GATE_UP = ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"], ["re:.*gate_proj$", "re:.*up_proj$"]
W4_G32 = {
    "targets": ["Linear"],
    "weights": {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": 32,
        "actorder": "static",
    },
}
RUN = {
    "gptq_w4a16_actorder_static": [GPTQModifier(scheme="W4A16", ignore=["lm_head"], actorder="static")],
    "gptq_w4a16_actorder_weight": [
        GPTQModifier(scheme="W4A16", ignore=["lm_head"], actorder="weight", dampening_frac=0.05)
    ],
    "awq_w4a16_asym": [AWQModifier(ignore=["lm_head"], scheme="W4A16_ASYM", targets=["Linear"])],
    "awq_w4a16_mappings": [
        AWQModifier(
            ignore=["lm_head"],
            scheme="W4A16",
            targets=["Linear"],
            duo_scaling="both",
            offload_device=torch.device("cpu"),
            mappings=[
                {"smooth_layer": "re:.*input_layernorm$", "balance_layers": QKV},
                {"smooth_layer": "re:.*post_attention_layernorm$", "balance_layers": GATE_UP},
            ],
        )
    ],
    "smoothquant_gptq_w8a8": [
        SmoothQuantModifier(smoothing_strength=0.8),
        GPTQModifier(scheme="W8A8", ignore=["lm_head"]),
    ],
    "rtn_fp8_dynamic": [QuantizationModifier(scheme="FP8_DYNAMIC", ignore=["lm_head"])],
    "config_groups_w4a16": [GPTQModifier(ignore=["lm_head"], config_groups={"group_0": W4_G32})],
    # rotations: the recipe.yaml holds the transform_config each modifier built from its own arguments
    "quip_gptq_w4a16": [QuIPModifier(rotations=["v"]), GPTQModifier(scheme="W4A16", ignore=["lm_head"])],
    "quip_uv_b64_gptq_w4a16": [
        QuIPModifier(rotations=["v", "u"], transform_type="hadamard", transform_block_size=64),
        GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
    ],
    "spinquant_gptq_w4a16": [
        SpinQuantModifier(rotations=["R1", "R2", "R4"]),
        GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
    ],
    "spinquant_r1r2_rtn_w4a16": [
        SpinQuantModifier(rotations=["R1", "R2"], transform_block_size=64),
        QuantizationModifier(scheme="W4A16", ignore=["lm_head"]),
    ],
    "rtn_w8a8_int8": [QuantizationModifier(scheme="W8A8", ignore=["lm_head"])],
    "gptq_w4a16_g64_asym": [
        GPTQModifier(
            ignore=["lm_head"],
            config_groups={
                "group_0": {
                    **W4_G32,
                    "weights": {**W4_G32["weights"], "group_size": 64, "symmetric": False, "actorder": None},
                }
            },
        )
    ],
}
WRITE = {
    "gptq_kv_nvfp4_groups": [
        GPTQModifier(
            config_groups={"group_0": preset_name_to_scheme("NVFP4", ["Linear"])},
            ignore=["lm_head"],
            actorder=ActivationOrdering.WEIGHT,
            kv_cache_scheme=QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False),
        )
    ],
    "quip_spinquant": [
        QuIPModifier(rotations=["v", "u"], transform_block_size=64),
        SpinQuantModifier(rotations=["R1", "R2"]),
        QuantizationModifier(scheme="W4A16", ignore=["lm_head"]),
    ],
    "log_equalization": [
        LogarithmicEqualizationModifier(mappings=[([r.rstrip("$") for r in QKV], "re:.*input_layernorm")]),
        GPTQModifier(scheme="W8A8", ignore=["lm_head"]),
    ],
}


def main(tokenizer_dir: str) -> None:
    IntermediatesCache.pin_memory = lambda self, *a, **k: None  # no accelerator: nothing to pin for
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=128,
        )
        LlamaForCausalLM(config).save_pretrained(f"{tmp}/base")
        tokenizer.save_pretrained(f"{tmp}/base")
        ids = torch.randint(0, 256, (8, 32))
        data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
        for name, recipe in RUN.items():
            oneshot(
                model=f"{tmp}/base",
                processor=tokenizer,
                dataset=data,
                recipe=recipe,
                output_dir=f"{tmp}/{name}",
                num_calibration_samples=8,
                max_seq_length=32,
            )
            shutil.copy(f"{tmp}/{name}/recipe.yaml", HERE / f"{name}.yaml")
    for name, recipe in WRITE.items():
        (HERE / f"{name}.yaml").write_text(Recipe.from_modifiers(recipe).yaml())


if __name__ == "__main__":
    main(sys.argv[1])
