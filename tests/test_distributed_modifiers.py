"""Every modifier's statistics reduce across processes: the same checkpoint bytes for 1, 2 and 4 processes.

SmoothQuant's channel ranges (a transform: reduced on every process, which each folds), SparseGPT's Hessians,
Wanda's squared norms, imatrix_mse's sums of ``x^2`` and the KV cache's key / value ranges (their scales sent
from each layer's owner to the other processes) go through ``Modifier.partial_statistics`` like GPTQ's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from dist_helpers import data, run, start, tensor_hashes, wait_all
from save_helpers import save_llama
from seqcal.distributed.plan import world_rows
from seqcal.distributed.reduce import fold, tensors_of
from seqcal.distributed.run import ShardedRun
from seqcal.entrypoint import oneshot
from seqcal.modifiers import contract
from seqcal.modifiers.base import Modifier, RunState

SAMPLES = 5  # 5 shards: 2 processes run 2 and 3, 4 processes 1, 1, 1 and 2
KV = "kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}"
SMOOTH = "SmoothQuantModifier: {smoothing_strength: 0.5}\n"
RECIPES = {
    # a transform in the one-pass cut (cached inputs), then GPTQ's Hessians in the new coordinates
    "smoothquant": SMOOTH + "GPTQModifier: {scheme: W8A16, ignore: [lm_head], block_size: 32}",
    # the layer cut (the KV cache is observed inside attention): the transform's own pass, per shard
    "smoothquant-kv": SMOOTH + "GPTQModifier: {scheme: W8A16, ignore: [lm_head], block_size: 32, " + KV + "}",
    "kv-rtn": "QuantizationModifier: {scheme: W8A16, ignore: [lm_head], " + KV + "}",
    "sparsegpt": "SparseGPTModifier: {sparsity: 0.5, mask_structure: '2:4', ignore: ['re:.*lm_head'], block_size: 32}",
    "wanda": "WandaPruningModifier: {sparsity: 0.5, ignore: ['re:.*lm_head']}",
    "imatrix": "QuantizationModifier: {scheme: W4A16, ignore: [lm_head], weight_observer: imatrix_mse}",
    # activation sums, then the grid search's losses per candidate in a second round per mapping
    "awq": "AWQModifier: {scheme: W4A16_ASYM, ignore: [lm_head], n_grid: 6}",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama"), 2)


def _args(model: Path, out: Path, recipe: str) -> dict:
    return {"model": str(model), "dataset": data(SAMPLES, 24), "recipe": recipe, "max_seq_length": 24,
            "output_dir": str(out)}  # fmt: skip


def _drop_the_last_shard(rank: int) -> None:
    """One process, the statistics of the last shard never handed over (a reduction that misses a process)."""
    collect = ShardedRun.collect

    def collect_all_but_last(self: ShardedRun, index: int, shard: int, modifiers: list, device: torch.device,
                             **kwargs: object) -> None:  # fmt: skip
        if shard == self.plan.shards - 1:
            for m in modifiers:
                # taken and thrown away, declared statistics too: the shard adds nothing to the fold
                contract.partial_statistics(m)
        collect(self, index, shard, modifiers, device, **kwargs)

    ShardedRun.collect = collect_all_but_last  # in the forked child only


# a transform whose consumers are its quantizer's modules too, and the pruning modifiers
OWNERS_CHECKED = ("smoothquant", "sparsegpt", "wanda")


def _check_owners(name: str, model_dir: Path, out: Path) -> None:
    """The owners of the 2-process run in ``out`` are those ``seqcal plan --world-size 2`` predicts."""
    report = json.loads((out / "quantization_report.json").read_text())["distributed"]
    plan = oneshot(model=str(model_dir), recipe=RECIPES[name], num_calibration_samples=SAMPLES, max_seq_length=24,
                   dry_run=True, dataset=[])  # fmt: skip
    assert [r["owner"] for r in world_rows(plan, 2, 8, SAMPLES, plan.dtype_bytes)] == report["owners"]
    assert set(report["owners"]) == {0, 1}  # the solves are spread


@pytest.mark.parametrize("name", list(RECIPES))
def test_same_bytes_for_1_and_2_processes(name: str, model_dir: Path, tmp_path: Path) -> None:
    """Per-tensor SHA-256 of the checkpoint equal for 1 and 2 processes (and 4 for the KV-cache recipe),
    with the owners ``seqcal plan`` predicts (``OWNERS_CHECKED``); negative control: without the last shard's
    statistics some tensor differs, so the equality can fail."""
    worlds = (1, 2, 4) if name == "kv-rtn" else (1, 2)  # 4 processes where a run is cheapest
    hashes = {}
    for world in worlds:
        run(world, tmp_path / f"err{world}", **_args(model_dir, tmp_path / f"w{world}", RECIPES[name]))
        hashes[world] = tensor_hashes(tmp_path / f"w{world}")
    assert len(hashes[1]) > 10
    if "kv" in name:
        assert sum(k.endswith((".k_scale", ".v_scale")) for k in hashes[1]) == 4
    for world in worlds[1:]:
        differing = [k for k in hashes[1] if hashes[world].get(k) != hashes[1][k]]
        assert hashes[world].keys() == hashes[1].keys() and not differing, (world, differing[:5])
    if name in OWNERS_CHECKED:
        _check_owners(name, model_dir, tmp_path / "w2")
    run(
        1,
        tmp_path / "err_missing",
        _drop_the_last_shard,
        **_args(model_dir, tmp_path / "missing", RECIPES[name]),
    )
    missing = tensor_hashes(tmp_path / "missing")
    assert missing.keys() == hashes[1].keys()
    assert [k for k in missing if missing[k] != hashes[1][k]], "dropping a shard's statistics changed no byte"


def _gram_always(rank: int) -> None:
    import seqcal.modifiers.awq_search as awq_search

    awq_search.GRAM_TOKENS_PER_INPUT = 0.0  # in the forked child only: down_proj scored from its Gram matrix


def test_awq_gram_spans_give_the_same_bytes_for_1_and_2_processes(model_dir: Path, tmp_path: Path) -> None:
    """The Gram matrix of a single-Linear span is folded over the shards of every process in shard order."""
    for world in (1, 2):
        run(
            world,
            tmp_path / f"err{world}",
            _gram_always,
            **_args(model_dir, tmp_path / f"w{world}", RECIPES["awq"]),
        )
    one, two = tensor_hashes(tmp_path / "w1"), tensor_hashes(tmp_path / "w2")
    assert len(one) > 10 and one == two


@pytest.mark.parametrize(("samples", "shards"), [(8, 2), (6, 5)])
def test_awq_screening_gives_the_same_bytes_for_1_and_2_processes(
    samples: int, shards: int, model_dir: Path, tmp_path: Path
) -> None:
    """The screening calls are counted per virtual shard (every 2nd screens), and both rounds reduce over every
    process: one process's bytes from two, with the grid screened (the report says how many points each span
    search left out). 6 batches in 5 shards (1, 1, 1, 1, 2 batches): the first process holds only shards whose
    one batch screens, the second a shard with a batch left for the shortlist; both take both rounds."""
    recipe = (
        "AWQModifier: {scheme: W4A16_ASYM, ignore: [lm_head], n_grid: 6, screen_every: 2, screen_keep: 1}"
    )
    for world in (1, 2):
        kwargs = {**_args(model_dir, tmp_path / f"w{world}", recipe), "dataset": data(samples, 24),
                  "num_shards": shards}  # fmt: skip
        run(world, tmp_path / f"err{world}", **kwargs)
    one, two = tensor_hashes(tmp_path / "w1"), tensor_hashes(tmp_path / "w2")
    assert len(one) > 10 and one == two
    modules = json.loads((tmp_path / "w2" / "quantization_report.json").read_text())["modules"]
    screened = [e["awq_screened"] for e in modules.values() if e.get("awq_screened")]
    # q/k/v, gate/up and down_proj (too few tokens for its Gram matrix) per layer; the identity and the best
    # screened point kept (one point when they are the same)
    assert len(screened) == 2 * 6 and set(screened) <= {6 - 2, 6 - 1}, screened


def _search_on_own_shards(rank: int) -> None:
    """AWQ's second round without communication: each process scores the candidates on its own shards only."""

    def local(self: RunState, per_shard: list) -> dict:
        total = None
        for partial in per_shard:
            total = fold(total, partial)
        return tensors_of(total or {})

    RunState.reduce_shards = local  # in the forked child only


