"""A resume finishes with the choices of the interrupted run that change float32 roundings but not the run's
identity: GPTQ's factor in the Hessians' own memory, which a host budget chooses from a plan whose process baseline
moves by a few MB between processes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import seqcal.checkpoint.streaming as streaming
import seqcal.entrypoint as entrypoint
import seqcal.modifiers.gptq as gptq
from dist_helpers import data
from save_helpers import save_llama
from seqcal.plan.host import HostBudgetError

RECIPE = "GPTQModifier: {scheme: W4A16, ignore: [lm_head]}"


class Stop(Exception):
    """Stands for a kill in the middle of the run."""


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """``runs["run"](resume, in_place, stop_after)``: a oneshot whose budget chose (or not) the in-place factor,
    stopped after ``stop_after`` GPTQ solves; ``runs["calls"]``: in_place_factor of every solve."""
    monkeypatch.setattr(streaming, "CHECKPOINT_BYTES", 1)  # every finished subgraph recorded
    model, fit, solve = save_llama(tmp_path / "model", 2), entrypoint.fit_host, gptq.gptq_quantize
    calls: list[bool] = []
    limit = {"stop_after": None}

    def recording(*args, **kwargs):
        calls.append(kwargs["in_place_factor"])
        if limit["stop_after"] is not None and len(calls) > limit["stop_after"]:
            raise Stop
        return solve(*args, **kwargs)

    monkeypatch.setattr(gptq, "gptq_quantize", recording)

    def run(resume: bool, in_place: bool | None, stop_after: int | None = None) -> None:
        def chosen(*args, **kwargs):  # as if the budget had needed it
            fitted = fit(*args, **kwargs)
            fitted.plan.in_place_factor = in_place
            return fitted

        monkeypatch.setattr(entrypoint, "fit_host", chosen)
        limit["stop_after"] = stop_after
        budget = {"max_host_memory": "20GB"} if in_place is not None else {}
        entrypoint.oneshot(model=str(model), recipe=RECIPE, dataset=data(4), max_seq_length=32,
                           output_dir=str(tmp_path / "out"), resume=resume, **budget)  # fmt: skip

    return {"run": run, "calls": calls, "out": tmp_path / "out"}


def test_a_resume_without_the_budget_keeps_the_in_place_factor_the_run_chose(runs, caplog) -> None:
    with pytest.raises(Stop):
        runs["run"](False, True, stop_after=4)  # the first layer's solves, then a kill
    progress = json.loads((runs["out"] / "seqcal_progress.json").read_text())["progress"]
    assert progress["finished"] >= 0 and progress["choices"] == {"in_place_factor": True}
    runs["calls"].clear()
    caplog.set_level(logging.INFO, logger="seqcal")
    runs["run"](True, None)  # the same command without the budget
    assert runs["calls"] and all(runs["calls"])
    assert any("as the interrupted run chose it" in r.message for r in caplog.records)
    assert (runs["out"] / "config.json").is_file()


def test_a_resume_whose_budget_needs_another_factor_is_refused_before_any_work(runs) -> None:
    with pytest.raises(Stop):
        runs["run"](False, None, stop_after=4)  # LAPACK's factor, no budget
    runs["calls"].clear()
    with pytest.raises(HostBudgetError, match="resume it with the max_host_memory it was started with"):
        runs["run"](True, True)
    assert runs["calls"] == []
