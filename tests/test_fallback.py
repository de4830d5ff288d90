"""When tracing fails but the targets form a simple chain, calibration falls back to layer-by-layer capture."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from seqcal import TracingError, oneshot

RECIPE = "GPTQModifier: {scheme: W4A16, ignore: [head, embed]}"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(128, 256)
        self.down = nn.Linear(256, 128)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(h)))


class Chain(nn.Module):
    """Layers called one after another; ``guard`` adds a value-dependent check tracing cannot keep."""

    def __init__(self, guard: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 128)
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(128, 64)
        self.guard = guard

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        i = 0
        # How many layers run depends on values at every step: the loop cannot be traced (an ``if`` could be
        # decided on the sample and guarded, a ``while`` test is not).
        while i < len(self.layers) and not (self.guard and bool(h.abs().max() > 1e6)):
            h = self.layers[i](h)
            i += 1
        return self.head(h)


def data() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 64, (24,), generator=g).tolist()} for _ in range(8)]


def test_untraceable_chain_falls_back_and_matches_traced(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="seqcal"):
        guarded = oneshot(model=Chain(guard=True), dataset=data(), recipe=RECIPE)
    assert any("layer by layer" in r.message for r in caplog.records)
    # The fallback calibrates layer by layer, as the layer cut does (not the default cut before modules).
    traced = oneshot(model=Chain(guard=False), dataset=data(), recipe=RECIPE, one_pass=False)
    for (name, a), (_, b) in zip(guarded.named_parameters(), traced.named_parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(guarded.layers[0].up.weight, Chain(guard=False).layers[0].up.weight)  # quantized


def test_fallback_with_weights_staged_off_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """With weights staged out of the model (the GPU path), the capture still runs on real weights."""
    import seqcal.execution.pipeline

    plain = oneshot(model=Chain(guard=True), dataset=data(), recipe=RECIPE)
    monkeypatch.setattr(seqcal.execution.pipeline, "_stage", lambda model, args: True)
    staged = oneshot(model=Chain(guard=True), dataset=data(), recipe=RECIPE)
    for (name, a), (_, b) in zip(staged.named_parameters(), plain.named_parameters()):
        assert a.device.type == "cpu" and torch.equal(a, b), name


class Skipping(Chain):
    """Not a chain: layer 1 is skipped, so its input is not the previous layer's output."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h1 = h2 = self.layers[0](h)
        while h2 is h1 and bool(h1.abs().max() < 1e6):  # value-dependent loop: untraceable
            h2 = self.layers[1](h) + h1
        return self.head(self.layers[2](h2))


def test_non_chain_stops_with_the_tracing_diagnostic() -> None:
    with pytest.raises(TracingError, match="layer-by-layer fallback"):
        oneshot(model=Skipping(guard=True), dataset=data(), recipe=RECIPE)
