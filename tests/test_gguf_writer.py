"""GGUF output: a tiny model written by oneshot reloads in transformers' GGUF loader with seqcal's weights, and
what the writer cannot do is refused before calibration, one sentence each."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import seqcal.entrypoint
from seqcal import oneshot
from seqcal.cli import build_parser
from seqcal.modifiers import GPTQModifier, QuantizationModifier
from tokenizer_helpers import FOX_TEXTS, fox_tokenizer

TEXTS = FOX_TEXTS


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return fox_tokenizer()


def _model(kind: str, vocab: int, tied: bool = False) -> torch.nn.Module:
    shape = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2 if kind == "llama" else 1,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, bos_token_id=2,
                 eos_token_id=1, pad_token_id=0)  # fmt: skip
    config, cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                   "phi3": (Phi3Config, Phi3ForCausalLM), "gemma": (GemmaConfig, GemmaForCausalLM)}[kind]  # fmt: skip
    return cls(config(**shape)).eval()


@pytest.mark.parametrize(("kind", "recipe"), [
    ("llama", QuantizationModifier(scheme="Q4_K_M", ignore=["lm_head"])),
    ("qwen2", GPTQModifier(scheme="Q4_0", ignore=["lm_head"])),
    ("phi3", QuantizationModifier(scheme="Q8_0", ignore=["lm_head"])),  # fused qkv_proj / gate_up_proj
])  # fmt: skip
def test_gguf_reloads_in_transformers_with_seqcals_weights(
    tmp_path: Path, tokenizer, kind: str, recipe
) -> None:
    model = _model(kind, len(tokenizer))
    quantized = oneshot(model=model, tokenizer=tokenizer, dataset=TEXTS, recipe=recipe, num_calibration_samples=4,
                        max_seq_length=16, output_dir=str(tmp_path), output_format="gguf")  # fmt: skip
    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    if kind == "llama":  # Q4_K_M: v_proj of the last layer (use_more_bits) in Q6_K, output in Q6_K
        assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.1.attn_v.weight"] == "Q6_K"
        assert types["output.weight"] == "Q6_K" and types["blk.0.attn_norm.weight"] == "F32"
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf", dtype=torch.float32
    ).eval()
    ours, theirs = quantized.state_dict(), loaded.state_dict()
    linears = [
        n for n, m in quantized.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    ]
    for name in linears:  # q_proj / k_proj un-permuted by transformers' loader, bit for bit
        assert torch.equal(theirs[f"{name}.weight"], ours[f"{name}.weight"]), name
    # token embedding and output rounded by llama.cpp's rule: with those, the same logits
    quantized.model.embed_tokens.weight.data = loaded.model.embed_tokens.weight.data.clone()
    quantized.lm_head.weight.data = loaded.lm_head.weight.data.clone()
    ids = tokenizer(TEXTS[3], return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, quantized(ids).logits, rtol=1e-4, atol=1e-4)
    reread = AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf")
    assert reread(TEXTS[5]).input_ids == tokenizer(TEXTS[5]).input_ids
    assert (tmp_path / "recipe.yaml").is_file() and not (tmp_path / "model.gguf.data.partial").exists()


def _refused(tmp_path: Path, monkeypatch, tokenizer, model, recipe, match: str, **kw) -> None:
    def never(*args, **kwargs):
        raise AssertionError("calibration started")

    monkeypatch.setattr(seqcal.entrypoint, "run_pipeline", never)
    with pytest.raises(ValueError, match=match):
        oneshot(model=model, tokenizer=tokenizer, dataset=TEXTS, recipe=recipe, num_calibration_samples=4,
                max_seq_length=16, output_dir=str(tmp_path / "out"), **kw)  # fmt: skip


def test_family_the_writer_does_not_know_is_refused(tmp_path, monkeypatch, tokenizer) -> None:
    model = _model("gemma", len(tokenizer))
    recipe = QuantizationModifier(scheme="Q4_0", ignore=["lm_head"])
    _refused(tmp_path, monkeypatch, tokenizer, model, recipe, "writes the gemma2, gemma3_text, llama, "
             "mistral, phi3, qwen2, qwen3 families, not 'gemma'", output_format="gguf")  # fmt: skip


def test_output_dir_with_a_safetensors_checkpoint_is_refused(tmp_path, monkeypatch, tokenizer) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"")
    recipe = QuantizationModifier(scheme="Q4_0", ignore=["lm_head"])
    _refused(tmp_path, monkeypatch, tokenizer, _model("llama", len(tokenizer)), recipe,
             "holds a safetensors checkpoint", output_format="gguf", overwrite=True)  # fmt: skip


def test_gguf_scheme_needs_gguf_output_and_tied_head_is_ignored(tmp_path, monkeypatch, tokenizer) -> None:
    model = _model("llama", len(tokenizer), tied=True)
    _refused(tmp_path, monkeypatch, tokenizer, model, QuantizationModifier(scheme="Q4_K", ignore=["lm_head"]),
             "GGUF format.*output_format='gguf'")  # fmt: skip
    _refused(tmp_path, monkeypatch, tokenizer, model, QuantizationModifier(scheme="Q8_0"),
             "lm_head is tied to the token embedding.*ignore", output_format="gguf")  # fmt: skip
    _refused(tmp_path, monkeypatch, tokenizer, model, QuantizationModifier(scheme="W4A16", ignore=["lm_head"]),
             "llama.cpp cannot read; use a GGUF scheme", output_format="gguf")  # fmt: skip


def test_command_line_takes_the_format() -> None:
    args = build_parser().parse_args(["oneshot", "--model", "m", "--recipe", "r", "--output-dir", "o",
                                      "--output-format", "gguf"])  # fmt: skip
    assert args.output_format == "gguf"
