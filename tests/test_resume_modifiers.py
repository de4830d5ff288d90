"""Resume is exact for every modifier: a run stopped after some subgraphs and resumed gives, tensor for
tensor, the checkpoint of a run that was never interrupted.

Replaying a finished subgraph must put back every weight a modifier changed, not only the quantized ones:
pruned-only weights (SparseGPT, Wanda without quantization), smoothing scales folded into norms, producers and
consumers (SmoothQuant, AWQ), calibrated k_scale / v_scale buffers (kv_cache_scheme). Otherwise the downstream subgraphs calibrate on the wrong inputs and the checkpoint is
silently wrong. Where the run divided cached inputs by folded scales (SmoothQuant in the one-pass cut), the
replay divides them again instead of running the folded producer, whose output rounds differently. The stops land at several points (after the first subgraph, midway, before the last).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import seqcal.checkpoint.streaming as streaming
from save_helpers import checkpoint_tensors
from seqcal.entrypoint import oneshot
from seqcal.modifiers import QuantizationModifier

VOCAB = 128
GROUP = 16
ASYM = ("config_groups: {group_0: {targets: [Linear], weights: {num_bits: 4, type: int, symmetric: false, "
        f"strategy: group, group_size: {GROUP}}}}}}}")  # fmt: skip
RECIPES = {
    "sparsegpt": "SparseGPTModifier: {sparsity: 0.5, ignore: [lm_head], block_size: 16}",
    "sparsegpt_2_4": "SparseGPTModifier: {sparsity: 0.5, mask_structure: '2:4', ignore: [lm_head]}",
    "wanda": "WandaPruningModifier: {sparsity: 0.5, ignore: [lm_head]}",
    "smoothquant": "SmoothQuantModifier: {smoothing_strength: 0.8}",
    # the one-pass cut divides the cached inputs of q/k/v and gate/up by the scales it folds into their norms:
    # a replay must divide them again (with the norms unfolded until then), or GPTQ's codes change in the last bits;
    # up_proj -> down_proj folds into up_proj quantized already (its codes kept until down_proj's subgraph ran)
    "smoothquant_gptq": "SmoothQuantModifier: {smoothing_strength: 0.8}\n"
    "GPTQModifier: {scheme: W8A8, ignore: [lm_head], block_size: 16}",
    "awq": f"AWQModifier: {{{ASYM}, ignore: [lm_head], n_grid: 4}}",
    "kv_cache": "QuantizationModifier: {scheme: W8A8, ignore: [lm_head], kv_cache_scheme: {num_bits: 8, type: float, "
    "strategy: tensor, dynamic: false, symmetric: true}}",
    "sparsegpt_gptq": "sparsity_stage:\n  run_type: oneshot\n  sparsity_modifiers:\n    SparseGPTModifier: "
    "{sparsity: 0.5, mask_structure: '2:4', ignore: [lm_head]}\nquantization_stage:\n  run_type: oneshot\n"
    "  quantization_modifiers:\n    GPTQModifier: {scheme: W8A8, ignore: [lm_head], block_size: 16}\n",
}


class _Stopped(Exception):
    pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer Llama with outlier channels (smoothing has something to do)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[[3, 17, 40]] = 20.0
            layer.post_attention_layernorm.weight[[5, 33]] = 15.0
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(path)
    return path


def _data() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [
        {"input_ids": (torch.randint(-3, 4, (32,), generator=g).cumsum(0) % VOCAB).tolist()} for _ in range(4)
    ]


def _run(model_dir: Path, out: Path, recipe: object, **kw: object) -> None:
    oneshot(
        model=str(model_dir), dataset=_data(), recipe=recipe, output_dir=str(out), max_seq_length=32, **kw
    )


def _stopped_after(monkeypatch: pytest.MonkeyPatch, model_dir: Path, out: Path, recipe: str, k: int) -> int:
    """Run until ``k`` subgraphs are on disk, then stop as a crash would (no cleanup); returns how many ran."""
    monkeypatch.setattr(streaming, "CHECKPOINT_BYTES", 1)  # progress recorded after every subgraph
    done, calls = streaming.StreamingCheckpoint.done, []

    def stops(self: streaming.StreamingCheckpoint, sg: object) -> None:
        done(self, sg)
        calls.append(sg)
        if len(calls) == k:
            raise _Stopped

    monkeypatch.setattr(streaming.StreamingCheckpoint, "done", stops)
    try:
        _run(model_dir, out, recipe)
    except _Stopped:
        pass
    finally:
        monkeypatch.setattr(streaming.StreamingCheckpoint, "done", done)
    return len(calls)


def _assert_same_checkpoint(a_dir: Path, b_dir: Path) -> None:
    a, b = checkpoint_tensors(a_dir), checkpoint_tensors(b_dir)
    assert a.keys() == b.keys() and len(a) > 0
    differ = [key for key in a if not torch.equal(a[key], b[key])]
    assert not differ, f"{len(differ)} tensors differ, such as {differ[:3]}"
    assert json.loads((a_dir / "config.json").read_text()) == json.loads((b_dir / "config.json").read_text())
    assert not (a_dir / "seqcal_progress.json").exists() and not (a_dir / streaming.RESUME_DIR).exists()


@pytest.fixture(scope="module")
def clean(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted run of each recipe (computed once, on first use)."""
    root, runs = tmp_path_factory.mktemp("clean"), {}

    class Runs(dict):
        def __missing__(self, name: str) -> Path:
            _run(model_dir, root / name, RECIPES[name])
            self[name] = root / name
            return root / name

    return Runs(runs)


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_stopped_run_resumes_to_the_uninterrupted_checkpoint(
    name: str, model_dir: Path, clean: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    total = len(json.loads((clean[name] / "quantization_report.json").read_text())["subgraphs"])
    failed = []
    # stops after the first, midway, before the last subgraph; after every one where folds cross subgraphs
    every = name == "smoothquant_gptq"
    for k in range(1, total) if every else sorted({1, total // 2, total - 1}):
        out = tmp_path / f"stopped_{k}"
        assert _stopped_after(monkeypatch, model_dir, out, RECIPES[name], k) == k
        assert not (out / "config.json").exists()
        _run(model_dir, out, RECIPES[name], resume=True)
        log = json.loads((out / "quantization_report.json").read_text())["log"]
        assert not [line for line in log if "never calibrated" in line], log  # replayed groups count as done
        try:
            _assert_same_checkpoint(out, clean[name])
        except AssertionError as exc:
            failed.append(f"stopped after {k} of {total} subgraphs: {exc}")
    assert not failed, failed


KILLER = """
import os, signal, sys
import seqcal.checkpoint.streaming as s
from seqcal.entrypoint import oneshot
s.CHECKPOINT_BYTES = 1  # a record after every subgraph
record = s.StreamingCheckpoint._record
def _record(self, finished):
    record(self, finished)
    if sys.argv[4] == "kill" and finished == 6:
        os.kill(os.getpid(), signal.SIGKILL)
s.StreamingCheckpoint._record = _record
sys.path.insert(0, sys.argv[5])
from test_resume_modifiers import RECIPES, _data
oneshot(model=sys.argv[1], dataset=_data(), recipe=RECIPES[sys.argv[3]], output_dir=sys.argv[2], max_seq_length=32,
        resume=sys.argv[4] == "resume")
"""


def test_a_sigkilled_pruning_run_resumes_to_the_uninterrupted_checkpoint(
    model_dir: Path, clean: dict[str, Path], tmp_path: Path
) -> None:
    src = str(Path(__file__).parent.parent / "src")
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    out = tmp_path / "killed"

    def run(mode: str) -> subprocess.CompletedProcess:
        args = [str(model_dir), str(out), "wanda", mode, str(Path(__file__).parent)]
        return subprocess.run([sys.executable, "-c", KILLER, *args], env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip

    killed = run("kill")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert json.loads((out / "seqcal_progress.json").read_text())["progress"]["finished"] == 6
    resumed = run("resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_checkpoint(out, clean["wanda"])


@dataclass
class _Unrecorded(QuantizationModifier):
    """Declares that it changes weights a replay cannot put back."""

    name: ClassVar[str] = "UnrecordedModifier"
    resumable: ClassVar[bool] = False


def test_a_modifier_that_cannot_be_replayed_refuses_the_resume(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, recipe = tmp_path / "out", _Unrecorded(scheme="W8A8", ignore=["lm_head"])
    monkeypatch.setattr(streaming, "CHECKPOINT_BYTES", 1)
    done = streaming.StreamingCheckpoint.done

    def stops(self: streaming.StreamingCheckpoint, sg: object) -> None:
        done(self, sg)
        raise _Stopped

    monkeypatch.setattr(streaming.StreamingCheckpoint, "done", stops)
    with pytest.raises(_Stopped):
        _run(model_dir, out, recipe)
    monkeypatch.setattr(streaming.StreamingCheckpoint, "done", done)
    with pytest.raises(
        streaming.ResumeError, match="interrupted run of UnrecordedModifier, which cannot be resumed"
    ):
        _run(model_dir, out, recipe, resume=True)
