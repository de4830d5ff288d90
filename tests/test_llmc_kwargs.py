"""llm-compressor's oneshot keywords: each is seqcal's own, an alias, a logged no-op, or a precise error.

The keyword list is llm-compressor 0.14's ``oneshot`` as its API reference documents it
(https://docs.vllm.ai/projects/llm-compressor/en/stable/api/llmcompressor/entrypoints/oneshot/ and the
ModelArguments / DatasetArguments / RecipeArguments pages under .../api/llmcompressor/args/), with the defaults
documented there, plus keywords of earlier releases that scripts still pass.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import seqcal.entrypoint
from seqcal.entrypoint import oneshot
from seqcal.recipe.llmc_compat import ALIASES, RULES, VALUE_ALIASES

RECIPE = "GPTQModifier: {scheme: W4A16, ignore: [lm_head]}"
# llm-compressor 0.14 oneshot: keyword -> its documented default (model and recipe are given by every call).
LLMC_0_14_DEFAULTS: dict[str, Any] = {
    # ModelArguments
    "config_name": None, "tokenizer": None, "processor": None, "precision": "auto", "tie_word_embeddings": True,
    "trust_remote_code_model": False, "save_compressed": True, "model_revision": "main",
    # RecipeArguments
    "recipe_args": None, "clear_sparse_session": False, "stage": None,
    # DatasetArguments
    "dataset_config_name": None, "dataset_path": None, "splits": None, "batch_size": 1,
    "data_collator": "truncation", "num_calibration_samples": 512, "shuffle_calibration_samples": True,
    "max_seq_length": None, "pad_to_max_length": False, "text_column": "text", "concatenate_data": False,
    "streaming": False, "overwrite_cache": False, "preprocessing_num_workers": None, "dataloader_num_workers": 0,
    "min_tokens_per_module": None, "moe_calibrate_all_experts": True, "pipeline": "independent",
    "tracing_ignore": ["_update_causal_mask", "create_causal_mask", "make_causal_mask", "get_causal_mask",
                       "mask_interface", "mask_function", "_prepare_4d_causal_attention_mask"],
    "sequential_targets": None, "sequential_offload_device": "cpu", "quantization_aware_calibration": True,
    "sequential_prefetch": False,
    # DatasetArguments fields that oneshot takes through **kwargs
    "dvc_data_repository": None, "remove_columns": None, "preprocessing_func": None, "raw_kwargs": {},
    "sequential_targets_per_subgraph": 1, "propagate_error": True, "use_loss_mask": False,
    # miscellaneous
    "output_dir": None, "log_dir": None,
}  # fmt: skip
# Keywords of earlier releases (ModelArguments.use_auth_token, oneshot_device, calibrate_moe_context, ...).
LLMC_EARLIER_DEFAULTS: dict[str, Any] = {
    "use_auth_token": False, "oneshot_device": "cuda:0", "calibrate_moe_context": False, "distill_teacher": None,
}  # fmt: skip
# Defaults seqcal cannot take as they are, and why.
REFUSED_DEFAULTS = {"max_seq_length"}  # llm-compressor's None (the model's maximum); seqcal needs a number
# A value each refusing rule cannot honour.
UNSUPPORTED_VALUES: dict[str, Any] = {
    "save_compressed": False, "tie_word_embeddings": False, "config_name": "other/config",
    "distill_teacher": "teacher", "recipe_args": ["x=1"], "stage": "quant_stage", "pad_to_max_length": True,
    "streaming": True, "raw_kwargs": {"cache": 1},
    "dvc_data_repository": "dvc://x", "sequential_targets_per_subgraph": 2,
    "propagate_error": False, "use_loss_mask": True,
}  # fmt: skip


class Reached(Exception):
    """Raised by the stubbed pipeline: the arguments were accepted."""


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Stub out loading and calibration; record what oneshot hands them."""
    record: dict[str, Any] = {}

    def load(args, offload_weights=False, host_budget=None):
        record["model_args"] = args
        return args.model, args.tokenizer, None

    def run(model, tokenizer, modifiers, data_args, pipe_args, *rest):
        record.update(tokenizer=tokenizer, data_args=data_args, pipe_args=pipe_args)
        raise Reached

    monkeypatch.setattr(seqcal.entrypoint, "load_model", load)
    monkeypatch.setattr(seqcal.entrypoint, "run_pipeline", run)
    return record


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _call(**kwargs: Any) -> None:
    base = {"model": tiny_llama(), "recipe": RECIPE, "dataset": [{"input_ids": list(range(16))}] * 2}
    oneshot(**{**base, **kwargs})


def test_every_llmc_keyword_is_known_to_seqcal() -> None:
    own = {n for n, p in inspect.signature(oneshot).parameters.items() if p.kind is not p.VAR_KEYWORD}
    for name in [*LLMC_0_14_DEFAULTS, *LLMC_EARLIER_DEFAULTS]:
        assert (name in own) + (name in ALIASES) + (name in RULES) == 1, name
    assert set(ALIASES.values()) <= own and set(VALUE_ALIASES) <= own