def test_negative_control_awq_losses_of_one_process_change_bytes(model_dir: Path, tmp_path: Path) -> None:
    """The second round matters: with each of 2 processes choosing its scales from its own shards' losses,
    the checkpoint differs from one process's."""
    run(1, tmp_path / "err1", **_args(model_dir, tmp_path / "one", RECIPES["awq"]))
    run(2, tmp_path / "err2", _search_on_own_shards, **_args(model_dir, tmp_path / "own", RECIPES["awq"]))
    one, own = tensor_hashes(tmp_path / "one"), tensor_hashes(tmp_path / "own")
    assert one.keys() == own.keys()
    assert [k for k in one if one[k] != own[k]], "choosing scales from one process's shards changed no byte"


@dataclass
class _Unshared(Modifier):
    """A modifier that gathers statistics from data but hands none over (``shares_statistics`` is False)."""

    name: ClassVar[str] = "UnsharedStats"
    needs_calibration: ClassVar[bool] = True


def test_a_modifier_whose_statistics_do_not_reduce_is_refused_with_two_processes(
    model_dir: Path, tmp_path: Path
) -> None:
    args = {**_args(model_dir, tmp_path / "out", ""), "recipe": [_Unshared()]}
    codes = wait_all(start(2, [args] * 2, tmp_path / "err"), timeout=120)
    assert codes == [1, 1]
    for rank in (0, 1):
        first = (tmp_path / "err" / f"rank{rank}.txt").read_text().splitlines()[0]
        assert "UnsharedStats gathers statistics that do not yet reduce across processes" in first, first
    assert not (tmp_path / "out" / "config.json").exists()


