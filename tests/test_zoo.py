"""Checks that every zoo entry builds, runs eagerly, and calls its sequential targets as declared."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from zoo import ARCHS, FAMILIES, TOKEN_HIGH, TOKEN_LOW, VOCAB, ArchSpec, left_pad_mask

REQUIRED = set(
    "llama mistral qwen2 qwen3 gemma gemma2 gemma3_text phi phi3 gpt2 gpt_neox gptj falcon opt bloom "
    "starcoder2 olmo olmo2 cohere granite stablelm codegen mixtral qwen2_moe qwen3_moe deepseek_v3 olmoe "
    "granitemoe bert roberta modernbert t5 bart whisper llava qwen2_vl qwen2_5_vl gemma3 mllama "
    "idefics3 openai-gpt xlnet reformer xlstm roc_bert got_ocr2 phi4_multimodal mllama_text".split()
)
# Configs whose sliding window is shorter than the test sequences (9 and 12 tokens).
SLIDING = "mistral qwen2 qwen3 gemma2 gemma3_text phi3 starcoder2 mixtral gpt_oss gemma3 modernbert".split()
# Models that read the pad id itself, not only the attention mask.
PAD_ID_SENSITIVE = {
    "roberta": "position ids count the ids that differ from pad_token_id",
    "blt": "its hashed byte n-gram embeddings and entropy patches read the padding bytes",
    "xlstm": "a recurrent model without an attention mask: the pad tokens run through its state",
}
CASES = ({"batch": 1, "seq_len": 12}, {"batch": 2, "seq_len": 9, "left_pad": 3})
NAMES = sorted(ARCHS)


def _ids_and_mask_keys(inputs: dict[str, Any]) -> tuple[str, str]:
    if "input_ids" in inputs:
        return "input_ids", "attention_mask"
    return "decoder_input_ids", "decoder_attention_mask"  # whisper: audio in, text decoder padded


def _run_counting(model: torch.nn.Module, spec: ArchSpec, inputs: dict[str, Any]) -> tuple[Any, Counter[str]]:
    """Run ``model(**inputs)``, counting calls per target module name with forward pre-hooks."""
    classes = {spec.target_class, *spec.other_targets}
    calls: Counter[str] = Counter()
    handles = []
    try:
        for name, module in model.named_modules():
            if type(module).__name__ in classes:
                handles.append(module.register_forward_pre_hook(lambda m, a, n=name: calls.update([n])))
        with torch.no_grad():
            out = model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return out, calls


def _main_output(out: Any) -> torch.Tensor:
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def test_zoo_covers_required_architectures() -> None:
    assert len(ARCHS) >= 36
    assert REQUIRED <= set(ARCHS), f"missing: {sorted(REQUIRED - set(ARCHS))}"
    assert {spec.family for spec in ARCHS.values()} == set(FAMILIES)


def test_left_pad_mask_pads_one_row_of_two() -> None:
    assert left_pad_mask(2, 5, 3).tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    with pytest.raises(ValueError, match="left_pad"):
        left_pad_mask(3, 6, 3)


def test_archspec_rejects_unknown_family() -> None:
    spec = ARCHS["llama"]
    with pytest.raises(ValueError, match="family"):
        ArchSpec("x", "rnn", spec.build, spec.make_inputs, spec.target_class, 3)


@pytest.mark.parametrize("name", SLIDING)
def test_sliding_window_masking_is_exercised(name: str) -> None:
    """The window is shorter than the test sequences, so widening it changes the logits."""
    spec = ARCHS[name]
    model = spec.build()
    config = model.config.get_text_config()
    assert "sliding_attention" in (getattr(config, "layer_types", None) or ["sliding_attention"])
    assert config.sliding_window < min(case["seq_len"] for case in CASES)
    inputs = spec.make_inputs(model, batch=1, seq_len=12)
    with torch.no_grad():
        windowed = _main_output(model(**inputs))
        config.sliding_window = 64  # masks read the config at call time
        full = _main_output(model(**inputs))
    assert (windowed - full).abs().max() > 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_forward_shapes_and_targets(name: str) -> None:
    spec = ARCHS[name]
    model = spec.build()
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    # The default attention implementation is kept: sdpa wherever the class supports it.
    assert model.config._attn_implementation == ("sdpa" if model._supports_sdpa else "eager")
    for case in CASES:
        inputs = spec.make_inputs(model, **case)
        again = spec.make_inputs(model, **case)
        assert all(torch.equal(inputs[k], again[k]) for k in inputs), "make_inputs is not deterministic"
        ids_key, mask_key = _ids_and_mask_keys(inputs)
        ids = inputs[ids_key]
        assert ids.shape == (case["batch"], case["seq_len"])
        assert int(ids.min()) >= 0 and int(ids.max()) < VOCAB
        assert torch.equal(
            inputs[mask_key], left_pad_mask(case["batch"], case["seq_len"], case.get("left_pad", 0))
        )

        out, calls = _run_counting(model, spec, inputs)
        assert not any(m._forward_pre_hooks for m in model.modules()), "counting hooks were left behind"
        logits = _main_output(out)
        assert torch.isfinite(logits).all()
        assert logits.shape[:2] == ids.shape and logits.shape[-1] == model.config.get_text_config().vocab_size
        targets = {
            n: c for n, c in calls.items() if type(model.get_submodule(n)).__name__ == spec.target_class
        }
        assert len(targets) == spec.num_targets, f"{spec.target_class} called: {sorted(targets)}"
        assert set(calls.values()) == {1}, f"a target ran more than once: {calls}"
        for other in spec.other_targets:
            assert any(type(model.get_submodule(n)).__name__ == other for n in calls), f"{other} never ran"


@pytest.mark.parametrize("name", NAMES)
def test_padding_is_masked(name: str) -> None:
    """Changing the ids under the mask's zeros leaves every unpadded position's output unchanged."""
    if name in PAD_ID_SENSITIVE:
        pytest.skip(PAD_ID_SENSITIVE[name])
    spec = ARCHS[name]
    model = spec.build()
    inputs = spec.make_inputs(model, batch=2, seq_len=9, left_pad=3)
    ids_key, mask_key = _ids_and_mask_keys(inputs)
    mask = inputs[mask_key]
    repadded = dict(inputs)
    repadded[ids_key] = inputs[ids_key].masked_fill(mask == 0, (TOKEN_LOW + TOKEN_HIGH) // 2)
    assert not torch.equal(repadded[ids_key], inputs[ids_key])
    with torch.no_grad():
        a, b = _main_output(model(**inputs)), _main_output(model(**repadded))
    # Encoder-decoders pad the encoder, so the whole (unpadded) decoder output must match.
    seq2seq = spec.family == "encoder-decoder" and ids_key == "input_ids"
    keep = torch.ones(b.shape[:2], dtype=torch.bool) if seq2seq else mask.bool()  # [batch, seq]
    torch.testing.assert_close(a[keep], b[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [n for n in NAMES if ARCHS[n].family in ("vlm", "encoder-decoder")])
def test_non_text_inputs_reach_the_output(name: str) -> None:
    """Pixels (VLMs), audio (whisper) or encoder ids (seq2seq) must change the logits."""
    spec = ARCHS[name]
    model = spec.build()
    inputs = spec.make_inputs(model, batch=1, seq_len=12)
    key = next(
        k for k in ("pixel_values", "image_pixel_values", "input_features", "input_ids") if k in inputs
    )
    changed = dict(inputs)
    if key == "input_ids":
        changed[key] = TOKEN_LOW + (inputs[key] - TOKEN_LOW + 1) % (TOKEN_HIGH - TOKEN_LOW)  # shift every id
    else:
        changed[key] = inputs[key] + 1.0
    with torch.no_grad():
        diff = (_main_output(model(**inputs)) - _main_output(model(**changed))).abs().max()
    assert diff > 1e-4, f"{key} does not reach the output of {name}"
