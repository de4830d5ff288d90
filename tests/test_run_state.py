"""The run state: a frozen configuration, results, a fold ledger, and no per-batch field.

Each batch's token mask reaches a modifier as an argument (``observe``) or through the run's batch cursor
(hooks registered in ``calibrate``), and nowhere else: a padded batch's mask is the one the modifier sees, and
no mask is left behind once a pass is over.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from save_helpers import save_llama
from seqcal.entrypoint import oneshot
from seqcal.mappings import Mapping
from seqcal.modifiers import Batch, BatchCursor, QuantizationModifier, RunState
from seqcal.modifiers.state import FoldLedger, RunConfig
from seqcal.tracing.partition import Subgraph

LENGTHS = (24, 17, 9)  # one batch of three rows: two of them padded


@dataclass
class _SeesMasks(QuantizationModifier):
    """Round to nearest that notes the token mask of every batch it sees, by observe and by a hook."""

    needs_calibration: ClassVar[bool] = True
    seen: list[tuple[str, torch.Tensor | None]] = field(default_factory=list)
    cursors: list[BatchCursor] = field(default_factory=list)

    def observe(self, names: list[str], x: torch.Tensor, state: RunState, batch: Batch) -> None:
        if names[0].endswith("q_proj"):  # one group per layer: once per batch and layer
            self.seen.append(("observe", batch.token_mask))

    @contextlib.contextmanager
    def calibrate(
        self, subgraph: Subgraph, model: torch.nn.Module, state: RunState, batches: BatchCursor
    ) -> Iterator[None]:
        self.cursors.append(batches)
        names = [n for n in self.modules_in(subgraph) if n.endswith("q_proj")]
        hooks = [
            model.get_submodule(n).register_forward_pre_hook(
                lambda *_: self.seen.append(("hook", batches.current.token_mask))
            )
            for n in names
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama"), 2)


def _rows() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in LENGTHS]


@pytest.mark.parametrize(("one_pass", "how"), [(True, "observe"), (False, "hook")])
def test_each_batch_brings_its_own_token_mask(model_dir: Path, one_pass: bool, how: str) -> None:
    modifier = _SeesMasks(scheme="W8A16", ignore=["lm_head"])
    pads = SimpleNamespace(pad_token_id=0, eos_token_id=0)  # token ids only: the rows are tokenized
    oneshot(model=str(model_dir), dataset=_rows(), recipe=modifier, batch_size=3, max_seq_length=24,
            one_pass=one_pass, tokenizer=pads)  # fmt: skip
    masks = [mask for kind, mask in modifier.seen if kind == how]
    assert len(masks) == 2 and {kind for kind, _ in modifier.seen} == {how}  # one batch, two layers
    for mask in masks:  # the padded batch's mask, real tokens only
        assert mask is not None and mask.shape == (3, 24)
        assert sorted(mask.sum(dim=1).tolist()) == sorted(LENGTHS)
    for cursor in modifier.cursors:  # nothing left behind once the passes are over
        assert cursor.current.token_mask is None


def test_the_configuration_is_frozen_and_shared_parts_stay_shared() -> None:
    state = RunState()
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.config.device = torch.device("meta")  # type: ignore[misc]
    looped = state.with_config(device_budget=1 << 20)
    assert looped.config.device_budget == 1 << 20 and state.config.device_budget is None
    assert looped.results is state.results and looped.ledger is state.ledger
    assert {f.name for f in dataclasses.fields(RunState)} == {"config", "results", "ledger"}
    assert RunConfig().kv_cache_scheme is None


def test_the_ledger_records_folds_in_order() -> None:
    ledger = FoldLedger()
    first = ledger.record(Mapping("norm", ("q", "k"), "norm"), torch.full((4,), 2.0))
    start = len(ledger.folds)
    second = ledger.record(Mapping("up", ("down",), "linear"), torch.ones(4, dtype=torch.float16))
    ledger.divide(3, second)
    assert ledger.since(start) == [second] and ledger.folds == [first, second]
    assert ledger.edited == {"norm", "up"} and ledger.changed == {"q", "k", "down"}
    assert ledger.divided == {3: [second]} and second.scales.dtype == torch.float32


def test_the_cursor_walks_a_loop_and_clears_on_error() -> None:
    cursor = BatchCursor()
    masks = [torch.tensor([[True, False]]), None]
    got = [cursor.current.token_mask for _ in cursor.over(masks, Batch)]
    assert got[0] is masks[0] and got[1] is None and cursor.current.token_mask is None
    with pytest.raises(RuntimeError), cursor.at(Batch(masks[0])):
        assert cursor.current.token_mask is masks[0]
        raise RuntimeError("a failing batch")
    assert cursor.current.token_mask is None
