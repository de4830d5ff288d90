"""GGUF grids: every type's values as gguf-py (llama.cpp's reader) computes them from seqcal's bytes, exactly;
the codes chosen by round to nearest and by GPTQ on the type's own scales; schemes, mixes and width fallbacks."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from seqcal.algorithms import accumulate_hessian, gptq_quantize
from seqcal.gguf import search
from seqcal.gguf.grids import dequantize, gguf_format, qparams, quantize
from seqcal.gguf.pack import pack
from seqcal.gguf.scheme import GGUFScheme, gguf_preset, mix_type
from seqcal.gguf.tensors import plan_types
from seqcal.gguf.types import GGUF_TYPES
from seqcal.modifiers import QuantizationModifier
from seqcal.modifiers.round_to_nearest import rtn_quantize_module
from seqcal.modifiers.schemes import resolve_modules, resolve_schemes
from seqcal.records import scheme_from_record, scheme_record

TYPES = list(GGUF_TYPES)


def _weight(rows: int = 8, cols: int = 512) -> torch.Tensor:
    W = torch.randn(rows, cols) * 0.02
    W[0, :32] = 0  # an all-zero block
    W[1, 256:] *= 50  # blocks of very different ranges in one row
    W[2, :16] = 0.01  # a flat sub-block
    return W


def _read(data: np.ndarray, name: str) -> torch.Tensor:
    """What llama.cpp computes from the bytes (gguf-py's dequantization, the reference of ggml's)."""
    return torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[name]))


@pytest.mark.parametrize("name", TYPES)
def test_rtn_bytes_read_back_as_seqcal_computes(name: str) -> None:
    fmt, W = gguf_format(name), _weight()
    scale, zero = qparams(W, fmt)
    q = quantize(W, scale, zero, fmt)
    data = pack(q, scale, zero, fmt)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    assert data.shape == (W.shape[0], W.shape[1] // block * size)
    assert torch.equal(_read(data, name), dequantize(q, scale, zero, fmt))
    assert int(q.min()) >= GGUF_TYPES[name].qmin and int(q.max()) <= GGUF_TYPES[name].qmax


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q8_0", "Q4_1", "Q5_1"])
def test_legacy_scales_are_llama_cpps(name: str) -> None:
    """gguf-py carries llama.cpp's reference quantizer for the legacy types: same scales, hence the same error."""
    fmt, W = gguf_format(name), _weight()
    scale, zero = qparams(W, fmt)
    ours = dequantize(quantize(W, scale, zero, fmt), scale, zero, fmt)
    theirs = _read(gguf.quants.quantize(W.numpy(), gguf.GGMLQuantizationType[name]), name)
    assert ((ours - W) ** 2).mean() <= ((theirs - W) ** 2).mean() * 1.001


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_importance_weighted_scales_as_llama_quantize_with_an_imatrix(name: str) -> None:
    """With the inputs' E[x^2] the scales are fitted to the error those inputs see (quantize_row_q4_0_impl's and
    quantize_row_q4_K_impl's rules), which lowers it against the rule without; only the importance's ratios count;
    the other types keep their rule. (On SmolLM2, 99.5% of the Q4_K blocks' scale bytes equal llama-quantize
    --imatrix's: benchmarks/formats/gguf_imatrix_scales.py.)"""
    fmt, W = gguf_format(name), _weight(cols=1024)
    importance = torch.rand(W.shape[1], generator=torch.Generator().manual_seed(1)) ** 4

    def err(scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        return (((dequantize(quantize(W, scale, zero, fmt), scale, zero, fmt) - W) ** 2) * importance).sum()

    plain, weighted = qparams(W, fmt), qparams(W, fmt, importance)
    assert err(*weighted) < 0.9 * err(*plain)
    scaled = qparams(W, fmt, importance * 8)
    assert all(torch.equal(a, b) for a, b in zip(scaled, weighted) if a is not None)
    data = pack(quantize(W, *weighted, fmt), *weighted, fmt)  # a valid block: llama.cpp reads what seqcal computes
    assert torch.equal(_read(data, name), dequantize(quantize(W, *weighted, fmt), *weighted, fmt))
    for other in ("Q8_0", "Q4_1", "Q2_K", "Q3_K"):
        with_, without = qparams(W, gguf_format(other), importance), qparams(W, gguf_format(other))
        assert all(torch.equal(a, b) for a, b in zip(with_, without) if a is not None)


def test_qp_fit_of_sub_block_scales() -> None:
    """make_qp_quants: integers within 0..nmax, d the weighted least-squares one for them, never a worse fit than
    the largest value over nmax; an all-zero row gives 0."""
    x = torch.rand(64, 8, generator=torch.Generator().manual_seed(2))
    x[0] = 0
    w = torch.rand(64, 8, generator=torch.Generator().manual_seed(3)) + 0.1
    d, ints = search.qp(x, 63, w)
    assert d[0] == 0 and not ints[0].any()
    assert int(ints.min()) >= 0 and int(ints.max()) <= 63 and torch.equal(ints, ints.round())
    fit = lambda d, l: (w * (x - d[:, None] * l) ** 2).sum(1)  # noqa: E731
    peak = x.amax(1)
    naive = torch.round(x * (63 / peak.clamp_min(1e-30))[:, None]).clamp(0, 63)
    assert (fit(d, ints)[1:] <= fit(peak / 63, naive)[1:] * (1 + 1e-6)).all()
    best = (w * x * ints).sum(1) / (w * ints * ints).sum(1)
    torch.testing.assert_close(d[1:], best[1:])


@pytest.mark.parametrize("name", TYPES)
def test_gptq_codes_on_the_types_grid(name: str) -> None:
    """GPTQ keeps the type's scales and chooses the codes: the weight it returns is what llama.cpp reads, and its
    output error is below round to nearest's on the same scales."""
    torch.manual_seed(0)
    X = torch.randn(512, 256) * torch.linspace(0.1, 3, 256)
    H, _ = accumulate_hessian(None, X, 0)
    W = torch.randn(32, 256) * 0.05
    fmt = gguf_format(name)
    result = gptq_quantize(W, H.clone(), fmt=fmt, num_bits=fmt.num_bits, actorder="weight")
    scale, zero = result.scale, None if fmt.symmetric else result.zero_point
    fixed = qparams(W, fmt, H.diagonal())[0]  # Q4_0 / Q5_0: weighted by E[x^2]
    if name in ("Q4_0", "Q5_0", "Q8_0"):  # refitted to the codes (test_block_scales_refitted_to_gptqs_codes)
        assert not torch.equal(result.scale, fixed) and torch.equal(result.scale, result.scale.half().float())
    else:
        assert torch.equal(result.scale, fixed)
    assert torch.equal(_read(pack(result.q, scale, zero, fmt), name), result.Q)
    rtn = dequantize(quantize(W, scale, zero, fmt), scale, zero, fmt)
    err = lambda Q: (((Q - W) @ X.T) ** 2).mean()  # noqa: E731
    assert err(result.Q) < err(rtn)


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q8_0"])
def test_block_scales_refitted_to_gptqs_codes(name: str) -> None:
    """Once GPTQ chose the codes, each row's block scales are the fp16 least-squares fit to them: no row's output
    error rises against the scales it was solved with, the sum falls, and overwriting W gives the same bytes."""
    torch.manual_seed(1)
    X = torch.randn(2048, 256) * torch.linspace(0.1, 3, 256) + torch.randn(2048, 1)  # correlated columns
    H, _ = accumulate_hessian(None, X, 0)
    W = torch.randn(48, 256) * 0.05
    fmt = gguf_format(name)
    result = gptq_quantize(W, H.clone(), fmt=fmt, num_bits=fmt.num_bits, actorder="weight")
    before = dequantize(result.q, qparams(W, fmt, H.diagonal())[0], None, fmt)
    row_error = lambda Q: torch.einsum("ri,ij,rj->r", Q - W, H, Q - W)  # noqa: E731
    assert bool((row_error(result.Q) <= row_error(before) * (1 + 1e-6)).all())
    assert row_error(result.Q).sum() < 0.99 * row_error(before).sum()
    copy = W.clone()
    again = gptq_quantize(copy, H.clone(), fmt=fmt, num_bits=fmt.num_bits, actorder="weight", overwrite=True)
    assert again.Q is copy and torch.equal(copy, result.Q) and torch.equal(again.scale, result.scale)
    assert again.rel_error == pytest.approx(float((row_error(result.Q).sum() / torch.einsum("ri,ij,rj->", W, H, W)).sqrt()), rel=1e-4)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_0"])
def test_rtn_modifier_and_bf16_weights(name: str) -> None:
    """A bf16 Linear: the stored scales stay float32 (fp16 values bf16 would round), the weight is llama.cpp's
    values in bf16."""
    linear = torch.nn.Linear(256, 16, bias=False).to(torch.bfloat16)
    qw = rtn_quantize_module(linear, gguf_preset(name, ["Linear"]))
    fmt = gguf_format(name)
    assert qw.scale.dtype == torch.float32
    expected = _read(pack(qw.q, qw.scale, qw.zero_point, fmt), name)
    assert torch.equal(linear.weight.data, expected.to(torch.bfloat16))


def _tiny(hidden: int, layers: int = 8) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(config)


def test_mix_types_follow_llama_cpp() -> None:
    # Q4_K_M: v_proj and down_proj in Q6_K where use_more_bits picks the layer (first and last eighth, every third)
    more = [i for i in range(32) if mix_type("Q4_K_M", "down_proj", i, 32, 4.0) == "Q6_K"]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert (
        mix_type("Q3_K_M", "v_proj", 1, 32, 1.0) == "Q5_K"
        and mix_type("Q3_K_M", "o_proj", 5, 32, 1.0) == "Q4_K"
    )
    assert (
        mix_type("Q2_K_MIX", "v_proj", 5, 32, 4.0) == "Q4_K"
        and mix_type("Q2_K_MIX", "q_proj", 5, 32, 4.0) == "Q2_K"
    )
    model = _tiny(256)
    modules = resolve_modules(model, resolve_schemes("Q4_K_M", None, "Linear", "m"), ["lm_head"], "m")
    assert modules["model.layers.0.self_attn.v_proj"].gguf_type == "Q6_K"
    assert modules["model.layers.2.self_attn.v_proj"].gguf_type == "Q4_K"
    assert modules["model.layers.3.self_attn.q_proj"].gguf_mix == "Q4_K_M"
    # Q4_0 / Q5_0 as llama-quantize writes them with an importance matrix: the first eighth's down_proj in Q4_1 / Q5_1
    assert [mix_type("Q4_0_MIX", "down_proj", i, 30, 3.0) for i in (0, 2, 3)] == ["Q4_1", "Q4_1", "Q4_0"]
    assert mix_type("Q5_0_MIX", "down_proj", 0, 30, 3.0) == "Q5_1"
    assert mix_type("Q4_0_MIX", "v_proj", 0, 30, 3.0) == "Q4_0"
    legacy = resolve_modules(model, resolve_schemes("Q4_0_MIX", None, "Linear", "m"), ["lm_head"], "m")
    assert {n for n, s in legacy.items() if s.gguf_type == "Q4_1"} == {"model.layers.0.mlp.down_proj"}
    assert plan_types(list(legacy.values())) == ("Q4_0", int(gguf.LlamaFileType.MOSTLY_Q4_0))


def test_k_quant_on_ragged_width_takes_llama_cpps_fallback(caplog: pytest.LogCaptureFixture) -> None:
    """576 inputs (SmolLM2's hidden size) are not a multiple of 256: Q4_K falls back to Q5_0 and Q6_K to Q8_0, as
    llama-quantize does, and the log says so in one line per pair."""
    model = _tiny(576, layers=2)
    with caplog.at_level(logging.WARNING, logger="seqcal"):
        modules = resolve_modules(model, resolve_schemes("Q4_K", None, "Linear", "m"), ["lm_head"], "m")
    assert modules["model.layers.0.self_attn.q_proj"].gguf_type == "Q5_0"
    assert modules["model.layers.0.mlp.down_proj"].gguf_type == "Q4_K"  # 512 inputs: a multiple of 256
    lines = [r.getMessage() for r in caplog.records if "fallback" in r.getMessage()]
    assert (
        len(lines) == 1 and "Q4_K needs widths that are multiples of 256" in lines[0] and "Q5_0" in lines[0]
    )


def test_width_no_block_divides_is_refused() -> None:
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=40, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    with pytest.raises(ValueError, match="no GGUF block .* divides.*ignore"):
        resolve_modules(model, resolve_schemes("Q4_0", None, "Linear", "m"), ["lm_head"], "m")


def test_scheme_travels_and_refuses_observers() -> None:
    scheme = gguf_preset("Q5_K", ["Linear"])
    back = scheme_from_record(scheme_record(scheme))
    assert isinstance(back, GGUFScheme) and back == scheme
    with pytest.raises(ValueError, match="llama.cpp's rule"):
        QuantizationModifier(scheme="Q4_K", weight_observer="mse")


def test_save_check_refuses_a_weight_llama_cpp_would_not_compute() -> None:
    """The writer reads each packed tensor back with gguf-py before writing it: a module whose weight is not what
    its codes give (changed after quantization) stops the save, naming the tensor."""
    from seqcal.gguf.families import family_of, tensor_namer
    from seqcal.gguf.tensors import FilePlan, GGUFCheckError, module_entries

    model = _tiny(256, layers=1)
    linear = model.model.layers[0].mlp.down_proj
    qw = rtn_quantize_module(linear, gguf_preset("Q4_K", ["Linear"]))
    family = family_of(model.config)
    plan = FilePlan(family, model.config, tensor_namer(family, model.config), "Q4_K", 15, False)
    (entry,) = module_entries("model.layers.0.mlp.down_proj", linear, qw, plan)
    assert entry.name == "blk.0.ffn_down.weight" and entry.ggml_type == gguf.GGMLQuantizationType.Q4_K
    linear.weight.data[3, 7] += 1e-3
    with pytest.raises(GGUFCheckError, match="model.layers.0.mlp.down_proj.weight as llama.cpp reads it"):
        module_entries("model.layers.0.mlp.down_proj", linear, qw, plan)
