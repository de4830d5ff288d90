"""Recipe patterns match modules by their in-memory or their checkpoint names (transformers 5 renames some at
load, e.g. Mixtral's ``block_sparse_moe`` becomes ``mlp``); an ignore entry that matches nothing is a warning in
the log and the run's report, a target that matches nothing stays an error."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from save_helpers import checkpoint_tensors
from seqcal.entrypoint import oneshot
from seqcal.mappings import explicit_mappings
from seqcal.mappings.names import checkpoint_names
from seqcal.modifiers import GPTQModifier, QuantizationModifier, SmoothQuantModifier
from test_oneshot import tiny_llama, token_data


def tiny_mixtral() -> MixtralForCausalLM:
    """One Mixtral layer with 4 experts: the router is ``mlp.gate`` in memory, ``block_sparse_moe.gate`` on disk."""
    config = MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MixtralForCausalLM(config).eval()


def test_checkpoint_names_come_from_transformers_conversion_mapping() -> None:
    names = checkpoint_names(tiny_mixtral())
    assert names["model.layers.0.mlp.gate"] == "model.layers.0.block_sparse_moe.gate"
    assert names["model.layers.0.mlp"] == "model.layers.0.block_sparse_moe"
    assert "model.layers.0.self_attn.q_proj" not in names  # same name in both: not listed
    assert checkpoint_names(tiny_llama()) == {}


def test_llmc_mixtral_example_runs_and_leaves_the_router_unquantized(tmp_path: Path, caplog) -> None:
    """llm-compressor's Mixtral example: FP8, ignore lm_head and the router by its checkpoint name."""
    model = tiny_mixtral()
    router = model.model.layers[0].mlp.gate.weight.detach().clone()
    recipe = QuantizationModifier(
        scheme="FP8", targets="Linear", ignore=["lm_head", "re:.*block_sparse_moe.gate"]
    )
    with caplog.at_level(logging.WARNING, logger="seqcal"):
        oneshot(model=model, dataset=token_data(4, 12), recipe=recipe, output_dir=str(tmp_path / "out"),
                max_seq_length=12)  # fmt: skip
    assert "matches no module" not in caplog.text  # the checkpoint name matched the router
    report = json.loads((tmp_path / "out" / "quantization_report.json").read_text())
    assert not any("block_sparse_moe.gate" in line for line in report["log"])
    tensors = checkpoint_tensors(tmp_path / "out")
    assert torch.equal(tensors["model.layers.0.block_sparse_moe.gate.weight"], router)
    assert "model.layers.0.block_sparse_moe.gate.weight_scale" not in tensors
    assert tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.0.self_attn.q_proj.input_scale" in tensors
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.block_sparse_moe.gate" in ignore and "lm_head" in ignore


def test_targets_and_ignore_take_either_name() -> None:
    from seqcal.experts import linearize_experts

    model = tiny_mixtral()
    linearize_experts(model)  # the experts as Linears: mlp.experts.{i}.w1 / w3 / w2
    by_disk = GPTQModifier(scheme="W8A8", targets=["re:.*block_sparse_moe.experts.*"])
    by_disk.validate(model)
    assert sorted(by_disk.modules) == sorted(
        f"model.layers.0.mlp.experts.{i}.{w}" for i in range(4) for w in ("w1", "w2", "w3")
    )
    by_memory = GPTQModifier(scheme="W8A8", ignore=["lm_head", "re:.*mlp.experts.*"])
    by_memory.validate(model)
    assert sorted(by_memory.modules) == sorted(f"model.layers.0.self_attn.{p}_proj" for p in "qkvo")


def test_mappings_take_checkpoint_names() -> None:
    from seqcal.experts import linearize_experts

    model = tiny_mixtral()
    linearize_experts(model)
    balance = ["re:.*block_sparse_moe.experts.0.w1", "re:.*block_sparse_moe.experts.0.w3"]
    (mapping,) = explicit_mappings(model, [[balance, "re:.*post_attention_layernorm"]], "m")
    assert mapping.consumers == ("model.layers.0.mlp.experts.0.w1", "model.layers.0.mlp.experts.0.w3")
    ignore = ["re:.*post_attention_layernorm", "re:.*block_sparse_moe.experts.0.w[13]", "re:.*vision.*"]
    kept = SmoothQuantModifier(mappings=[[balance, "re:.*post_attention_layernorm"]], ignore=ignore)
    kept.validate(model)
    assert kept.resolved == []  # producer and both consumers ignored (the consumers by checkpoint name)
    (line,) = kept.warnings
    assert "ignore entry 're:.*vision.*' matches no module of MixtralForCausalLM" in line


def test_an_ignore_entry_that_matches_nothing_is_a_warning_in_the_report(tmp_path: Path) -> None:
    recipe = QuantizationModifier(scheme="W8A16", ignore=["lm_head", "re:.*vision_tower.*"])
    oneshot(model=tiny_llama(), dataset=token_data(2, 8), recipe=recipe, output_dir=str(tmp_path / "out"))
    (line,) = json.loads((tmp_path / "out" / "quantization_report.json").read_text())["log"]
    assert "ignore entry 're:.*vision_tower.*' matches no module of LlamaForCausalLM" in line


def test_a_target_that_matches_nothing_is_still_an_error() -> None:
    with pytest.raises(
        ValueError, match=r"targets entry 're:.*block_sparse_moe.experts.*' matches no module"
    ):
        GPTQModifier(scheme="W4A16", targets=["re:.*block_sparse_moe.experts.*"]).validate(tiny_llama())
