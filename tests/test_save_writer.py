"""Tests for seqcal.checkpoint.writer's writer: the checkpoint directory, shards and index, tied weights, extras, the
streaming ``CheckpointWriter`` and key layouts that match ``save_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from save_helpers import (
    IDS,
    SCHEMES,
    assert_logits_equal,
    checkpoint_tensors,
    reference_logits,
    reload,
    rtn,
    rtn_lm_head,
    tiny_llama,
)
from seqcal.checkpoint.writer import (
    CheckpointWriter,
    ModelLayout,
    checkpoint_config,
    save_checkpoint,
    write_extras,
)
from seqcal.modifiers.base import RunState
from seqcal.modifiers.state import RunResults
from zoo import ARCHS


def test_refuses_non_empty_dir_and_overwrites_cleanly(tmp_path: Path) -> None:
    model = tiny_llama()
    state = rtn(model, SCHEMES["w4a16_g16"])
    (tmp_path / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_checkpoint(model, state, tmp_path)
    save_checkpoint(model, state, tmp_path, overwrite=True, max_shard_size=8192)
    assert (tmp_path / "model.safetensors.index.json").exists()
    save_checkpoint(model, state, tmp_path, overwrite=True)  # one file now: stale shards and index must go
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "notes.txt"]


def test_sharding_and_index(tmp_path: Path) -> None:
    model = tiny_llama()
    state = rtn(model, SCHEMES["w8a8"])
    ref = reference_logits(model, state)
    max_shard = 10_000
    save_checkpoint(model, state, tmp_path, max_shard_size=max_shard)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 3 and not list(tmp_path.glob("*.partial"))
    assert {p.name for p in shards} == set(index["weight_map"].values())
    assert all(p.name.endswith(f"-of-{len(shards):05d}.safetensors") for p in shards)
    total, seen = 0, set()
    for path in shards:
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            assert f.metadata() == {"format": "pt"}
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys]
        assert all(index["weight_map"][k] == path.name for k in keys)
        assert sum(sizes) <= max_shard or len(keys) == 1  # only a single oversized tensor may exceed
        total, seen = total + sum(sizes), seen | keys
    assert seen == set(index["weight_map"]) and index["metadata"]["total_size"] == total
    expected = set(model.state_dict()) - {f"{n}.weight" for n in state.results.quantized}
    expected |= {f"{n}.{k}" for n in state.results.quantized for k in ("weight", "weight_scale")}
    assert seen == expected
    with torch.no_grad():
        assert_logits_equal(reload(tmp_path)(IDS).logits, ref)


def test_tied_embeddings_written_once(tmp_path: Path) -> None:
    model = tiny_llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    state = rtn(model, SCHEMES["w4a16_g16"])
    ref = reference_logits(model, state)
    save_checkpoint(model, state, tmp_path)
    keys = checkpoint_tensors(tmp_path)
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["quantization_config"]["ignore"] == ["lm_head"]
    loaded = reload(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with torch.no_grad():
        assert_logits_equal(loaded(IDS).logits, ref)


def test_quantized_tied_lm_head_is_refused(tmp_path: Path) -> None:
    model = tiny_llama(tie=True)
    state = RunState(results=RunResults(quantized={"lm_head": rtn_lm_head(model)}))
    with pytest.raises(ValueError, match="tied"):
        save_checkpoint(model, state, tmp_path)


def test_extras_and_config(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    model = tiny_llama()
    state = rtn(model, SCHEMES["w4a16_g16"])
    before = model.config.to_dict()
    save_checkpoint(model, state, tmp_path, tokenizer=tokenizer, recipe_yaml="quant_stage: {}\n")
    assert model.config.to_dict() == before  # the model's config is not modified
    assert (tmp_path / "recipe.yaml").read_text() == "quant_stage: {}\n"
    assert (tmp_path / "tokenizer.json").exists() and (tmp_path / "generation_config.json").exists()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"


def test_streaming_writer_in_any_module_order(tmp_path: Path) -> None:
    """The executor's path: modules added as subgraphs finish (here: last layer first), config at the end."""
    model = tiny_llama(tie=True)
    state = rtn(model, SCHEMES["w8a8"])
    ref = reference_logits(model, state)
    layout = ModelLayout.from_model(model)
    writer = CheckpointWriter(tmp_path, max_shard_size=20_000, layout=layout)
    for name, module in reversed(list(model.named_modules())):
        writer.add_module(name, module, state.results.quantized.get(name))
    write_extras(tmp_path, model, recipe_yaml="x: 1\n")
    writer.close(checkpoint_config(model, state, layout))
    assert (tmp_path / "recipe.yaml").exists() and (tmp_path / "model.safetensors.index.json").exists()
    with torch.no_grad():
        assert_logits_equal(reload(tmp_path)(IDS).logits, ref)
    with pytest.raises(ValueError, match="tied"):  # the writer refuses a quantized tied weight by itself
        CheckpointWriter(tmp_path / "b", layout=layout).add_module(
            "lm_head", model.lm_head, rtn_lm_head(model)
        )


