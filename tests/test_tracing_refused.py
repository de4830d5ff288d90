"""Tracer mechanisms for forwards that were refused at trace time: each synthetic module below failed to
trace before the mechanism existed and now gives a partition equal to eager execution."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from seqcal import trace_subgraphs
from test_trace_equivalence import assert_same_outputs


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, scale: Any = None) -> torch.Tensor:
        return h + torch.tanh(self.proj(h)) * (1.0 if scale is None else scale)


class Stack(nn.Module):
    """Three blocks behind an embedding; subclasses change only the forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList([Block() for _ in range(3)])


def _check(model: nn.Module, targets: int = 3) -> None:
    ids = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(0))
    subgraphs = trace_subgraphs(model, {"input_ids": ids}, sequential_targets=["Block"])
    assert len(subgraphs.targets) == targets
    other = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=other)
    assert_same_outputs(subgraphs.run(input_ids=other), want)


class EarlyReturn(Stack):
    """A statement that cannot be traced (``*shape`` of a runtime size) before an early ``return``."""

    def forward(self, input_ids: torch.Tensor, return_dict: bool = True) -> Any:
        shape = input_ids.size()
        h = self.embed(input_ids.view(-1, shape[-1]))
        for layer in self.layers:
            h = layer(h)
        out_shape = shape + (h.size(-1),)
        h = h.view(*out_shape)  # iterating a proxy fails: made opaque
        if not return_dict:  # the return must then be lifted with the rest of the function
            return (h,)
        return {"hidden": h}


def test_early_return_after_an_opaque_statement_is_lifted_with_the_tail() -> None:
    _check(EarlyReturn())


class LoopVariable(Stack):
    """An opaque statement in the layer loop reads the loop variable."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        seen = []
        for i, layer in enumerate(self.layers):
            if bool(h.abs().sum() > 0):  # value-dependent: opaque, and it needs `i` at run time
                seen.append(h[..., i])
            h = layer(h)
        return h + torch.stack(seen, -1).sum(-1, keepdim=True)


def test_opaque_statement_in_a_layer_loop_reads_the_loop_variable() -> None:
    _check(LoopVariable())


def test_undeclared_layers_are_found_beside_large_embedding_tables() -> None:
    """No ``_no_split_modules``, and embedding tables (RoCBert's shape and pronunciation ones) hold most of
    the parameters: the stack is still the layers."""
    from seqcal.tracing.targets import infer_candidates

    class Tables(Stack):
        def __init__(self) -> None:
            super().__init__()
            self.shapes = nn.Embedding(4096, 64)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(input_ids) + self.shapes(input_ids)[..., :8]
            for layer in self.layers:
                h = layer(h)
            return h

    assert sorted(infer_candidates(Tables()).values()) == ["layers.0", "layers.1", "layers.2"]
