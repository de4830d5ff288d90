"""Tracer mechanisms for forwards that were refused at trace time: each synthetic module below failed to
trace before the mechanism existed and now gives a partition equal to eager execution."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from seqcal import TracingError, trace_subgraphs
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


# ---- guarded decisions: a branch that reaches a target tests a runtime value --------------------------------


class Cross(Block):
    """A second layer kind in the stack (as Mllama's cross-attention layers)."""


def _cache_for(h: torch.Tensor) -> torch.Tensor | None:
    """Stands for a cache lookup: a value only known at run time, None for short inputs."""
    return None if h.shape[1] < 16 else h


class SkipsALayer(Stack):
    """``continue`` past layer 1 depending on a runtime value (Mllama skips cross-attention layers so)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[1] = Cross()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            if i == 1 and _cache_for(h) is None:
                continue
            h = layer(h)
        return h


def test_data_dependent_continue_is_decided_on_the_sample_and_guarded() -> None:
    _check(SkipsALayer(), targets=2)


def test_a_batch_that_takes_the_other_branch_is_refused_by_the_guard() -> None:
    model = SkipsALayer()
    ids = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(0))
    subgraphs = trace_subgraphs(model, {"input_ids": ids}, sequential_targets=["Block"])
    with pytest.raises(
        Exception, match=r"traced with `if i == 1 and _cache_for\(h\) is None:` deciding True"
    ):
        subgraphs.run(input_ids=torch.zeros(1, 20, dtype=torch.long))  # long: the layer would run


class Chunked(Stack):
    """The layers run chunk by chunk for long inputs (xLSTM's max_inference_chunksize)."""

    chunk = 64

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if self.chunk < h.shape[1]:
            parts = []
            for piece in h.split(self.chunk, dim=1):
                for layer in self.layers:
                    piece = layer(piece)
                parts.append(piece)
            h = torch.cat(parts, dim=1)
        else:
            for layer in self.layers:
                h = layer(h)
        return h


def test_branch_on_a_runtime_size_that_calls_the_layers_is_decided() -> None:
    _check(Chunked())


class StateArgument(Stack):
    """A layer call whose argument tests a runtime object (``state[i] if state is not None else None``)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        state = _cache_for(h)
        for layer in self.layers:
            h = layer(h, 0.5 if state is not None else None)
        return h


def test_is_test_inside_a_layer_call_is_decided() -> None:
    _check(StateArgument())


# ---- an autograd Function that runs the layers (Reformer's reversible stack) --------------------------------


class _Reversible(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, layers: nn.ModuleList, extra: list) -> torch.Tensor:
        a, b = torch.chunk(h, 2, dim=-1)
        for layer in layers:
            a, b = b, a + layer(b)
            if len(extra) > 10:  # opaque code in the Function's forward reads ``ctx``'s locals
                extra.append(a)
        ctx.save_for_backward(a.detach(), b.detach())
        ctx.layers = layers
        return torch.cat([a, b], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise NotImplementedError


class Reversible(Stack):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(4) for _ in range(3)])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return _Reversible.apply(h, self.layers, [])


def test_autograd_function_given_the_layers_is_traced_through() -> None:
    _check(Reversible())


def test_inferred_target_skipped_by_a_decided_branch_gets_a_fix_that_works() -> None:
    model = SkipsALayer()
    ids = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(TracingError, match=r"layers\.1.*not called for the trace sample's inputs") as err:
        trace_subgraphs(model, {"input_ids": ids})
    assert "sequential_targets=['Block']" in str(err.value)  # the fix: as in _check, which passes


class DeletesALocal(Stack):
    """Opaque code that deletes a local (Reformer's layers ``del prev_attn_output``)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        tmp = h * 2
        if bool(h.abs().sum() > 0):  # value-dependent: opaque
            h = h + tmp
            del tmp
        for layer in self.layers:
            h = layer(h)
        return h


def test_opaque_code_that_deletes_a_local_does_not_return_it() -> None:
    _check(DeletesALocal())


def test_the_fix_named_for_a_skipped_target_works() -> None:
    """Mllama without images: the error's sequential_targets gives a partition equal to eager."""
    import re

    from zoo import ARCHS

    spec = ARCHS["mllama_text"]
    model = spec.build()
    with pytest.raises(TracingError) as err:
        trace_subgraphs(model, spec.make_inputs(model, batch=1, seq_len=12))
    classes = re.search(r"sequential_targets=\[([^\]]*)\]", str(err.value))
    assert classes is not None
    targets = [c.strip(" '") for c in classes.group(1).split(",")]
    subgraphs = trace_subgraphs(
        model, spec.make_inputs(model, batch=1, seq_len=12), sequential_targets=targets
    )
    assert len(subgraphs.targets) == spec.num_targets
    inputs = spec.make_inputs(model, batch=2, seq_len=9, left_pad=3)
    with torch.no_grad():
        want = model(**inputs)
    assert_same_outputs(subgraphs.run(**inputs), want)


def test_decisions_onload_weights_left_on_meta_by_oneshot(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """From a directory the parameters stay on meta; deciding xLSTM's chunking branch onloads what it needs
    (the trace succeeds: no layer-by-layer fallback)."""
    import logging

    from seqcal import GPTQModifier, oneshot
    from zoo import ARCHS

    ARCHS["xlstm"].build().save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(4, 240, (16,), generator=g).tolist()} for _ in range(2)]
    recipe = GPTQModifier(scheme="W8A8", ignore=["re:.*lm_head", "re:.*embed.*"])
    with caplog.at_level(logging.INFO, logger="seqcal"):
        oneshot(model=str(tmp_path / "model"), dataset=data, recipe=recipe, output_dir=str(tmp_path / "out"))
    assert "decided False on the trace sample" in caplog.text
    assert "layer by layer" not in caplog.text
