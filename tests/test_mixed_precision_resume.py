"""Mixed precision gives the same checkpoint, config.json, replay recipe and allocation report whether the run was
stopped and resumed, or run by one process or two (``MixedPrecision.catch_up``: each choice's error curve travels
with its modules' report entries to the other processes and into the resume files), with GPTQ solving each
module at its chosen width, with round to nearest, and with AWQ smoothing and rounding at the chosen widths.

The allocation spends a budget as the pass goes, so a run that lost the curves and budget spent before a stop (or
that another process solved) would choose differently after it: the tiny Llama's second layer is scaled down, so
the choices are not all one width and depend on what is left.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dist_helpers import data, run, stopped_after, tensor_hashes
from seqcal.entrypoint import oneshot
from seqcal.modifiers import MixedPrecisionModifier, QuantizedWeight
from seqcal.modifiers.base import RunState
from seqcal.modifiers.mixed_allocator import ALLOCATION_KEY, RECIPE_FILENAME

CANDIDATES = ["W2A16:g32", "W3A16:g32", "W4A16:g32", "W8A16:channel"]
MIXED = f"average_bits: 3.6, candidates: {json.dumps(CANDIDATES)}"
# the same choice made for GPTQ (MixedPrecisionModifier) and for round to nearest (QuantizationModifier's argument)
RECIPES = {
    "gptq": f"MixedPrecisionModifier: {{{MIXED}, ignore: [lm_head]}}",
    "rtn": f"QuantizationModifier: {{mixed_precision: {{{MIXED}}}, ignore: [lm_head]}}",
    "awq": f"AWQModifier: {{mixed_precision: {{{MIXED}}}, ignore: [lm_head]}}",
}
# per-module report entries that are measurements of time, not results
TIMES = ("gptq_seconds",)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (64 -> 128) whose second layer adds little to the residual stream."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for module in model.model.layers[1].modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(0.05)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=sorted(RECIPES))
def solver(request: pytest.FixtureRequest) -> str:
    return request.param


def _args(model_dir: Path, out: Path, solver: str, **extra: object) -> dict:
    recipe = "quant_stage:\n  quant_modifiers:\n    " + RECIPES[solver] + "\n"
    return {"model": str(model_dir), "dataset": data(4, 24), "recipe": recipe, "max_seq_length": 24,
            "output_dir": str(out), **extra}  # fmt: skip


def _entries(out: Path) -> dict[str, dict]:
    """The report's entries of the quantized modules, without the times."""
    modules = json.loads((out / "quantization_report.json").read_text())["modules"]
    return {n: {k: v for k, v in e.items() if k not in TIMES} for n, e in modules.items() if "scheme" in e}


def _same_result(out: Path, reference: Path) -> None:
    assert tensor_hashes(out) == tensor_hashes(reference)
    for name in ("config.json", RECIPE_FILENAME):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert _entries(out) == _entries(reference)


@pytest.fixture(scope="module")
def single(model_dir: Path, solver: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, never interrupted: the reference."""
    out = tmp_path_factory.mktemp("runs") / "single"
    oneshot(**_args(model_dir, out, solver))
    return out


def test_the_allocation_mixes_widths_and_records_each_choice(single: Path) -> None:
    entries = _entries(single)
    assert len(entries) == 14 and len({e["scheme"] for e in entries.values()}) >= 2, entries
    steps = sorted(e[ALLOCATION_KEY]["step"] for e in entries.values() if ALLOCATION_KEY in e)
    assert steps == list(range(8))  # q/k/v, o, gate/up, down per layer: one record per unit, in order
    block = json.loads((single / "config.json").read_text())["quantization_config"]
    assert len(block["config_groups"]) >= 2


def test_stopped_at_several_subgraphs_and_resumed_gives_the_uninterrupted_result(
    model_dir: Path, solver: str, single: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One directory stopped after subgraph 1, then by its resumed runs after 3 and 6, then finished by two
    processes: every resume continues the allocation with the budget and curves the stopped run had (the process
    that does not read the resume files gets them with the replayed modules)."""
    out = tmp_path / "stopped"
    stops = ((1, False), (2, True)) if solver == "awq" else ((1, False), (2, True), (3, True))  # AWQ: 3 subgraphs
    for stop, resume in stops:
        stopped_after(monkeypatch, stop, **_args(model_dir, out, solver, resume=resume))
    run(2, tmp_path / "err", **_args(model_dir, out, solver, resume=True))
    _same_result(out, single)


@pytest.mark.parametrize("one_pass", [True, False])
def test_same_result_for_1_and_2_processes(
    model_dir: Path, solver: str, single: Path, tmp_path: Path, one_pass: bool
) -> None:
    """The one-pass cut (each subgraph one unit, solved by its owner) and the layer cut (a layer's units, which
    several processes would otherwise solve side by side, on one process in module order)."""
    reference = single
    if not one_pass:
        reference = tmp_path / "single"
        oneshot(**_args(model_dir, reference, solver, one_pass=False))
    two = tmp_path / "two"
    run(2, tmp_path / "err", **_args(model_dir, two, solver, one_pass=one_pass))
    _same_result(two, reference)
    owners = json.loads((two / "quantization_report.json").read_text())["distributed"]["owners"]
    assert set(owners) == {0, 1}  # the other process solved some subgraphs


def test_a_missing_or_contradicted_record_stops_the_run(model_dir: Path) -> None:
    """A unit quantized without a record of its choice (a resume file of an older seqcal), or whose recorded curve
    gives another scheme here, would let the allocation continue from another state: refused."""
    modifier = MixedPrecisionModifier(average_bits=3.6, candidates=CANDIDATES, ignore=["lm_head"])
    modifier.validate(LlamaForCausalLM.from_pretrained(model_dir))
    key, members = next(iter(modifier.mixed.units.items()))
    state = RunState()
    for m in members:
        state.results.quantized[m] = QuantizedWeight(torch.empty(0), torch.empty(0), None, None, None)
    with pytest.raises(RuntimeError, match="without a record of its allocation"):
        modifier.mixed.catch_up(modifier.modules, state)
    errors = [0.0, 1.0, 2.0, 3.0]  # the fewest bits have the least error: the cheapest candidate is chosen
    state.results.module_errors[members[0]] = {"scheme": CANDIDATES[-1], "allocation": {"unit": key, "step": 0,
                                                                                       "errors": errors}}  # fmt: skip
    with pytest.raises(RuntimeError, match="its recorded curve chooses W2A16:g32"):
        modifier.mixed.catch_up(modifier.modules, state)
