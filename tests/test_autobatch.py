"""batch_size="auto": samples grouped by length, right-padded, sized by the memory budget; statistics exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from seqcal.data.autobatch import (
    MAX_TOKENS,
    BatchLimits,
    auto_batch_limits,
    default_batch_size,
    group_by_length,
    length_boundaries,
)
from seqcal.data.batches import DataArgs, load_calibration_batches
from seqcal.entrypoint import oneshot
from seqcal.execution.passes import error_sample
from seqcal.execution.pipeline import PipelineArgs, run_pipeline
from seqcal.modifiers import GPTQModifier
from test_data import make_tokenizer
from test_oneshot import VOCAB, tiny_llama

ROOT = Path(__file__).resolve().parent.parent
# Lengths chosen so that auto stacks equal ones, buckets near ones (<= 1/8 padding) and keeps far ones apart.
LENGTHS = [40, 37, 40, 12, 40, 36, 11, 25, 24, 40, 6, 39]


def mixed_data(lengths: list[int] = LENGTHS) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(3)
    return [
        {"input_ids": (torch.randint(-3, 4, (n,), generator=g).cumsum(0) % VOCAB).tolist()} for n in lengths
    ]


# ---- grouping ---------------------------------------------------------------------------------------------


def test_groups_stack_equal_lengths_and_bucket_within_an_eighth() -> None:
    groups = group_by_length(LENGTHS, BatchLimits(max_tokens=10_000))
    assert sorted(i for g in groups for i in g) == list(range(len(LENGTHS)))  # every sample exactly once
    for group in groups:
        longest = LENGTHS[group[0]]
        assert all(longest - LENGTHS[i] <= LENGTHS[i] / 8 for i in group)
    assert [LENGTHS[i] for i in groups[0]] == [40, 40, 40, 40, 39, 37, 36]
    assert len(groups) < len(LENGTHS) / 2
    assert group_by_length(LENGTHS, BatchLimits(max_tokens=10_000)) == groups  # deterministic


def test_groups_respect_token_and_sample_caps_and_exact_mode() -> None:
    lengths = [64] * 10 + [100]
    assert [len(g) for g in group_by_length(lengths, BatchLimits(max_tokens=256))] == [1, 4, 4, 2]
    assert [len(g) for g in group_by_length(lengths, BatchLimits(max_samples=3))] == [1, 3, 3, 3, 1]
    assert [len(g) for g in group_by_length([50] * 4, BatchLimits(max_tokens=10))] == [1, 1, 1, 1]
    exact = group_by_length([40, 39, 40], BatchLimits(pad_fraction=0.0))
    assert exact == [[0, 2], [1]]


def test_a_batch_never_straddles_a_boundary() -> None:
    lengths = [36, 33, 32, 31, 30]
    groups = group_by_length(lengths, BatchLimits(boundaries=(32,)))
    assert groups == [[0, 1], [2, 3, 4]]  # 32 would pad to 36 across the window of 32: kept apart
    assert length_boundaries(MistralConfig(sliding_window=32)) == (32,)
    assert length_boundaries(Gemma2Config(sliding_window=16, query_pre_attn_scalar=8)) == (16,)
    assert length_boundaries(LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                         max_position_embeddings=64)) == (64,)  # fmt: skip
    assert length_boundaries(LlamaConfig()) == ()


def test_batches_are_right_padded_whatever_the_tokenizer_says() -> None:
    tok = make_tokenizer(padding_side="left")
    data = mixed_data()
    auto = load_calibration_batches(DataArgs(data, batch_size="auto", max_seq_length=64), tok)
    one = load_calibration_batches(DataArgs(data, batch_size=1, max_seq_length=64), tok)
    assert len(auto) < len(one)
    rows = []
    for batch in auto:
        mask = batch["attention_mask"].bool()
        lengths = mask.sum(1)
        assert torch.equal(mask, torch.arange(mask.shape[1]) < lengths[:, None])  # real tokens first
        rows += [batch["input_ids"][b, : int(n)].tolist() for b, n in enumerate(lengths)]
    assert sorted(rows) == sorted(b["input_ids"][0].tolist() for b in one)


def test_token_ids_without_a_tokenizer_are_batched_too() -> None:
    batches = load_calibration_batches(DataArgs(mixed_data(), batch_size="auto", max_seq_length=64), None)
    assert sum(b["input_ids"].shape[0] for b in batches) == len(LENGTHS) and len(batches) < len(LENGTHS)


def test_the_default_batch_size_is_auto_on_an_accelerator_and_one_on_the_cpu() -> None:
    assert default_batch_size(torch.device("cpu")) == 1
    assert default_batch_size(torch.device("cuda", 0)) == "auto"


def test_bad_batch_sizes_are_explained() -> None:
    for bad in (0, "big", 2.0):
        with pytest.raises(ValueError, match="batch_size must be a positive int or 'auto'"):
            DataArgs("default", batch_size=bad)


# ---- budget -----------------------------------------------------------------------------------------------


def test_the_budget_sets_the_batch_tokens() -> None:
    model = tiny_llama()
    free = auto_batch_limits(model, 64)
    assert free.max_tokens == MAX_TOKENS  # a tiny model: the cap
    small = auto_batch_limits(model, 64, max_device_memory=4 << 20)
    tiny_cache = auto_batch_limits(model, 64, cache_max_memory=1 << 20)
    assert 1 <= small.max_tokens < free.max_tokens and 1 <= tiny_cache.max_tokens < free.max_tokens
    assert auto_batch_limits(model, 64, max_device_memory=1).max_tokens == 1  # still one sample per batch
    assert auto_batch_limits(model, 64, equal_lengths=True).pad_fraction == 0.0


def test_plan_command_shows_the_chosen_batch_size(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(tmp_path / "m")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "seqcal.cli", "plan", "--model", str(tmp_path / "m"), "--recipe",
           "GPTQModifier: {scheme: W4A16, ignore: [lm_head]}", "--max-seq-length", "64",
           "--num-calibration-samples", "512"]  # fmt: skip
    auto = subprocess.run(
        [*cmd, "--batch-size", "auto"], env=env, capture_output=True, text=True, timeout=300
    )
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "batch size 64" in auto.stdout  # the cap: 64 samples (16384 tokens would hold 256)
    assert "batch_size auto: 64 samples of 64 tokens per batch" in auto.stdout
    one = subprocess.run([*cmd, "--batch-size", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert "batch size 1" in one.stdout
    if not torch.cuda.is_available():  # the default: one sample per batch on the CPU
        default = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert (
            default.returncode == 0
            and "batch size 1" in default.stdout
            and "batch_size auto" not in default.stdout
        )
    bad = subprocess.run([*cmd, "--batch-size", "lots"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "'lots' is not a batch size; give a positive int or 'auto'" in bad.stderr


# ---- statistics: auto batches see exactly the tokens batch 1 sees ---------------------------------------------


def _hessians(model: torch.nn.Module, data: list, batch_size: Any, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Every GPTQ Hessian of a run, with the solve skipped so that every layer sees full-precision inputs."""
    found: dict[tuple[str, ...], torch.Tensor] = {}

    def record(self: Any, names: list[str], model: Any, H: torch.Tensor, state: Any) -> None:
        found[tuple(names)] = H.clone()

    monkeypatch.setattr(GPTQModifier, "_solve", record)
    oneshot(model=model, dataset=data, recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
            batch_size=batch_size, max_seq_length=64, num_calibration_samples=len(data))  # fmt: skip
    monkeypatch.undo()
    return found


