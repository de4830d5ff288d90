"""A partition whose outputs differ from eager on a second, differently shaped sample is never used silently."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import seqcal.execution.cuts
import seqcal.execution.pipeline
import seqcal.execution.subgraphs
from seqcal import TracingError, oneshot, trace_subgraphs
from seqcal.execution.check_sample import CHECK_TOKENS, EXTRA_PAD, check_sample
from seqcal.execution.verify import _error
from seqcal.tracing import trace
from test_fallback import RECIPE, Chain, data

TRACE_LEN = 12


def _sample(batch: int = 1, length: int = TRACE_LEN) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, 64, (batch, length), generator=g),
        "attention_mask": torch.ones(batch, length, dtype=torch.long),
    }


class Residual(Chain):
    """Traceable, but not a chain: layer 2 reads layer 1's output plus the embedding."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h1 = self.layers[0](h)
        return self.head(self.layers[2](self.layers[1](h1) + h))


def _zero_after(x: torch.Tensor, length: int) -> torch.Tensor:
    """What a trace specialised to a length does: right on that length, wrong on longer inputs."""
    out = x.clone()
    out[:, length:] = 0
    return out


def _only_length(x: torch.Tensor, length: int) -> torch.Tensor:
    """What opaque code holding a value of the trace sample does: fail on another length."""
    if x.shape[1] != length:
        raise RuntimeError(f"expected {length} positions, got {x.shape[1]}")
    return x


def _specialised_trace(*args: Any, edit: Any = _zero_after, **kwargs: Any) -> Any:
    """``trace``, then the input of the second target goes through ``edit`` with the trace sample's length."""
    traced = trace(*args, **kwargs)
    second = next(n for n in traced.graph.nodes if n.op == "call_module" and n.target == traced.targets[1])
    with traced.graph.inserting_before(second):
        cut = traced.graph.call_function(edit, (second.args[0], TRACE_LEN))
    second.update_arg(0, cut)
    return traced


