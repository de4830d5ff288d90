"""Tracing contracts beyond equivalence: invariants 2-5, diagnostics, options, real model end to end."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from seqcal import TracingError, trace_subgraphs
from test_trace_equivalence import assert_same_outputs


def tiny_llama(layers: int = 4, **kw: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, **kw,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def sample(batch: int = 1, seq: int = 10, pad: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seq))
    mask = torch.ones_like(ids)
    mask[-1, :pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_targets_and_order() -> None:
    model = tiny_llama()
    sg = trace_subgraphs(model, sample())
    assert sg.targets == [f"model.layers.{i}" for i in range(4)]
    assert [s.targets for s in sg] == [[t] for t in sg.targets] + [[]]
    assert sg[-1].returns and not any(s.returns for s in sg[:-1])


def test_targets_per_subgraph() -> None:
    sg = trace_subgraphs(tiny_llama(), sample(), targets_per_subgraph=2)
    assert [s.targets for s in sg] == [
        ["model.layers.0", "model.layers.1"],
        ["model.layers.2", "model.layers.3"],
        [],
    ]
    inputs = sample(2, 6, 2)
    assert_same_outputs(sg.run(**inputs), sg.model(**inputs))


def test_explicit_targets_by_class_and_pattern() -> None:
    model = tiny_llama()
    by_class = trace_subgraphs(model, sample(), sequential_targets=["LlamaMLP"])
    assert by_class.targets == [f"model.layers.{i}.mlp" for i in range(4)]
    by_name = trace_subgraphs(model, sample(), sequential_targets=[r"re:model\.layers\.[02]$"])
    assert by_name.targets == ["model.layers.0", "model.layers.2"]
    inputs = sample(2, 7, 3)
    with torch.no_grad():
        want = model(**inputs)
    assert_same_outputs(by_class.run(**inputs), want)
    assert_same_outputs(by_name.run(**inputs), want)


def test_unknown_target_lists_layer_classes() -> None:
    with pytest.raises(TracingError, match="LlamaDecoderLayer"):
        trace_subgraphs(tiny_llama(), sample(), sequential_targets=["NoSuchLayer"])


def test_nested_targets_rejected() -> None:
    with pytest.raises(TracingError, match="nested"):
        trace_subgraphs(tiny_llama(), sample(), sequential_targets=["LlamaDecoderLayer", "LlamaMLP"])


def test_leaf_containing_target_rejected() -> None:
    with pytest.raises(TracingError, match="leaf module"):
        trace_subgraphs(tiny_llama(), sample(), leaf_modules=["LlamaModel"])


def test_ignored_function_hiding_targets_is_reported() -> None:
    # Making LlamaModel.forward's layer loop opaque must fail loudly, never hide the layers.
    class Wrapped(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def run_inner(self, **kw: torch.Tensor) -> torch.Tensor:
            return self.inner(**kw).logits

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.run_inner(input_ids=input_ids, attention_mask=attention_mask)

    model = Wrapped(tiny_llama())
    ok = trace_subgraphs(model, sample(), sequential_targets=["LlamaDecoderLayer"])
    assert len(ok.targets) == 4  # run_inner reaches the layers, so it is traced through
    with pytest.raises(TracingError) as err:
        trace_subgraphs(model, sample(), sequential_targets=["LlamaDecoderLayer"], ignore=["run_inner"])
    assert "test_tracing.py" in str(err.value) and "run_inner" in str(err.value)


def test_attention_implementation_kept_and_nothing_left_behind() -> None:
    model = tiny_llama()
    assert model.config._attn_implementation == "sdpa"
    before = {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sg = trace_subgraphs(model, sample())
    sg.run(**sample(2, 5, 1))
    assert model.config._attn_implementation == "sdpa"  # invariant 4
    after = {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    assert before == after  # invariant 5: no hooks left
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any(k.startswith("_tensor_constant") for k in dict(model.named_buffers()))


def test_no_specialisation_on_padding_or_length() -> None:
    # Traced on an unpadded sample; the causal mask must be rebuilt per batch (invariant 3).
    model = tiny_llama(sliding_window=3)
    sg = trace_subgraphs(model, sample(1, 12, 0))
    for batch, seq, pad in [(2, 5, 4), (3, 20, 7), (1, 1, 0)]:
        inputs = sample(batch, seq, pad)
        with torch.no_grad():
            want = model(**inputs)
        assert_same_outputs(sg.run(**inputs), want)


def test_inputs_must_match_trace_structure() -> None:
    sg = trace_subgraphs(tiny_llama(), sample())
    with pytest.raises(ValueError, match="traced inputs"):
        sg.run(input_ids=sample()["input_ids"])
    with pytest.raises(ValueError, match="use_cache"):
        sg.run(**sample(), use_cache=False)


def test_traces_with_weights_on_meta() -> None:
    with torch.device("meta"):
        model = tiny_llama(layers=64)
    sg = trace_subgraphs(model, {k: v for k, v in sample().items()})
    assert len(sg.targets) == 64 and len(sg) == 65
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.e2e
@pytest.mark.parametrize("trace_into", [None, "all"], ids=["layers", "full"])
def test_smollm2_partitioned_equals_eager_on_wikitext(smollm2_dir, wiki_test_text, trace_into) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.padding_side = "left"
    paragraphs = [line.strip() for line in wiki_test_text.splitlines() if len(line.strip()) > 400]
    sample_inputs = tokenizer(paragraphs[:1], return_tensors="pt", truncation=True, max_length=64)
    sg = trace_subgraphs(model, dict(sample_inputs), trace_into=trace_into)
    assert len(sg.targets) == 30 and len(sg) == 31
    assert bool(sg.traced.traced_into) == (trace_into is not None) and not sg.traced.not_traced_into
    texts = [paragraphs[1], paragraphs[2][:150]]  # rows of different length: the short one is padded
    inputs = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=96)
    assert (inputs["attention_mask"] == 0).any()  # a padded row
    with torch.no_grad():
        want = model(**inputs)
    assert_same_outputs(sg.run(**inputs), want)
