"""Host memory: a model loaded in RAM holds no checkpoint pages beside its quantized weights, and the host budget
(``max_host_memory``) picks the cache tier and the cut from the memory plan, or refuses before any weight is read."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from seqcal.entrypoint import ModelArgs, load_model, oneshot
from seqcal.modifiers import GPTQModifier
from seqcal.plan import PROCESS_BASELINE, MemoryPlan, SubgraphPlan
from seqcal.plan.host import BUDGET_MARGIN, HostBudgetError, check_budget, fit_host, floor_of
from test_oneshot import tiny_llama, token_data

GPTQ = "GPTQModifier: {scheme: W4A16, ignore: [lm_head]}"

MAPS = Path("/proc/self/maps")


def _mapped(path: Path) -> int:
    """Bytes of ``path`` mapped into this process (/proc/self/maps)."""
    total = 0
    for line in MAPS.read_text().splitlines():
        if line.endswith(str(path)):
            lo, _, hi = line.split()[0].partition("-")
            total += int(hi, 16) - int(lo, 16)
    return total


def _storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the model's parameters."""
    seen = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(seen.values())


@pytest.mark.skipif(not MAPS.is_file(), reason="reads /proc/self/maps (Linux)")
def test_a_model_in_ram_keeps_no_checkpoint_pages(tmp_path: Path) -> None:
    """The run in RAM replaces each quantized weight: the checkpoint's mapping must not outlive the load, or the
    process holds the original beside every quantized weight (RSS rising subgraph by subgraph)."""
    tiny_llama().save_pretrained(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    model, _, store = load_model(ModelArgs(str(tmp_path / "model")))
    assert store is None and _mapped(weights) == 0
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert _storage_bytes(model) == params
    oneshot(model=model, dataset=token_data(4), recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
            max_seq_length=32, output_dir=str(tmp_path / "out"))  # fmt: skip
    # every finished subgraph's weights replaced, nothing of the originals kept: the same bytes as before
    assert _mapped(weights) == 0 and _storage_bytes(model) == params


# -- the budget: parsed, refused, fitted from the plan ------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("budget-model")
    tiny_llama().save_pretrained(path)
    return path


def room(usable: int) -> int:
    """The least budget the plan may fill up to ``usable`` bytes of (the plan keeps ``BUDGET_MARGIN`` free)."""
    return int(usable / (1 - BUDGET_MARGIN)) + 1


def _plan(model_dir: Path, **kwargs: object) -> MemoryPlan:
    args = {"num_calibration_samples": 64, "max_seq_length": 64, "batch_size": 1, **kwargs}
    return oneshot(model=str(model_dir), recipe=GPTQ, dataset=[], dry_run=True, **args)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("12 gigs", "max_host_memory='12 gigs': give bytes or a size"),
        ("-1GB", "not a budget: give a positive"),
        (0, "not a budget"),
    ],  # fmt: skip
)
def test_a_budget_that_is_no_size_is_refused_in_one_sentence(value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        oneshot(model="no-such-model-dir", recipe=GPTQ, dataset=[], dry_run=True, max_host_memory=value)
    assert str(err.value).count(". ") == 0  # one sentence, raised before the model is looked up


def test_a_budget_above_the_machine_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="seqcal"):
        assert check_budget(10**15, 16 * 10**9) == 10**15
    assert "more than this machine's RAM (16.00 GB)" in caplog.text


