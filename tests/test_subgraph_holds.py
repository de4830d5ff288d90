"""One test of a module being inside a subgraph (``tracing.partition.within``), shared by every modifier, the
checkpoint writer and the plan, and its root case: a subgraph that uses the root module ``""`` holds every module."""

from __future__ import annotations

import pytest

from seqcal.modifiers import QuantizationModifier, WandaPruningModifier
from seqcal.tracing.partition import Subgraph, within
from test_oneshot import tiny_llama

KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@pytest.mark.parametrize(
    "name,modules,inside",
    [
        ("model.layers.1", ["model.layers.1"], True),  # the module itself
        ("model.layers.1.mlp.up_proj", ["model.layers.1"], True),  # a child
        ("model.layers.10.mlp", ["model.layers.1"], False),  # a sibling sharing the name's start
        ("model.layers", ["model.layers.1"], False),  # a parent
        ("lm_head", ["model.norm", "lm_head"], True),
        ("model.layers.1.mlp", [], False),
        ("model.layers.1.mlp", [""], True),  # the root holds everything
        ("", ["model.layers.0"], False),
    ],
)
def test_within_is_the_module_or_a_child_and_the_root_holds_all(
    name: str, modules: list[str], inside: bool
) -> None:
    assert within(name, modules) is inside
    assert Subgraph(index=0, nodes=[], modules=modules).holds(name) is inside


def test_modifiers_take_the_modules_a_subgraph_holds_and_a_root_subgraph_holds_them_all() -> None:
    model = tiny_llama()  # two layers
    quant = QuantizationModifier(targets=["Linear"], scheme="W4A16", ignore=["lm_head"], kv_cache_scheme=KV)
    wanda = WandaPruningModifier(sparsity=0.5)
    quant.validate(model)
    wanda.validate(model)
    layer = Subgraph(index=0, nodes=[], modules=["model.embed_tokens", "model.layers.0"])
    assert quant.modules_in(layer) == [n for n in quant.modules if n.startswith("model.layers.0.")]
    assert wanda.modules_in(layer) == [n for n in wanda.pruned if n.startswith("model.layers.0.")]
    assert quant.kv.modules_in(layer.modules) == ["model.layers.0.self_attn"]
    root = Subgraph(index=0, nodes=[], modules=[""])
    assert quant.modules_in(root) == list(quant.modules)
    assert wanda.modules_in(root) == list(wanda.pruned)
    assert quant.kv.modules_in(root.modules) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
