"""AutoRound and AWQ calibrating on GGUF's grids: the qparams are llama.cpp's own, the codes the algorithm's; the
written model.gguf, as gguf-py dequantizes it, is exactly seqcal's fake-quantized model, and AutoRound's learned
codes give a lower output error than round to nearest on the same scales."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from seqcal import oneshot
from seqcal.algorithms import formats
from seqcal.algorithms.autoround import sign_step_
from seqcal.algorithms.autoround_grids import GridQuantizer
from seqcal.gguf.families import family_of, permutation, tensor_namer
from seqcal.gguf.grids import gguf_format
from seqcal.gguf.pack import pack
from seqcal.gguf.types import GGUF_TYPES
from seqcal.modifiers import AutoRoundModifier, AWQModifier, QuantizationModifier
from tokenizer_helpers import FOX_TEXTS, fox_tokenizer

TEXTS = FOX_TEXTS


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return fox_tokenizer()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q6_K"])
def test_learned_codes_on_the_types_scales(name: str) -> None:
    """Offsets 0 are the type's round to nearest bit for bit; after steps the scales are still llama.cpp's, and
    the value the search trains on is what gguf-py reads from the packed bytes."""
    torch.manual_seed(0)
    W, fmt = torch.randn(8, 256) * 0.02, gguf_format(name)
    gq = GridQuantizer.of(W, fmt)
    p = gq.start()
    scale, zero = formats.qparams(W, fmt)
    assert torch.equal(gq.codes(p)[0], formats.quantize(W, scale, zero, fmt))
    target = torch.randn_like(W) * 0.02 + W
    for _ in range(3):
        ((gq(p) - target) ** 2).sum().backward()
        assert p.V.grad is not None and p.V.grad.abs().sum() > 0
        sign_step_(p, 0.2)
    q, s, z = gq.codes(p)
    assert torch.equal(s, scale) and not torch.equal(q, formats.quantize(W, scale, zero, fmt))
    assert int(q.min()) >= GGUF_TYPES[name].qmin and int(q.max()) <= GGUF_TYPES[name].qmax
    read = gguf.quants.dequantize(pack(q, s, z, fmt), gguf.GGMLQuantizationType[name])
    assert torch.equal(torch.from_numpy(read), gq(p).detach())


def _llama(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=2, eos_token_id=1,
                         pad_token_id=0)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _run(tokenizer, recipe, out: Path | None) -> torch.nn.Module:
    return oneshot(model=_llama(len(tokenizer)), tokenizer=tokenizer, dataset=TEXTS, recipe=recipe,
                   num_calibration_samples=8, max_seq_length=16, output_dir=None if out is None else str(out),
                   output_format="gguf" if out is not None else "compressed-tensors")  # fmt: skip


def _file_equals_model(path: Path, model: torch.nn.Module) -> dict[str, str]:
    """Every quantized Linear of ``model`` equals its tensor in ``path`` as gguf-py dequantizes it (q/k rows put back
    in transformers' order); returns the GGUF type of each."""
    family = family_of(model.config)
    namer = tensor_namer(family, model.config)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    types = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        t = tensors[namer(f"{name}.weight")]
        read = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
        if (order := permutation(family, model.config, t.name, read.shape[0])) is not None:
            read = read[torch.from_numpy(np.argsort(order))]
        assert torch.equal(read, module.weight.detach()), name
        types[name] = t.tensor_type.name
    return types


def _output_error(model: torch.nn.Module, reference: torch.nn.Module, tokenizer) -> float:
    ids = tokenizer(TEXTS[:8], return_tensors="pt", padding=True)
    with torch.no_grad():
        return float(((model(**ids).logits - reference(**ids).logits) ** 2).mean())


def test_autoround_q4_k_m_file_is_its_model_and_beats_rtn(tmp_path: Path, tokenizer) -> None:
    recipe = AutoRoundModifier(scheme="Q4_K_M", ignore=["lm_head"], iters=20, batch_size=4, amp=False)
    learned = _run(tokenizer, recipe, tmp_path)
    types = _file_equals_model(tmp_path / "model.gguf", learned)
    assert (
        types["model.layers.0.self_attn.q_proj"] == "Q4_K" and types["model.layers.0.mlp.down_proj"] == "Q6_K"
    )
    rtn = _run(tokenizer, QuantizationModifier(scheme="Q4_K_M", ignore=["lm_head"]), None)
    full = _llama(len(tokenizer))
    assert _output_error(learned, full, tokenizer) < _output_error(rtn, full, tokenizer)


def test_awq_q4_k_m_file_is_its_model(tmp_path: Path, tokenizer) -> None:
    """AWQ's search scores each candidate on the GGUF grid (llama.cpp's scales of the scaled weight) and the
    scaled weights are quantized on it: the file is the fake-quantized model."""
    recipe = AWQModifier(scheme="Q4_K_M", ignore=["lm_head"], n_grid=2, duo_scaling=False)
    model = _run(tokenizer, recipe, tmp_path)
    types = _file_equals_model(tmp_path / "model.gguf", model)
    assert types["model.layers.0.self_attn.v_proj"] == "Q6_K"
    norm = model.model.layers[0].input_layernorm.weight
    assert not torch.equal(norm, torch.ones_like(norm))  # the scales were folded


def test_autoround_fixes_gguf_scales_by_the_imatrix_rule(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """AutoRound fixes each GGUF weight's scales as llama-quantize --imatrix does, from the E[x^2] of the Linear's
    calibration inputs: at 0 steps every weight is the type's round to nearest on those scales."""
    seen: dict[int, torch.Tensor | None] = {}
    of = GridQuantizer.of

    def spy(W, fmt, importance=None):
        seen[id(W)] = importance
        return of(W, fmt, importance)

    monkeypatch.setattr(GridQuantizer, "of", staticmethod(spy))
    full = _llama(len(tokenizer))
    weights = {n: m.weight.detach().clone() for n, m in full.named_modules() if isinstance(m, torch.nn.Linear)}
    model = _run(tokenizer, AutoRoundModifier(scheme="Q4_K", ignore=["lm_head"], iters=0, amp=False), None)
    assert len(seen) == 7 and all(i is not None and i.shape == (256,) and (i > 0).all() for i in seen.values())
    fmt, W = gguf_format("Q4_K"), weights["model.layers.0.mlp.down_proj"]

    def rtn(importance: torch.Tensor | None) -> torch.Tensor:
        scale, zero = formats.qparams(W, fmt, importance=importance)
        return formats.dequantize(formats.quantize(W, scale, zero, fmt), scale, zero, fmt)

    down = model.model.layers[0].mlp.down_proj.weight.detach()
    assert not torch.equal(down, rtn(None))  # not the rule without an importance matrix
    assert any(torch.equal(down, rtn(importance)) for importance in seen.values())  # one of them is down_proj's