def test_the_budget_caps_the_cache_or_is_refused_with_the_smallest_that_works(model_dir: Path) -> None:
    whole = _plan(model_dir)
    floor, _ = floor_of(whole)
    cache = max(r.cache_ram for r in whole.rows)
    assert cache > 0 and whole.host_peak > floor
    # generous: nothing changes
    assert _plan(model_dir, max_host_memory=room(whole.host_peak)).host_peak == whole.host_peak
    # between the floor and the whole plan: the cache's RAM is capped, the peak kept, the rest planned on disk
    budget = room(floor + cache // 2)
    capped = _plan(model_dir, max_host_memory=budget)
    assert capped.host_peak <= budget * (1 - BUDGET_MARGIN) < whole.host_peak
    assert max(r.cache_ram for r in capped.rows) < cache and capped.disk > whole.disk
    # below the floor of both cuts: refused, naming the smallest budget, which is then accepted
    layer_floor, _ = floor_of(_plan(model_dir, one_pass=False))
    smallest = min(floor, layer_floor)
    with pytest.raises(HostBudgetError, match=rf"needs at least {smallest / 1e9:.2f} GB even with the activation "
                                              r"cache on disk, most of it the process itself") as err:  # fmt: skip
        _plan(model_dir, max_host_memory=smallest - 10**6)
    assert _plan(model_dir, max_host_memory=room(smallest)).host_peak <= smallest
    least = float(re.search(r"raise max_host_memory to ([0-9.]+) GB", str(err.value)).group(1)) * 1e9
    assert smallest < least <= room(smallest) + 10**7  # the floor and the margin, rounded up to 0.01 GB
    assert _plan(model_dir, max_host_memory=least).host_peak <= least * (1 - BUDGET_MARGIN)


def _row(index: int, work: int, cache: int) -> SubgraphPlan:
    row = SubgraphPlan(index, [f"layers.{index}"], work, 0, 0, cache)
    row.work, row.cache_ram, row.host = work, cache, PROCESS_BASELINE + work + cache
    return row


def test_the_other_cut_is_taken_when_only_it_fits() -> None:
    """A one-pass plan whose floor is over the budget switches to a layer cut whose floor fits, and says why."""
    mb = 10**6
    one_pass = MemoryPlan([_row(0, 500 * mb, 100 * mb)], PROCESS_BASELINE + 600 * mb, 0, one_pass=True)
    layers = MemoryPlan([_row(0, 200 * mb, 300 * mb)], PROCESS_BASELINE + 500 * mb, 0)
    budget, layers_peak = room(PROCESS_BASELINE + 400 * mb), layers.host_peak
    fit = fit_host(budget, one_pass, one_pass=True, other_cut=lambda: layers)
    assert not fit.one_pass and fit.cache_max_memory == 200 * mb
    assert fit.plan.host_peak == PROCESS_BASELINE + 400 * mb  # the budget less its margin
    assert fit.plan.disk == 100 * mb and len(fit.decisions) == 2
    assert fit.decisions[0].startswith(
        f"max_host_memory {budget / 1e9:.2f} GB: the layer cut instead of the one-pass"
    )
    assert (
        f"spills the rest to disk (all in RAM the peak would be {layers_peak / 1e9:.2f} GB)"
        in fit.decisions[1]
    )
    # a lower cap the user asked for is kept
    assert (
        fit_host(budget, layers, one_pass=False, other_cut=None, cache_max_memory=mb).cache_max_memory == mb
    )


def test_the_report_has_the_predicted_and_measured_peak(model_dir: Path, tmp_path: Path) -> None:
    whole = _plan(model_dir, num_calibration_samples=4, max_seq_length=32)
    budget = room(floor_of(whole)[0] + max(r.cache_ram for r in whole.rows) // 2)
    oneshot(model=str(model_dir), recipe=GPTQ, dataset=token_data(4), max_seq_length=32, batch_size=1,
            output_dir=str(tmp_path / "out"), max_host_memory=budget)  # fmt: skip
    report = json.loads((tmp_path / "out" / "quantization_report.json").read_text())["host_memory"]
    assert report["max_host_memory"] == budget and report["predicted_peak"] <= budget
    assert 0 < report["cache_max_memory"] < max(r.cache_ram for r in whole.rows) and report["one_pass"]
    assert report["measured_peak"] >= 100 * 2**20  # the process's own peak (torch alone is more)
    assert any("spills the rest to disk" in line for line in report["decisions"])


def test_a_model_loaded_whole_is_refused_before_its_weights_are_read(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import seqcal.multimodal.classes as classes

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights read before the budget was checked")

    monkeypatch.setattr(classes, "from_pretrained", refuse)
    with pytest.raises(
        HostBudgetError, match="loaded whole into RAM .no output_dir. and its weights alone take"
    ):
        oneshot(model=str(model_dir), recipe=GPTQ, dataset=token_data(4), max_host_memory="100MB")


def test_the_command_line_refuses_a_budget_in_one_line_with_the_smallest_that_works(model_dir: Path) -> None:
    from test_cli import assert_user_error, seqcal

    line = assert_user_error(
        seqcal("plan", "--model", str(model_dir), "--recipe", GPTQ, "--max-host-memory", "100MB"),
        "max_host_memory=0.10 GB cannot be kept: the memory plan needs at least", "raise max_host_memory to",
    )  # fmt: skip
    assert line.count(". ") == 0