@pytest.mark.parametrize("name", [*LLMC_0_14_DEFAULTS, *LLMC_EARLIER_DEFAULTS])
def test_llmc_default_values_are_accepted_or_refused_by_name(name: str, seen, caplog) -> None:
    value = {**LLMC_0_14_DEFAULTS, **LLMC_EARLIER_DEFAULTS}[name]
    caplog.set_level(logging.INFO, logger="seqcal")
    if name in REFUSED_DEFAULTS:
        with pytest.raises((TypeError, ValueError), match=name) as info:
            _call(**{name: value})
        assert "unknown argument" not in str(info.value)
        return
    with pytest.raises(Reached):
        _call(**{name: value})
    if name in RULES:  # a no-op: the log says so, and why
        assert f"oneshot({name}={value!r}) changes nothing: {RULES[name].note}" in caplog.text


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_VALUES))
def test_values_seqcal_cannot_honour_are_refused_with_the_reason(name: str, seen) -> None:
    value = UNSUPPORTED_VALUES[name]
    with pytest.raises(TypeError) as info:
        _call(**{name: value})
    message = str(info.value)
    assert message.startswith(f"oneshot(): {name}=") and "is not supported" in message
    assert RULES[name].refusal in message and "unknown argument" not in message
    assert "data_args" not in seen  # refused before any work


def test_refusing_rules_all_have_an_unsupported_value_in_this_test() -> None:
    assert {n for n, r in RULES.items() if r.accepts is not None} == set(UNSUPPORTED_VALUES)


def test_aliases_reach_seqcals_parameters(seen, tmp_path: Path) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text("text")
    tok = object()
    with pytest.raises(Reached):
        _call(dataset=None, dataset_path=str(calib), concatenate_data=True, processor=tok, precision="float32",
              trust_remote_code_model=True, model_revision="v2", dataset_config_name="raw", pipeline="independent",
              save_compressed=True, sequential_offload_device="cpu")  # fmt: skip
    model_args, data_args = seen["model_args"], seen["data_args"]
    assert (model_args.tokenizer, model_args.dtype, model_args.trust_remote_code) == (tok, "float32", True)
    assert model_args.revision == "v2" and seen["tokenizer"] is tok
    assert (data_args.dataset, data_args.concatenate, data_args.dataset_config_name) == (
        str(calib),
        True,
        "raw",
    )
    assert seen["pipe_args"].pipeline == "sequential"


def test_llmcs_offload_device_is_seqcals_cache_tier(seen) -> None:
    """``sequential_offload_device`` names where the activations wait: seqcal's ``offload`` (a device object too)."""
    with pytest.raises(Reached):
        _call(sequential_offload_device=torch.device("cpu"))
    assert seen["pipe_args"].offload == "cpu"
    with pytest.raises(Reached):
        _call(sequential_offload_device="device")
    assert seen["pipe_args"].offload == "device"
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match=r"offload='cuda:1': the activation cache's device is not there"):
            _call(sequential_offload_device="cuda:1")
    with pytest.raises(ValueError, match="'gpu' is not a tier of the activation cache"):
        _call(sequential_offload_device="gpu")


def test_an_alias_and_seqcals_name_together_must_agree(seen) -> None:
    with pytest.raises(TypeError, match=r"processor='b' is llm-compressor's name for tokenizer, which is also "
                                        r"given \(tokenizer='a'\); pass only one"):  # fmt: skip
        _call(tokenizer="a", processor="b")
    with pytest.raises(TypeError, match=r"dataset_path='b.txt' is llm-compressor's name for dataset"):
        _call(dataset_path="b.txt")
    with pytest.raises(Reached):  # the same value twice, or llm-compressor's default beside seqcal's value
        _call(concatenate=True, concatenate_data=True, precision="auto", dtype="float32")
    assert seen["data_args"].concatenate and seen["model_args"].dtype == "float32"


def test_a_keyword_neither_knows_is_an_error_with_a_close_name(seen) -> None:
    with pytest.raises(
        TypeError, match=r"unknown argument\(s\): concatenate_dta \(did you mean 'concatenate_data'\?\)"
    ):
        _call(concatenate_dta=True)
    with pytest.raises(TypeError, match=r"unknown argument\(s\): frobnicate; valid arguments: model, "):
        _call(frobnicate=1)


def test_llmc_keywords_run_end_to_end(tmp_path: Path, caplog) -> None:
    """A typical llm-compressor call, unchanged but for the import, calibrates and saves."""
    caplog.set_level(logging.WARNING, logger="seqcal")
    torch.manual_seed(0)
    model = tiny_llama()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    oneshot(model=model, dataset=[{"input_ids": list(range(3, 35))}] * 4, recipe=RECIPE, output_dir=str(tmp_path),
            max_seq_length=32, num_calibration_samples=4, save_compressed=True, trust_remote_code_model=False,
            concatenate_data=False, pipeline="independent", moe_calibrate_all_experts=True,
            log_dir=str(tmp_path / "logs"), clear_sparse_session=True, precision="auto",
            tracing_ignore=LLMC_0_14_DEFAULTS["tracing_ignore"])  # fmt: skip
    assert (tmp_path / "model.safetensors").is_file() and not (tmp_path / "logs").exists()
    weight = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(dict(model.named_parameters())[weight], reference[weight])  # quantized
    assert f"oneshot(log_dir={str(tmp_path / 'logs')!r}) changes nothing" in caplog.text
