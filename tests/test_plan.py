"""The memory plan (``oneshot(dry_run=True)``, ``seqcal plan``): what it predicts and how it picks targets."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from seqcal.cli import main
from seqcal.entrypoint import oneshot
from seqcal.execution.store import WeightStore
from seqcal.plan import MemoryPlan

LAYERS, HIDDEN, INTER = 3, 128, 512
GPTQ = "GPTQModifier: {scheme: W4A16, ignore: [lm_head]}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    path = tmp_path_factory.mktemp("plan-model")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _plan(model_dir: Path, **kwargs: object) -> MemoryPlan:
    # one sample per batch, the default on the CPU, also where CUDA makes "auto" the default (other batches,
    # and a note about them)
    args = {"num_calibration_samples": 16, "max_seq_length": 64, "batch_size": 1, **kwargs}
    return oneshot(model=str(model_dir), recipe=GPTQ, dataset=[], dry_run=True, **args)


def test_dry_run_reads_no_weight(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: WeightStore, name: str) -> torch.Tensor:
        raise AssertionError(f"dry_run read weight {name}")

    monkeypatch.setattr(WeightStore, "read", refuse)
    plan = _plan(model_dir)
    assert isinstance(plan, MemoryPlan) and plan.rows and plan.device_peak > 0 and plan.host_peak > 0


def test_plan_follows_the_run_cut_and_counts_each_weight(model_dir: Path) -> None:
    one_pass, layers = _plan(model_dir), _plan(model_dir, one_pass=False)
    assert (
        len(one_pass.rows) == 4 * LAYERS + 1
    )  # before q/k/v, o, gate/up, down of each layer, plus the start
    assert len(layers.rows) == LAYERS + 1
    mlp_bytes = 3 * HIDDEN * INTER * 4  # gate, up, down in float32
    # A layer-cut subgraph holds its whole layer; no one-pass subgraph holds more than one layer's MLP.
    assert max(r.weights for r in layers.rows[:LAYERS]) > mlp_bytes
    assert all(r.weights < mlp_bytes for r in one_pass.rows[1:])
    assert "peak: device" in one_pass.table() and len(one_pass.table().splitlines()) == len(one_pass.rows) + 2


def test_cache_grows_with_samples_and_goes_to_disk(model_dir: Path) -> None:
    small, big = _plan(model_dir, num_calibration_samples=8), _plan(model_dir, num_calibration_samples=32)
    assert max(r.host_cache for r in big.rows) == pytest.approx(
        4 * max(r.host_cache for r in small.rows), rel=0.05
    )
    on_disk = _plan(model_dir, num_calibration_samples=32, offload="disk")
    assert all(r.host_cache == 0 for r in on_disk.rows)
    # the checkpoint's bytes are in both; the cache's go to disk instead of RAM
    assert on_disk.disk - big.disk == pytest.approx(max(r.host_cache for r in big.rows), rel=0.01)


def test_max_device_memory_picks_finer_targets_or_says_none_exist(model_dir: Path) -> None:
    layer = _plan(model_dir, one_pass=False)
    finer = _plan(model_dir, one_pass=False, max_device_memory=int(0.9 * layer.device_peak))
    assert finer.targets and {"LlamaAttention", "LlamaMLP"} <= set(finer.targets)
    assert finer.device_peak < layer.device_peak
    assert any("finer targets" in note for note in finer.notes)
    hopeless = _plan(model_dir, one_pass=False, max_device_memory=1)
    assert "more than max_device_memory" in hopeless.notes[-1] and "lower batch_size" in hopeless.notes[-1]


def test_max_device_memory_in_one_pass_names_the_subgraph_and_the_fix(model_dir: Path) -> None:
    fits = _plan(model_dir)
    assert _plan(model_dir, max_device_memory=fits.device_peak).notes == []
    over = _plan(model_dir, max_device_memory=1)
    assert over.targets is None  # the run keeps the one-pass cut: no layer cut is finer
    worst = max(over.rows, key=lambda r: r.device_peak)
    (note,) = over.notes
    assert f"subgraph {worst.index} ({worst.targets[0]})" in note and "one-pass cut" in note
    assert "lower batch_size or max_seq_length, or raise max_device_memory" in note


@pytest.mark.parametrize("one_pass", [True, False])
def test_oneshot_logs_every_note_of_the_plan(one_pass: bool, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    data = [{"input_ids": list(range(i, i + 16))} for i in range(2)]
    with caplog.at_level(logging.INFO, logger="seqcal"):
        oneshot(model=LlamaForCausalLM(config).eval(), recipe=GPTQ, dataset=data, max_seq_length=16,
                max_device_memory=1, one_pass=one_pass)  # fmt: skip
    logged = [r.getMessage() for r in caplog.records]
    assert any("more than max_device_memory" in m for m in logged), logged  # the last note, once dropped
    assert any("using finer targets" in m for m in logged) is not one_pass, logged
    # and how the run cut the graph: before each module group, or after the finer targets
    cut = "one pass: cut before each group" if one_pass else "cutting after each of the sequential targets ['"
    assert sum(cut in m for m in logged) == 1, logged


def test_plan_cli_prints_the_table(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(GPTQ + "\n")
    args = ["plan", "--model", str(model_dir), "--recipe", str(recipe), "--num-calibration-samples", "8",
            "--max-seq-length", "32"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "peak: device" in out and "model.layers.0" in out


def test_plan_counts_the_cache_copies_beside_the_compute_on_a_gpu(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the cache copies beside the compute (``seqcal.execution.cache.transfers``): a batch's device
    memory also holds the next batch's inputs and the previous batch's outputs; on the CPU nothing changes."""
    import seqcal.execution.cache.store as store

    on_cpu = _plan(model_dir)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # planned as for a GPU; nothing runs there
    overlapped = _plan(model_dir)
    monkeypatch.setattr(store, "OVERLAP", False)
    plain = _plan(model_dir)
    grown = [a.activations - b.activations for a, b in zip(overlapped.rows, plain.rows)]
    assert all(g >= 0 for g in grown) and sum(g > 0 for g in grown) >= len(grown) - 1  # the head: maybe none
    # what grew is what the subgraph reads and writes per batch, bounded by the batch's activations
    assert all(g < b.activations for g, b in zip(grown, plain.rows))
    assert [r.activations for r in on_cpu.rows] == [r.activations for r in plain.rows]


