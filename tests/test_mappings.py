"""Smoothing mappings: derived from the traced graph on zoo architectures, one test per skip reason, explicit
recipe mappings (SmoothQuant and AWQ formats) and their errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from seqcal.execution.transforms import linear_graph
from seqcal.mappings import Mapping, derive_mappings, explicit_mappings, resolve_mappings
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
