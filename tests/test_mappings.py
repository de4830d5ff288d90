"""Smoothing mappings: derived from the traced graph on zoo architectures, one test per skip reason, explicit
recipe mappings (SmoothQuant and AWQ formats) and their errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from seqcal.execution.transforms import linear_graph
from seqcal.mappings import (
    Mapping,
    derive_mappings,
    explicit_mappings,
    fold_scales,
    resolve_mappings,
)
from seqcal.mappings.kv_writes import cache_write_names
from zoo import ARCHS


def zoo_graph(arch: str) -> tuple[nn.Module, fx.Graph]:
    spec = ARCHS[arch]
    model = spec.build()
    sample = {**spec.make_inputs(model), "use_cache": False}
    graph = linear_graph(model, sample)
    assert graph is not None
    return model, graph


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_norms_before_attention_and_mlp_are_found_in_every_layer(arch: str) -> None:
    model, graph = zoo_graph(arch)
    mappings, _ = derive_mappings(model, graph)
    norms = {m.producer: m for m in mappings if m.kind == "norm"}
    layers = model.config.num_hidden_layers
    for i in range(layers):
        p = f"model.layers.{i}"
        assert norms[f"{p}.input_layernorm"].consumers == tuple(f"{p}.self_attn.{x}_proj" for x in "qkv"), (
            norms
        )
        assert norms[f"{p}.post_attention_layernorm"].consumers == (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")
        # the MLP's product act(gate) * up is linear in up: up_proj -> down_proj is a linear mapping
        assert Mapping(f"{p}.mlp.up_proj", (f"{p}.mlp.down_proj",), "linear") in mappings
    assert len(norms) == 2 * layers


def test_gemma_offset_norm_is_skipped_with_its_reason() -> None:
    model, graph = zoo_graph("gemma")
    mappings, skipped = derive_mappings(model, graph)
    assert not [m for m in mappings if m.kind == "norm"]
    reasons = {s.consumers[0]: s.reason for s in skipped}
    assert "offset norm" in reasons["model.layers.0.self_attn.q_proj"]
    assert "offset norm" in reasons["model.layers.0.mlp.gate_proj"]


def test_skips_are_logged_by_the_resolver(caplog: pytest.LogCaptureFixture) -> None:
    model, graph = zoo_graph("gemma")
    with caplog.at_level("INFO", logger="seqcal"):
        resolve_mappings(model, graph, None, "SmoothQuantModifier")
    assert "not smoothing model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj" in caplog.text
    assert "offset norm" in caplog.text


# --- toy modules, one per reason (torch.fx.symbolic_trace gives the graph) --------------------------------


class Attention(nn.Module):
    """norm -> q/v -> attention -> o_proj, with ``kv`` value heads for 4 query heads of width 4."""

    def __init__(self, kv: int) -> None:
        super().__init__()
        self.norm, self.q_proj = nn.LayerNorm(16), nn.Linear(16, 16)
        self.v_proj, self.o_proj = nn.Linear(16, 4 * kv), nn.Linear(16, 16)
        self.kv = kv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm(x)
        q = self.q_proj(h).view(b, t, 4, 4).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv, 4).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, v, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, 16))


def apply_rotary_pos_emb(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 + x.roll(1, -1) * 0.5


fx.wrap("apply_rotary_pos_emb")


class Toy(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.fc1, self.fc2, self.gate = (
            kind,
            nn.Linear(16, 16),
            nn.Linear(16, 16),
            nn.Linear(16, 16),
        )
        self.act, self.norm, self.head_norm = nn.SiLU(), nn.LayerNorm(16), nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.kind == "rotary":
            return self.fc2(apply_rotary_pos_emb(h))
        if self.kind == "residual":
            return self.fc2(h + x)
        if self.kind == "activation":
            return self.fc2(self.act(h))
        if self.kind == "glu":
            return self.fc2(self.act(self.gate(x)) * h)
        if self.kind == "head norm":  # a per-head norm (as Qwen3's q_norm / k_norm) after the producer
            return self.fc2(self.head_norm(h.unflatten(-1, (4, 4))).flatten(-2))
        n = self.norm(x)
        return self.fc2(n) + n  # "other reader": the norm's output is also added to the result


def skipped_reason(model: nn.Module, consumer: str) -> str:
    mappings, skipped = derive_mappings(model, fx.symbolic_trace(model).graph)
    found = [s.reason for s in skipped if consumer in s.consumers]
    assert found, (mappings, skipped)
    return found[0]


def test_attention_without_gqa_maps_v_proj_to_o_proj() -> None:
    model = Attention(kv=4)
    mappings, _ = derive_mappings(model, fx.symbolic_trace(model).graph)
    assert Mapping("v_proj", ("o_proj",), "linear") in mappings
    assert Mapping("norm", ("q_proj", "v_proj"), "norm") in mappings


def test_gqa_width_mismatch_is_skipped() -> None:
    reason = skipped_reason(Attention(kv=2), "o_proj")
    assert "grouped kv heads" in reason and "v_proj has 8 outputs" in reason and "[16]" in reason


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("rotary", "rotary embedding (apply_rotary_pos_emb)"),
        ("residual", "a residual add"),
        ("activation", "module act (SiLU) lies between"),
        ("head norm", "a norm head_norm (LayerNorm) lies between"),
    ],
)
def test_each_skip_reason_is_named(kind: str, words: str) -> None:
    assert words in skipped_reason(Toy(kind), "fc2")


def test_gated_product_maps_only_the_linear_factor() -> None:
    model = Toy("glu")
    mappings, _ = derive_mappings(model, fx.symbolic_trace(model).graph)
    assert Mapping("fc1", ("fc2",), "linear") in mappings
    assert not [m for m in mappings if m.producer == "gate"]


def test_a_norm_output_read_by_something_else_is_skipped() -> None:
    assert "also read by call_function add" in skipped_reason(Toy("other"), "fc2")


# --- explicit mappings ------------------------------------------------------------------------------------

LLMC = [
    [["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
    [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"],
]


def test_explicit_llmc_mappings_equal_the_derived_norm_mappings() -> None:
    model, graph = zoo_graph("llama")
    derived = [m for m in derive_mappings(model, graph)[0] if m.kind == "norm"]
    assert sorted(explicit_mappings(model, LLMC), key=str) == sorted(derived, key=str)
    awq = [
        {
            "smooth_layer": "re:.*input_layernorm$",
            "balance_layers": ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"],
        }
    ]
    assert explicit_mappings(model, awq) == [m for m in derived if m.producer.endswith("input_layernorm")]


def test_a_regex_matching_nothing_is_one_sentence_naming_it_the_model_and_the_fix() -> None:
    model = ARCHS["llama"].build()
    with pytest.raises(ValueError) as err:
        explicit_mappings(model, [[["re:.*qq_proj"], "re:.*input_layernorm"]], "SmoothQuantModifier")
    message = str(err.value)
    assert "'re:.*qq_proj' matches no module of LlamaForCausalLM" in message
    assert "fix the regex" in message and "\n" not in message


def test_consumers_of_different_widths_are_refused() -> None:
    model = ARCHS["llama"].build()
    with pytest.raises(
        ValueError, match=r"read inputs of different widths .* e\.g\. \[q_proj, k_proj, v_proj\]"
    ):
        explicit_mappings(model, [[["re:.*q_proj", "re:.*down_proj"], "re:.*input_layernorm"]])


def test_an_explicit_offset_norm_is_refused() -> None:
    model = ARCHS["gemma"].build()
    with pytest.raises(ValueError, match="offset norm"):
        explicit_mappings(model, [[["re:.*q_proj"], "re:.*input_layernorm"]])


# --- v_proj -> o_proj through transformers' attention (its KV-cache write is an opaque statement) ----------


def tiny_llama(kv_heads: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(config).eval()


IDS = torch.tensor([[(7 * i + 3 * j) % 128 for i in range(16)] for j in range(2)])


def test_hf_llama_maps_v_proj_to_o_proj_through_the_cache_write_and_the_fold_is_exact() -> None:
    model = tiny_llama(kv_heads=4)
    mappings, skipped = derive_mappings(model, linear_graph(model, {"input_ids": IDS[:1, :8]}))
    for i in range(2):
        p = f"model.layers.{i}.self_attn"
        assert Mapping(f"{p}.v_proj", (f"{p}.o_proj",), "linear") in mappings, skipped
    with torch.no_grad():
        reference = model(IDS).logits
        g = torch.Generator().manual_seed(0)
        for m in mappings:
            width = model.get_submodule(m.consumers[0]).in_features
            fold_scales(model, m, torch.rand(width, generator=g) * 4 + 0.25)
        o_proj = tiny_llama(4).model.layers[0].self_attn.o_proj.weight
        assert not torch.equal(model.model.layers[0].self_attn.o_proj.weight, o_proj)
        after = model(IDS).logits
        # the same with a KV cache holding the first half: the write concatenates the scaled past values
        cached = model(IDS[:, :8], use_cache=True)
        tail = model(IDS[:, 8:], cache=cached.past_key_values, use_cache=True).logits
    assert (after - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert (tail - reference[:, 8:]).abs().max() <= 1e-5 * reference.abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_v_proj_to_o_proj_is_derived_exactly_when_each_kv_head_serves_one_query_head(arch: str) -> None:
    model, graph = zoo_graph(arch)
    mappings, skipped = derive_mappings(model, graph)
    attention = model.model.layers[0].self_attn
    p = "model.layers.0.self_attn"
    if attention.num_key_value_groups == 1:
        assert Mapping(f"{p}.v_proj", (f"{p}.o_proj",), "linear") in mappings
    else:  # llm-compressor skips it too: v_proj's rows are fewer than o_proj's columns
        reason = next(s.reason for s in skipped if s.consumers == (f"{p}.o_proj",))
        assert "grouped kv heads" in reason and f"{attention.num_key_value_groups} query heads" in reason


def test_gqa_llama_skips_v_proj_to_o_proj_naming_the_groups() -> None:
    model = tiny_llama(kv_heads=2)
    mappings, skipped = derive_mappings(model, linear_graph(model, {"input_ids": IDS[:1, :8]}))
    assert not [m for m in mappings if m.producer.endswith("v_proj")]
    reason = next(s.reason for s in skipped if s.consumers == ("model.layers.0.self_attn.o_proj",))
    assert reason == "grouped kv heads (repeat_kv): 2 query heads read each kv head"


@pytest.mark.parametrize(
    ("code", "names"),
    [
        ("if cache is not None:\n    k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)", ("k", "v")),
        (
            "if past_key_value is not None:\n    cache_kwargs = {'sin': sin, 'cos': cos}\n"
            "    key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, "
            "cache_kwargs)",
            ("key_states", "value_states"),
        ),
        ("if cache is not None:\n    k, v = cache.update(v, k, self.layer_idx)", ()),  # swapped: not a write
        (
            "if cache is not None:\n    k, v = other.update(k, v, self.layer_idx)",
            (),
        ),  # another object's update
        ("if cache is not None:\n    k, v = cache.update(k, v, 0)\nelse:\n    k = k * 2", ()),  # else branch
        ("if cache is not None:\n    k, v = cache.update(k, v, 0)\n    v = v * 2", ()),  # more than the write
        ("if cache:\n    k, v = cache.update(k, v, 0)", ()),
        ("attn_output = attn_output.reshape(*input_shape, -1).contiguous()", ()),
    ],
)
def test_cache_write_statements_are_recognized_exactly(code: str, names: tuple[str, ...]) -> None:
    assert cache_write_names(code) == names
