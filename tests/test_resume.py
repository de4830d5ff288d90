"""Streaming save and resume: a run killed with SIGKILL midway resumes to the same checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from save_helpers import checkpoint_tensors
from seqcal.checkpoint.streaming import ResumeError
from seqcal.entrypoint import oneshot

LAYERS = 12
SCRIPT = """
import sys, torch
import seqcal.checkpoint.streaming
from seqcal.entrypoint import oneshot
seqcal.checkpoint.streaming.CHECKPOINT_BYTES = 1  # record progress after every subgraph, so the kill lands midway
g = torch.Generator().manual_seed(1)
data = [{"input_ids": (torch.randint(-3, 4, (64,), generator=g).cumsum(0) % 256).tolist()} for _ in range(24)]
oneshot(model=sys.argv[1], dataset=data, output_dir=sys.argv[2], resume=sys.argv[3] == "1", max_seq_length=64,
        recipe="GPTQModifier: {scheme: W4A16, ignore: [lm_head], block_size: 32}")
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    path = tmp_path_factory.mktemp("model")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _run(model_dir: Path, out: Path, resume: bool) -> subprocess.Popen:
    path = os.pathsep.join(
        p for p in (str(Path(__file__).parent.parent / "src"), os.environ.get("PYTHONPATH")) if p
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(model_dir), str(out), "1" if resume else "0"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip


def _finished(out: Path) -> int:
    try:
        return json.loads((out / "seqcal_progress.json").read_text())["progress"]["finished"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return -1


def test_sigkill_midway_then_resume_equals_uninterrupted(model_dir: Path, tmp_path: Path) -> None:
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    proc = _run(model_dir, killed, resume=False)
    deadline = time.time() + 300
    while _finished(killed) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "config.json").exists(), "the run finished before it could be killed"
    stopped_at = _finished(killed)
    assert 3 <= stopped_at

    with pytest.raises(FileExistsError, match="resume=True"):  # never silently overwritten or restarted
        oneshot(model=str(model_dir), dataset=[{"input_ids": [1, 2, 3]}], output_dir=str(killed),
                recipe="GPTQModifier: {scheme: W4A16}")  # fmt: skip
    resumed = _run(model_dir, killed, resume=True)
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read().decode()[-3000:]
    uninterrupted = _run(model_dir, clean, resume=False)
    assert uninterrupted.wait(timeout=600) == 0, uninterrupted.stderr.read().decode()[-3000:]

    a, b = checkpoint_tensors(killed), checkpoint_tensors(clean)
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not (killed / "seqcal_progress.json").exists() and not (killed / "seqcal_resume").exists()
    assert json.loads((killed / "config.json").read_text()) == json.loads((clean / "config.json").read_text())


def test_resume_refuses_finished_or_foreign_runs(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "done"
    data = [{"input_ids": list(range(1, 33))}] * 2
    oneshot(
        model=str(model_dir),
        dataset=data,
        output_dir=str(out),
        recipe="QuantizationModifier: {scheme: W4A16}",
    )
    with pytest.raises(ResumeError, match="finished"):
        oneshot(model=str(model_dir), dataset=data, output_dir=str(out), resume=True,
                recipe="QuantizationModifier: {scheme: W4A16}")  # fmt: skip
    with pytest.raises(ValueError, match="cannot be combined"):
        oneshot(model=str(model_dir), dataset=data, output_dir=str(out), resume=True, overwrite=True,
                recipe="QuantizationModifier: {scheme: W4A16}")  # fmt: skip


def test_small_model_streams_into_one_shard(model_dir: Path, tmp_path: Path) -> None:
    # Progress is recorded per CHECKPOINT_BYTES of finished modules, not per subgraph: a model this small
    # (49 subgraphs cut before its modules) is written as one file, not one shard per subgraph.
    out = tmp_path / "out"
    oneshot(model=str(model_dir), dataset=[{"input_ids": list(range(32))}] * 2, output_dir=str(out),
            recipe="GPTQModifier: {scheme: W4A16, ignore: [lm_head]}")  # fmt: skip
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert len(json.loads((out / "quantization_report.json").read_text())["subgraphs"]) == 4 * LAYERS + 1