def tiny_mistral() -> MistralForCausalLM:
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16)  # fmt: skip
    return MistralForCausalLM(config).eval()


def tiny_gemma2() -> Gemma2ForCausalLM:
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16,
                          query_pre_attn_scalar=32)  # fmt: skip
    return Gemma2ForCausalLM(config).eval()


@pytest.mark.parametrize("build", [tiny_llama, tiny_mistral, tiny_gemma2], ids=["llama", "mistral", "gemma2"])
def test_auto_hessians_equal_batch_one(build: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # lengths around the sliding window of 16 (mistral, gemma2) and with padding inside buckets
    data = mixed_data([40, 37, 40, 12, 16, 15, 17, 18, 36, 11, 25, 24, 6, 39])
    one = _hessians(build(), data, 1, monkeypatch)
    auto = _hessians(build(), data, "auto", monkeypatch)
    assert one.keys() == auto.keys() and len(one) >= 8
    for key, H in one.items():
        scale = H.abs().max()
        assert (auto[key] - H).abs().max() <= 1e-5 * scale, key  # fp32 summation order only


def test_auto_errors_not_worse_and_report_shows_batches(tmp_path: Path) -> None:
    data = mixed_data()
    recipe = "GPTQModifier: {scheme: W4A16, ignore: [lm_head], block_size: 32}"
    reports = {}
    for size in (1, "auto"):
        out = tmp_path / str(size)
        oneshot(model=tiny_llama(), dataset=data, recipe=recipe, batch_size=size, max_seq_length=64,
                num_calibration_samples=len(data), output_dir=str(out))  # fmt: skip
        reports[size] = json.loads((out / "quantization_report.json").read_text())
    one, auto = reports[1], reports["auto"]
    assert one["batches"]["samples"] == [1] * len(LENGTHS) and one["batches"]["padding"] == 0
    assert len(auto["batches"]["samples"]) < len(LENGTHS) and sum(auto["batches"]["samples"]) == len(LENGTHS)
    assert 0 < auto["batches"]["padding"] <= 1 / 9
    assert one["modules"].keys() == auto["modules"].keys()
    ratios = []
    for name, m in one["modules"].items():
        assert auto["modules"][name]["tokens"] == m["tokens"]  # padding is never counted
        ratios.append((auto["modules"][name]["rel_error"] + 1e-9) / (m["rel_error"] + 1e-9))
    # Batches change the float32 summation order of the Hessians (and the attention kernels' blocking), which
    # flips single GPTQ rounding decisions: on this tiny model one module's error moves by up to ~4% either way
    # (0.96-1.02 measured, with torch's kernels as with oneDNN's). Worse on the whole, or by more, is a bug.
    assert sum(ratios) / len(ratios) <= 1.01, ratios
    assert max(ratios) <= 1.05, ratios


def test_error_sample_keeps_the_first_samples_real_tokens() -> None:
    out = torch.randn(3, 5, 8)  # [B, T, H]
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    kept, rows = error_sample((out, None), mask, 2)
    assert rows == 2 and torch.equal(kept, torch.cat([out[0], out[1, :3]]))
    flat = out[0]
    whole, rows = error_sample(flat, mask, 2)  # not shaped like the mask: kept as it is
    assert rows == 3 and whole is flat


def test_layer_cut_with_auto_batches_measures_comparable_errors() -> None:
    data = mixed_data([40, 36, 38, 37, 20, 19])
    errors = {}
    for size in (1, "auto"):
        batches = load_calibration_batches(DataArgs(data, batch_size=size, max_seq_length=64), None)
        recipe = [GPTQModifier(scheme="W4A16", ignore=["lm_head"])]
        state = run_pipeline(tiny_llama(), None, recipe, None, PipelineArgs(one_pass=False), batches=batches)
        errors[size] = [
            r["rel_error"] for r in state.results.report["subgraphs"] if r["rel_error"] is not None
        ]
    assert len(errors[1]) == len(errors["auto"]) >= 2
    for a, b in zip(errors["auto"], errors[1]):  # the first 4 samples either way, pooled vs per sample
        assert a == pytest.approx(b, rel=0.2)


# ---- resume -------------------------------------------------------------------------------------------------

RESUME_SCRIPT = """
import sys, torch
import seqcal.checkpoint.streaming
from seqcal.entrypoint import oneshot
seqcal.checkpoint.streaming.CHECKPOINT_BYTES = 1  # record progress after every subgraph, so the kill lands midway
g = torch.Generator().manual_seed(1)
data = [{"input_ids": (torch.randint(-3, 4, (n,), generator=g).cumsum(0) % 256).tolist()}
        for n in (64, 60, 64, 33, 64, 31, 58, 30, 64, 17, 16, 64)]
oneshot(model=sys.argv[1], dataset=data, output_dir=sys.argv[2], resume=sys.argv[3] == "1", max_seq_length=64,
        batch_size="auto", recipe="GPTQModifier: {scheme: W4A16, ignore: [lm_head], block_size: 32}")
"""


def test_a_killed_auto_batched_run_resumes_to_the_uninterrupted_checkpoint(tmp_path: Path) -> None:
    from save_helpers import checkpoint_tensors
    from test_resume import _finished

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}

    def run(out: Path, resume: bool) -> subprocess.Popen:
        args = [
            sys.executable,
            "-c",
            RESUME_SCRIPT,
            str(tmp_path / "model"),
            str(out),
            "1" if resume else "0",
        ]
        return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    killed, clean = tmp_path / "killed", tmp_path / "clean"
    proc = run(killed, resume=False)
    deadline = time.time() + 600
    while _finished(killed) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (killed / "config.json").exists()
    assert _finished(killed) >= 2
    resumed = run(killed, resume=True)
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read().decode()[-3000:]
    uninterrupted = run(clean, resume=False)
    assert uninterrupted.wait(timeout=600) == 0, uninterrupted.stderr.read().decode()[-3000:]
    a, b = checkpoint_tensors(killed), checkpoint_tensors(clean)
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert torch.equal(a[key], b[key]), key
    report = json.loads((clean / "quantization_report.json").read_text())
    assert report["batches"]["count"] < 12  # the run was batched