def test_plan_puts_a_device_tier_cache_on_the_device(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """offload="device" on a GPU: the cached values count on the device, not in RAM; on another accelerator the
    plan says it leaves them out."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # planned as for a GPU; nothing runs there
    in_ram, on_device = _plan(model_dir), _plan(model_dir, offload="device")
    assert all(r.host_cache == 0 for r in on_device.rows) and max(r.host_cache for r in in_ram.rows) > 0
    assert on_device.device_peak > in_ram.device_peak and on_device.host_peak < in_ram.host_peak
    assert max(r.device_cache for r in on_device.rows) >= max(r.host_cache for r in in_ram.rows)
    elsewhere = _plan(model_dir, offload="cuda:1")
    assert any("is on cuda:1 (not planned)" in n for n in elsewhere.notes)
    assert all(r.host_cache == 0 and r.device_cache == 0 for r in elsewhere.rows)


def test_plan_counts_the_save_a_worker_thread_still_writes(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the checkpoint written in the background, a subgraph's host memory also holds the previous
    subgraph's prepared tensors (``checkpoint.streaming.BACKGROUND``); the first subgraph has none before it."""
    import seqcal.checkpoint.streaming as streaming

    background = _plan(model_dir)
    monkeypatch.setattr(streaming, "BACKGROUND", False)
    synchronous = _plan(model_dir)
    grown = [a.host - b.host for a, b in zip(background.rows, synchronous.rows)]
    assert grown[0] == 0 and all(g >= 0 for g in grown) and sum(g > 0 for g in grown) >= LAYERS * 4 - 1
    # what a GPTQ subgraph holds for the writer: at least the int8 codes of the modules it quantized
    q_proj = background.rows[1]  # q/k/v of the first layer
    assert grown[2] >= q_proj.quantized_numel


def test_plan_runs_no_head_after_the_last_solve(model_dir: Path) -> None:
    """The one-pass cut's last subgraph is calibrated from down_proj's cached inputs and runs no forward pass (the
    head's logits are never computed): its activations are one batch of those inputs and their float32 copy. The
    layer cut's head holds nothing to solve and is skipped: no activations at all."""
    last = _plan(model_dir).rows[-1]
    assert last.targets == [f"model.layers.{LAYERS - 1}.mlp.down_proj"]
    tokens = 64  # one sample of max_seq_length
    assert last.activations == tokens * INTER * 4 + tokens * INTER * 4
    head = _plan(model_dir, one_pass=False).rows[-1]
    assert not head.targets and head.activations == 0


def test_plan_takes_the_execution_device_by_name_for_the_device_tier(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """offload="cuda:0" on a run that executes on cuda:0 is the device tier, planned as such; another index is not."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # planned as for a GPU; nothing runs there
    by_tier, by_name = _plan(model_dir, offload="device"), _plan(model_dir, offload="cuda:0")
    assert [r.device_cache for r in by_name.rows] == [r.device_cache for r in by_tier.rows]
    assert max(r.device_cache for r in by_name.rows) > 0 and not by_name.notes
    assert any("is on cuda:1 (not planned)" in n for n in _plan(model_dir, offload="cuda:1").notes)


def test_the_plan_is_for_the_rows_an_in_memory_dataset_has(model_dir: Path) -> None:
    """Four rows given with the default num_calibration_samples (512): the plan sizes the cache for four."""
    rows = [{"input_ids": list(range(1, 65))} for _ in range(4)]
    default = oneshot(model=str(model_dir), recipe=GPTQ, dataset=rows, dry_run=True, max_seq_length=64,
                      batch_size=1)  # fmt: skip
    four = _plan(model_dir, num_calibration_samples=4)
    many = _plan(model_dir, num_calibration_samples=512)
    assert [r.host_cache for r in default.rows] == [r.host_cache for r in four.rows]
    assert max(r.host_cache for r in many.rows) > max(r.host_cache for r in four.rows)