def test_writer_rules(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path / "ckpt", max_shard_size=64)
    writer.add_tensor("a", torch.zeros(4))
    with pytest.raises(ValueError, match="already added"):
        writer.add_tensor("a", torch.zeros(4))
    with pytest.raises(ValueError, match="meta"):
        writer.add_tensor("b", torch.empty(4, device="meta"))
    source = torch.ones(32)  # 128 bytes > max_shard_size: a shard of its own
    writer.add_tensor("big", source)
    source.zero_()  # the writer took a copy
    assert not (tmp_path / "ckpt" / "config.json").exists()
    writer.close({"model_type": "none"})
    tensors = checkpoint_tensors(tmp_path / "ckpt")
    assert torch.equal(tensors["big"], torch.ones(32)) and sorted(tensors) == ["a", "big"]
    with pytest.raises(RuntimeError, match="after close"):
        writer.add_tensor("c", torch.zeros(1))
    with pytest.raises(ValueError, match="max_shard_size"):
        CheckpointWriter(tmp_path / "other", max_shard_size=0)


@pytest.mark.parametrize("arch", ["gemma", "gpt_neox", "qwen3_moe", "llava"])
def test_layout_matches_save_pretrained(arch: str, tmp_path: Path) -> None:
    """Tied weights and weight conversions (fused experts, renamed prefixes) give save_pretrained's keys."""
    model = ARCHS[arch].build()
    model.save_pretrained(tmp_path / "hf")
    writer = CheckpointWriter(tmp_path / "ours", layout=ModelLayout.from_model(model))
    for name, module in model.named_modules():
        writer.add_module(name, module, None)
    writer.close({})
    ours, theirs = checkpoint_tensors(tmp_path / "ours"), checkpoint_tensors(tmp_path / "hf")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_full_headers_start_new_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shard's header room is reserved up front; when it is full the next tensor opens a new shard."""
    from seqcal.checkpoint import writer as save

    monkeypatch.setattr(save._ShardFile.__init__, "__defaults__", (400,))  # bytes of header room per shard
    tensors = {
        f"model.layers.{i}.some_rather_long_module_name.weight": torch.randn(3, i + 1) for i in range(12)
    }
    writer = CheckpointWriter(tmp_path)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.close({"architectures": ["X"]})
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2  # by header room alone: the bytes would fit one shard
    for shard in shards:
        raw = shard.read_bytes()
        assert int.from_bytes(raw[:8], "little") == 400 and raw[8:408].rstrip(b" ").endswith(b"}")
    loaded = checkpoint_tensors(tmp_path)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="does not fit a shard header"):
        CheckpointWriter(tmp_path / "b").add_tensor("x" * 500, torch.zeros(1))