def test_plan_for_several_processes_of_a_newly_reducing_recipe(model_dir: Path, tmp_path: Path) -> None:
    """``seqcal plan --world-size 2`` (batch size left to the plan) prints the per-process table."""
    import subprocess
    import sys

    from dist_helpers import env_for_cli

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPES["smoothquant-kv"] + "\n")
    cli = [sys.executable, "-m", "seqcal.cli", "plan", "--model", str(model_dir), "--recipe", str(recipe),
           "--num-calibration-samples", "6", "--max-seq-length", "24", "--world-size", "2"]  # fmt: skip
    done = subprocess.run(cli, env=env_for_cli(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 processes, 6 virtual shards of 6 batches" in done.stdout
    assert "total: reduced" in done.stdout


class _Stopped(Exception):
    pass


@pytest.mark.parametrize("name", ["wanda", "smoothquant-kv"])
def test_a_stopped_run_resumed_by_two_processes_gives_the_uninterrupted_bytes(
    name: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replayed subgraphs' changes besides quantized weights (pruned weights, folded norms, k_scale /
    v_scale) reach every process: without them the other process would calibrate on another model."""
    import seqcal.checkpoint.streaming as streaming

    run(1, tmp_path / "err_clean", **_args(model_dir, tmp_path / "clean", RECIPES[name]))
    total = len(json.loads((tmp_path / "clean" / "quantization_report.json").read_text())["subgraphs"])
    out, calls = tmp_path / "stopped", []
    monkeypatch.setattr(streaming, "CHECKPOINT_BYTES", 1)  # progress recorded after every subgraph
    done = streaming.StreamingCheckpoint.done

    def stops(self: streaming.StreamingCheckpoint, sg: object) -> None:
        done(self, sg)
        calls.append(sg)
        if len(calls) == total // 2:
            raise _Stopped  # as a crash midway would

    monkeypatch.setattr(streaming.StreamingCheckpoint, "done", stops)
    with pytest.raises(_Stopped):
        oneshot(**_args(model_dir, out, RECIPES[name]))
    monkeypatch.setattr(streaming.StreamingCheckpoint, "done", done)
    run(2, tmp_path / "err_resume", **_args(model_dir, out, RECIPES[name]), resume=True)
    assert tensor_hashes(out) == tensor_hashes(tmp_path / "clean")
