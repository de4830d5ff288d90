"""Every shipped recipe gives a checkpoint that transformers and ``seqcal eval ppl`` load as the calibrated model.

Each recipe in recipes/ quantizes a tiny Llama through ``oneshot``; the checkpoint must load with a plain
``AutoModelForCausalLM.from_pretrained``, reproduce the in-memory fake-quantized model's logits (with
input activation fake-quant where the scheme asks for it: per token, or with the calibrated static scale),
and load in ``seqcal eval ppl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from save_helpers import as_bfloat16, assert_logits_equal, checkpoint_tensors
from seqcal.checkpoint.config import runs_only_in_bfloat16
from seqcal.entrypoint import oneshot
from seqcal.evaluation.loading import apply_online_transforms
from seqcal.modifiers.activations import quantized_inputs
from seqcal.modifiers.base import QuantizedWeight, RunState
from seqcal.recipe.parse import parse_recipe
from tokenizer_helpers import word_level

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))
WORDS = [f"w{i}" for i in range(120)]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return word_level(WORDS, eos_token="[UNK]")


def _tiny_llama(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    # (k_proj's 128 output rows fit FP8_BLOCK's 128-row blocks, which vLLM merges with q_proj's)
    return LlamaForCausalLM(config).eval()


def _text(n_words: int, seed: int) -> str:
    picks = torch.randint(len(WORDS), (n_words,), generator=torch.Generator().manual_seed(seed)).tolist()
    return " ".join(WORDS[i] for i in picks)


def _schemes(recipe: Path, model: torch.nn.Module, out: Path) -> tuple[RunState, dict]:
    """The recipe's scheme per quantized module with the checkpoint's static input scales, as
    quantized_inputs reads them (input activations fake-quantized as the loaded checkpoint runs them)."""
    state, schemes, tensors = RunState(), {}, checkpoint_tensors(out)
    for modifier in parse_recipe(str(recipe)).modifiers:
        modifier.validate(model)
        for name, scheme in getattr(
            modifier, "modules", {}
        ).items():  # transforms (SmoothQuant) quantize none
            state.results.quantized[name] = QuantizedWeight(
                torch.empty(0), torch.empty(0), None, None, scheme, input_scale=tensors.get(f"{name}.input_scale"),
                input_zero_point=tensors.get(f"{name}.input_zero_point"),
                input_global_scale=tensors.get(f"{name}.input_global_scale"),
            )  # fmt: skip
            schemes[name] = scheme
    return state, schemes


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_checkpoint_loads_everywhere(recipe: Path, tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    data = [_text(48, seed) for seed in range(8)]
    model = oneshot(model=_tiny_llama(len(tokenizer)), tokenizer=tokenizer, dataset=data, recipe=str(recipe),
                    output_dir=str(out), max_seq_length=48, num_calibration_samples=8)  # fmt: skip
    ids = torch.tensor([tokenizer(_text(20, 99))["input_ids"]])
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    # (a) plain transformers load; NVFP4 W4A4 in bfloat16, the only dtype compressed-tensors runs it in, and
    # compared with the calibrated model in bfloat16 (fp4 activations round differently in another dtype)
    dtype = {"dtype": torch.bfloat16} if runs_only_in_bfloat16(block) else {}
    model = as_bfloat16(model) if dtype else model
    with torch.no_grad(), quantized_inputs(model, *_schemes(recipe, model, out)):
        ref = model(ids).logits.float()
    loaded = AutoModelForCausalLM.from_pretrained(out, **dtype).eval()
    if "transform_config" in block:  # QuIP: transformers 5.24 leaves the online rotations to the loader
        apply_online_transforms(loaded, block, out)
    with torch.no_grad():
        got = loaded(ids).logits.float()
    if dtype:
        assert_logits_equal(got, ref)
    elif block["format"] == "nvfp4-pack-quantized":
        # compressed-tensors 0.20 decompresses NVFP4 weights to bfloat16 (value * scale / global_scale rounded),
        # so a float32 reload holds the calibrated weights to bf16 precision, not exactly
        torch.testing.assert_close(got, ref, rtol=0, atol=0.02 * ref.abs().max().item())
    else:
        assert_logits_equal(got, ref)  # (c) the calibrated model, not an approximation

    text = tmp_path / "eval.txt"
    text.write_text(_text(200, 7))
    src = str(Path(__file__).parent.parent / "src")
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    cmd = [sys.executable, "-m", "seqcal.cli", "eval", "ppl", "--model", str(out), "--dataset", str(text),
           "--eval-seq-length", "32"]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]  # (b) seqcal's own evaluation loads it
    assert "perplexity on" in result.stdout
    # fp4 activations: evaluated in bfloat16 (asked float32), the only dtype transformers runs them in; said so
    assert ("runs in bfloat16 only; loading it in bfloat16" in result.stderr) is bool(dtype), result.stderr[
        -2000:
    ]


def test_eval_loader_reads_asymmetric_checkpoints_without_the_hint(tmp_path: Path) -> None:
    # Checkpoints written before quantization_config carried `dequantize: true` still load for evaluation.
    from save_helpers import IDS, SCHEMES, reference_logits, rtn, tiny_llama
    from seqcal.checkpoint.writer import save_checkpoint
    from seqcal.evaluation.loading import load_causal_lm

    model = tiny_llama()
    state = rtn(model, SCHEMES["w4a16_asym"])
    save_checkpoint(model, state, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]["dequantize"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        assert_logits_equal(
            load_causal_lm(tmp_path, torch.float32)(IDS).logits, reference_logits(model, state)
        )
