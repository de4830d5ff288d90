"""Gemma 2 and Gemma 3 (text) as GGUF: llama.cpp's conventions (norms plus one, soft-capping, sliding windows, the
sliding layers' rotary base) in the file, the file reloaded by transformers' GGUF loader with seqcal's weights and
logits, and what llama.cpp would compute differently refused before calibration."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    PreTrainedTokenizerFast,
)

import seqcal.entrypoint
from seqcal import oneshot
from seqcal.gguf.families import add_hparams, family_of
from seqcal.gguf.vocab import space_prefix
from seqcal.modifiers import QuantizationModifier
from tokenizer_helpers import FOX_TEXTS, fox_tokenizer

TEXTS = FOX_TEXTS


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return fox_tokenizer()


def _gemma(kind: str, vocab: int, **overrides) -> torch.nn.Module:
    """The family's own layer pattern with one full-attention layer (Gemma 2: the 2nd, Gemma 3: the 6th); head size
    256 as real Gemmas (the attention scale llama.cpp assumes, and the one transformers' loader keeps)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_attention_heads=2,
                 num_hidden_layers={"gemma2": 2, "gemma3": 6}[kind], num_key_value_heads=1, head_dim=256,
                 bos_token_id=2, eos_token_id=1, pad_token_id=0)  # fmt: skip
    shape.update(overrides)
    config, cls = {
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    }[kind]
    model = cls(config(**shape)).eval()
    with torch.no_grad():  # norms away from 0, so that a norm stored without its + 1 shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    return model


def _fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}


@pytest.mark.parametrize(("kind", "scheme"), [("gemma2", "Q8_0"), ("gemma3", "Q4_K_M")])
def test_gemma_reloads_in_transformers_with_seqcals_weights(
    tmp_path: Path, tokenizer, kind: str, scheme: str
) -> None:
    model = _gemma(kind, len(tokenizer))
    norm = model.model.layers[0].post_feedforward_layernorm.weight.detach().clone()
    quantized = oneshot(model=model, tokenizer=tokenizer, dataset=TEXTS, recipe=QuantizationModifier(scheme=scheme,
                        ignore=["lm_head"]), num_calibration_samples=4, max_seq_length=16, output_dir=str(tmp_path),
                        output_format="gguf")  # fmt: skip
    path = tmp_path / "model.gguf"
    fields, tensors = _fields(path), {t.name: t for t in gguf.GGUFReader(path).tensors}
    arch = fields["general.architecture"]
    assert arch == kind and "output.weight" not in tensors  # tied: llama.cpp reads token_embd
    stored = torch.from_numpy(tensors["blk.0.post_ffw_norm.weight"].data.copy())
    assert torch.equal(stored, norm + 1)  # llama.cpp multiplies by the weight; Gemma by 1 + weight
    assert fields[f"{arch}.attention.sliding_window"] == 4096
    assert f"{arch}.attention.sliding_window_pattern" not in fields  # llama.cpp's own pattern is the model's
    if kind == "gemma2":
        assert (
            fields["gemma2.attn_logit_softcapping"] == 50.0
            and fields["gemma2.final_logit_softcapping"] == 30.0
        )
    else:
        assert fields["gemma3.rope.freq_base"] == 1e6 and fields["gemma3.rope.freq_base_swa"] == 1e4
        assert "gemma3.attn_logit_softcapping" not in fields
        assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q4_K"
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf", dtype=torch.float32
    ).eval()
    ours, theirs = quantized.state_dict(), loaded.state_dict()
    for name, module in quantized.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            assert torch.equal(theirs[f"{name}.weight"], ours[f"{name}.weight"]), name
    torch.testing.assert_close(
        theirs["model.layers.0.post_feedforward_layernorm.weight"], norm, rtol=0, atol=1e-7
    )
    # the tied embedding rounded by llama.cpp's rule: with it, the same logits
    quantized.model.embed_tokens.weight.data = loaded.model.embed_tokens.weight.data.clone()
    ids = tokenizer(TEXTS[3], return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, quantized(ids).logits, rtol=1e-4, atol=1e-4)


def test_layer_pattern_other_than_llama_cpps_is_written_per_layer(tmp_path: Path) -> None:
    """transformers' loader does not read this key (it keeps its own default pattern); llama.cpp does."""
    config = Gemma3TextConfig(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1e6}})  # fmt: skip
    writer = gguf.GGUFWriter(tmp_path / "meta.gguf", family_of(config).arch)
    add_hparams(writer, config, "tiny")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    fields = _fields(tmp_path / "meta.gguf")
    assert fields["gemma3.attention.sliding_window_pattern"] == [True, False, True]
    assert fields["gemma3.rope.scaling.type"] == "linear" and fields["gemma3.rope.scaling.factor"] == 8.0
    assert fields["gemma3.rope.freq_base"] == 1e6 and fields["gemma3.rope.freq_base_swa"] == 1e4


@pytest.mark.parametrize(("kind", "overrides", "match"), [
    ("gemma2", {"query_pre_attn_scalar": 144}, "query_pre_attn_scalar 144 .*1/sqrt\\(256\\)"),
    ("gemma2", {"final_logit_softcapping": None}, "llama.cpp's Gemma 2 always has them"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "llama.cpp's Gemma 3 has none"),
])  # fmt: skip
def test_what_llama_cpp_computes_otherwise_is_refused(
    tmp_path, monkeypatch, tokenizer, kind, overrides, match
) -> None:
    def never(*args, **kwargs):
        raise AssertionError("calibration started")

    monkeypatch.setattr(seqcal.entrypoint, "run_pipeline", never)
    with pytest.raises(ValueError, match=match):
        oneshot(model=_gemma(kind, len(tokenizer), **overrides), tokenizer=tokenizer, dataset=TEXTS,
                recipe=QuantizationModifier(scheme="Q8_0", ignore=["lm_head"]), num_calibration_samples=4,
                max_seq_length=16, output_dir=str(tmp_path), output_format="gguf")  # fmt: skip


def test_space_prefix_follows_the_tokenizers_normalizer() -> None:
    """llama.cpp puts a space before the text of a SentencePiece-style vocabulary unless the file says not to:
    Llama 2 and Mistral prepend "\u2581", Gemma only replaces spaces."""
    llama2 = {"normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                                 {"type": "Replace"}]}}  # fmt: skip
    gemma = {"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}}
    metaspace = {"pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"}}
    assert space_prefix(llama2) and space_prefix(metaspace) and not space_prefix(gemma)