def test_auto_batches_keep_the_cache_budget_and_spill_losslessly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch-sized cache entries over cache_max_memory go to disk; the Hessians come out bit for bit the same."""
    from seqcal.execution.cache.store import ActivationCache

    batches = load_calibration_batches(DataArgs(mixed_data(), batch_size="auto", max_seq_length=64), None)
    assert len(batches) < len(LENGTHS)
    resident: list[int] = []
    on_disk: list[int] = []
    real_put = ActivationCache.put

    def put(self: ActivationCache, batch: int, name: str, value: Any) -> None:
        real_put(self, batch, name, value)
        resident.append(self.resident_bytes() if self.max_memory is not None else 0)
        on_disk.append(self.disk_bytes())

    def hessians(budget: int | None) -> dict:
        found: dict = {}
        monkeypatch.setattr(
            GPTQModifier, "_solve", lambda self, names, m, H, st: found.update({tuple(names): H})
        )
        monkeypatch.setattr(ActivationCache, "put", put)
        recipe = [GPTQModifier(scheme="W4A16", ignore=["lm_head"])]
        run_pipeline(tiny_llama(), None, recipe, None, PipelineArgs(cache_max_memory=budget), batches=batches)
        return found

    free, budget = hessians(None), 64 << 10
    on_disk.clear()
    spilled = hessians(budget)
    assert resident and 0 < max(resident) <= budget  # the budget holds with batch-sized entries
    assert max(on_disk) > 0  # and the rest went to disk
    assert free.keys() == spilled.keys() and len(free) >= 8
    for key, H in free.items():
        assert torch.equal(spilled[key], H), key  # spilled values come back exactly