def test_check_sample_text_gets_another_batch_length_and_left_padding() -> None:
    sample = {
        **_sample(1, 100),
        "labels": torch.arange(100)[None],
        "token_type_ids": torch.ones(1, 100).long(),
    }
    check, what = check_sample(sample, pad_id=5)
    length = CHECK_TOKENS + EXTRA_PAD
    assert what == f"batch 2 x {length} tokens, left padding"
    assert check["input_ids"].shape == check["attention_mask"].shape == check["labels"].shape == (2, length)
    # row 0: the last CHECK_TOKENS tokens after EXTRA_PAD masked pad ids; row 1: a third of it more padding
    assert torch.equal(check["input_ids"][0, EXTRA_PAD:], sample["input_ids"][0, -CHECK_TOKENS:])
    assert check["input_ids"][0, :EXTRA_PAD].tolist() == [5] * EXTRA_PAD
    assert check["attention_mask"].sum(1).tolist() == [CHECK_TOKENS, CHECK_TOKENS - length // 3 + EXTRA_PAD]
    pads = check["attention_mask"] == 0
    assert (check["labels"][pads] == -100).all() and (check["token_type_ids"][pads] == 0).all()


@pytest.mark.parametrize("chunk", [1, 64, 1 << 20])
def test_error_summed_in_chunks_equals_the_error_of_the_whole_output(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    want = torch.randn(3, 50, 7, generator=g)
    got = want + 1e-3 * torch.randn(3, 50, 7, generator=g)
    got[2, 10, 3] = want[2, 10, 3] = float("inf")  # an entry infinite in both is left out of the norms
    finite = torch.isfinite(want)
    whole = float((got.double() - want.double())[finite].norm() / want.double()[finite].norm())
    assert 1e-4 < whole < 1e-2
    assert _error(got, want, chunk) == pytest.approx(whole, rel=1e-9)
    assert _error(got.bfloat16(), got.bfloat16(), chunk) == 0.0
    late = got.clone()
    late[2, 49, 6] = float("nan")  # non-finite in one output only, in the last chunk: differs
    assert _error(late, want, chunk) == float("inf")
    assert _error(torch.full((5,), float("inf")), torch.full((5,), float("inf")), chunk) == 0.0
    assert _error(got[:2], want, chunk) == float("inf")


def test_check_sample_keeps_the_batch_of_images_and_needs_a_sequence() -> None:
    sample = {**_sample(1, 12), "pixel_values": torch.randn(1, 3, 8, 8), "use_cache": False}
    check, what = check_sample(sample)
    assert what == f"batch 1 x {12 + EXTRA_PAD} tokens, left padding"
    assert check["pixel_values"] is sample["pixel_values"] and check["use_cache"] is False
    assert check["input_ids"][0, :EXTRA_PAD].tolist() == [int(sample["input_ids"][0, -1])] * EXTRA_PAD
    assert check_sample({"pixel_values": torch.randn(1, 3, 8, 8)}) is None


def test_trace_subgraphs_verifies_by_default(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="seqcal"):
        subgraphs = trace_subgraphs(Chain(guard=False), _sample())
    assert len(subgraphs) == 4
    assert any("partition matches the model's forward" in r.message for r in caplog.records)


def test_a_specialised_partition_is_refused_with_where_it_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Chain(guard=False)
    monkeypatch.setattr(seqcal.execution.subgraphs, "trace", _specialised_trace)
    # The trace sample itself cannot show it: on its length the partition is right.
    unchecked = trace_subgraphs(model, _sample(), verify=False)
    with torch.no_grad():
        torch.testing.assert_close(unchecked.run(**_sample()), model(**_sample()))
    with pytest.raises(TracingError) as err:
        trace_subgraphs(model, _sample())
    text = str(err.value)
    assert "inputs of layers.1 that differ from the model's own forward" in text
    assert f"batch 2 x {TRACE_LEN + EXTRA_PAD} tokens, left padding" in text
    assert "(the values up to layers.0 match)" in text and "verify=False" in text


def test_a_partition_that_fails_on_another_shape_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        seqcal.execution.subgraphs, "trace", lambda *a, **k: _specialised_trace(*a, edit=_only_length, **k)
    )
    with pytest.raises(TracingError) as err:
        trace_subgraphs(Chain(guard=False), _sample())
    text = str(err.value)
    assert "fails on a second sample (batch 2 x 15 tokens, left padding) on which the model's own" in text
    assert "RuntimeError" in text and "_only_length" in text


def test_weights_on_meta_are_not_verified(caplog: pytest.LogCaptureFixture) -> None:
    with torch.device("meta"):
        model = Chain(guard=False)
    with caplog.at_level(logging.INFO, logger="seqcal"):
        assert len(trace_subgraphs(model, _sample())) == 4
    assert any("not checked" in r.message for r in caplog.records)


def _specialise_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    real = seqcal.execution.pipeline.trace_subgraphs

    def specialised(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(seqcal.execution.subgraphs, "trace", _specialised_trace)
        try:
            return real(*args, **kwargs)
        finally:
            monkeypatch.setattr(seqcal.execution.subgraphs, "trace", trace)

    monkeypatch.setattr(seqcal.execution.pipeline, "trace_subgraphs", specialised)
    monkeypatch.setattr(seqcal.execution.cuts, "trace_subgraphs", specialised)  # the one-pass cut's trace


def _lengths() -> list[dict[str, list[int]]]:
    """Calibration texts of the trace sample's length, so only the check sample shows the difference."""
    return [{"input_ids": row[:TRACE_LEN]} for row in (d["input_ids"] for d in data())]


def test_oneshot_falls_back_from_a_partition_that_differs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One-pass cut differs -> layer cut; it differs too -> layer-by-layer capture, whose result is right."""
    _specialise_pipeline(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="seqcal"):
        checked = oneshot(model=Chain(guard=False), dataset=_lengths(), recipe=RECIPE)
    messages = [r.message for r in caplog.records]
    assert any("cutting at layers: the cut before each module group gives inputs of" in m for m in messages)
    assert any("layer by layer" in m and "differ from the model's own forward" in m for m in messages)
    monkeypatch.undo()
    layered = oneshot(model=Chain(guard=False), dataset=_lengths(), recipe=RECIPE, one_pass=False)
    for (name, a), (_, b) in zip(checked.named_parameters(), layered.named_parameters()):
        assert torch.equal(a, b), name


def test_oneshot_refuses_a_partition_that_differs_when_no_fallback_applies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(seqcal.execution.pipeline, "one_pass_subgraphs", lambda *a, **k: None)
    _specialise_pipeline(monkeypatch)
    model = Residual(guard=False)
    with pytest.raises(TracingError, match="differ from the model's own forward") as err:
        oneshot(model=model, dataset=_lengths(), recipe=RECIPE)
    assert "layer-by-layer fallback" in str(err.value)
    # verify=False: the user takes the partition as it is
    oneshot(model=Residual(guard=False), dataset=_lengths(), recipe=RECIPE, verify=False)


def test_offloaded_model_is_verified_within_its_weights(
    tokenized_llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="seqcal"):
        oneshot(
            model=str(tokenized_llama_dir), dataset=["some calibration text for a check"] * 2,
            recipe=RECIPE.replace("head, embed", "lm_head"), output_dir=str(tmp_path / "out"),
            max_seq_length=32,
        )  # fmt: skip
    assert any("matches the model's forward on a second batch" in r.message for r in caplog.records)
    assert (tmp_path / "out" / "config.json").is_file()


def test_cli_no_verify(tokenized_llama_dir: Path) -> None:
    base = [sys.executable, "-m", "seqcal.cli", "-v", "trace", "--model", str(tokenized_llama_dir)]
    checked = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stderr
    assert "partition matches the model's forward" in checked.stderr
    skipped = subprocess.run([*base, "--no-verify"], capture_output=True, text=True, timeout=300)
    assert skipped.returncode == 0, skipped.stderr
    assert "partition matches" not in skipped.stderr
    help_text = subprocess.run([sys.executable, "-m", "seqcal.cli", "oneshot", "--help"], capture_output=True,
                               text=True, timeout=120).stdout  # fmt: skip
    assert "--no-verify" in help_text


@pytest.mark.parametrize("name", ["verify", "one_pass"])
def test_switches_must_be_booleans(name: str) -> None:
    """A string such as "false" is truthy: it would silently mean True, so it is refused before any work."""
    with pytest.raises(ValueError, match=f"{name}='false' must be True or False"):
        oneshot(model=Chain(guard=False), dataset=data(), recipe=RECIPE, **{name: "false"})
