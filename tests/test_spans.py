"""The span services of the modifier API: re-runs with temporary parameters, gradients through a span, the
outputs of a group (seqcal.modifiers.spans)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from seqcal.modifiers.spans import SpanCache, observe_outputs


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _recorded(model: torch.nn.Module, span: str, batches: list[torch.Tensor]) -> SpanCache:
    cache = SpanCache(max_bytes=1 << 24)
    handle = model.get_submodule(span).register_forward_pre_hook(cache.hook(lambda: None), with_kwargs=True)
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids)
    handle.remove()
    return cache


def test_outputs_with_overrides_equal_a_changed_module_and_leave_it_unchanged(
    llama: LlamaForCausalLM,
) -> None:
    batches = [torch.randint(0, 64, (1, 7)), torch.randint(0, 64, (2, 5))]
    span = "model.layers.1.self_attn"  # keyword arguments (position embeddings, mask) are recorded too
    cache = _recorded(llama, span, batches)
    attn = llama.get_submodule(span)
    original = attn.o_proj.weight.detach().clone()
    other = torch.randn_like(original)
    with torch.no_grad():
        tried = cache.outputs(attn, torch.device("cpu"), overrides={"o_proj.weight": other})
        assert torch.equal(attn.o_proj.weight, original)  # the module kept its own weight
        plain = cache.outputs(attn, torch.device("cpu"))
        attn.o_proj.weight.copy_(other)
        changed = cache.outputs(attn, torch.device("cpu"))
        attn.o_proj.weight.copy_(original)
    assert [t.shape for t in tried] == [(1, 7, 32), (2, 5, 32)]
    for a, b, c in zip(tried, changed, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert not torch.allclose(a, c)


def test_gradients_through_a_span_equal_autograd_on_the_module(llama: LlamaForCausalLM) -> None:
    batches = [torch.randint(0, 64, (1, 6)), torch.randint(0, 64, (1, 9))]
    mlp = llama.get_submodule("model.layers.0.mlp")
    cache = _recorded(llama, "model.layers.0.mlp", batches)
    inputs = [call[0][0] for call in cache.calls]
    delta = {"d": torch.zeros_like(mlp.down_proj.weight, requires_grad=True)}
    target = [torch.zeros(x.shape[:-1] + (32,)) for x in inputs]

    def overrides(p):  # noqa: ANN001, ANN202
        return {"down_proj.weight": mlp.down_proj.weight.detach() + p["d"]}

    def loss(y, i):  # noqa: ANN001, ANN202
        return (y - target[i]).pow(2).sum()

    total = cache.gradients(mlp, torch.device("cpu"), delta, overrides, loss)
    # the same by hand: d/dW of sum ||down(h) - 0||^2 over both calls
    W = mlp.down_proj.weight.detach().clone().requires_grad_(True)
    want_total = 0.0
    for x in inputs:
        h = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        value = (h.detach() @ W.T).pow(2).sum()
        value.backward()
        want_total += value.item()
    torch.testing.assert_close(delta["d"].grad, W.grad, rtol=1e-5, atol=1e-6)
    assert total == pytest.approx(want_total, rel=1e-5)
    assert all(p.grad is None for p in mlp.parameters())  # the module's own parameters took no gradient


def test_observe_outputs_hands_each_output_and_removes_its_hooks(llama: LlamaForCausalLM) -> None:
    seen: list[tuple[str, tuple[int, ...]]] = []
    names = ["model.layers.0.mlp", "model.layers.1.self_attn"]  # a tensor output and a tuple output
    with (
        torch.no_grad(),
        observe_outputs(llama, names, lambda n, y, m: seen.append((n, tuple(y.shape))), lambda: None),
    ):
        llama(input_ids=torch.randint(0, 64, (2, 4)))
    assert seen == [("model.layers.0.mlp", (2, 4, 32)), ("model.layers.1.self_attn", (2, 4, 32))]
    with torch.no_grad():
        llama(input_ids=torch.randint(0, 64, (1, 3)))
    assert len(seen) == 2
