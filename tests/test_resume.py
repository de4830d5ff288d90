"""Streaming save and resume: a run killed with SIGKILL at any point resumes to the same checkpoint.

The kills through the CLI land at chosen points: the command runs in a child process whose test wrapper
replaces one checkpoint function by one that SIGKILLs the process there (the product code has no hook), or the
test polls the output directory and kills the process when a file appears.
"""

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
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from save_helpers import checkpoint_tensors, save_llama
from seqcal.checkpoint.streaming import ResumeError
from seqcal.cli import main as cli_main
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
        recipe="GPTQModifier: {scheme: %s, ignore: [lm_head], block_size: 32}" % sys.argv[4])
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("model"), LAYERS)


def _run(model_dir: Path, out: Path, resume: bool, scheme: str = "W4A16") -> subprocess.Popen:
    path = os.pathsep.join(
        p for p in (str(Path(__file__).parent.parent / "src"), os.environ.get("PYTHONPATH")) if p
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(model_dir), str(out), "1" if resume else "0", scheme],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip


def _finished(out: Path) -> int:
    try:
        return json.loads((out / "seqcal_progress.json").read_text())["progress"]["finished"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return -1


# NVFP4A16: the resumed subgraphs' weights come back with their global scales (fp4 codes, fp8 scales)
@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16"])
def test_sigkill_midway_then_resume_equals_uninterrupted(
    model_dir: Path, tmp_path: Path, scheme: str
) -> None:
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    proc = _run(model_dir, killed, resume=False, scheme=scheme)
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
    resumed = _run(model_dir, killed, resume=True, scheme=scheme)
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read().decode()[-3000:]
    uninterrupted = _run(model_dir, clean, resume=False, scheme=scheme)
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


# ---- kills at chosen points through the CLI, resumed with `seqcal oneshot --resume` -------------------------

CLI_LAYERS = 8  # 33 subgraphs with the one-pass cut
RECIPE = "GPTQModifier: {scheme: W4A16, ignore: [lm_head], block_size: 32}\n"
WORDS = [f"w{i}" for i in range(200)]
# Runs `seqcal <args>` with one checkpoint function replaced by one that SIGKILLs the process at a point.
KILLER = """
import os, signal, sys
import seqcal.checkpoint.streaming as s, seqcal.checkpoint.writer as w
from seqcal.cli import main
point, args = sys.argv[1], sys.argv[2:]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
record, write_json = s.StreamingCheckpoint._record, w._write_json
if point in ("after_record_5", "inside_record_10", "inside_write_12"):
    s.CHECKPOINT_BYTES = 1  # a record after every subgraph
save_file = s.save_file
def _save_file(tensors, path, metadata=None):
    if point == "inside_write_12" and path.endswith("12.st"):
        open(path, "wb").write(b"partial")  # on the worker thread, while the next subgraph computes
        die()
    save_file(tensors, path, metadata=metadata)
s.save_file = _save_file
def _record(self, finished):
    if point == "before_first_record" or (point == "inside_record_10" and finished == 10):
        die()  # inside_record_10: subgraph 10's modules are in the open shard, the last record is 9
    record(self, finished)
    if point == "after_record_5" and finished == 5:
        die()
def _write_json(path, data):
    if point == "save_before_config" and path.name == "config.json":
        die()  # the shards were renamed to their final names already
    write_json(path, data)
    if point == "save_after_config" and path.name == "config.json":
        die()  # the checkpoint looks finished, but the progress record is still there
s.StreamingCheckpoint._record, w._write_json = _record, _write_json
sys.exit(main(args))
"""


def _env() -> dict[str, str]:
    src = str(Path(__file__).parent.parent / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An 8-layer Llama with a word-level tokenizer, a calibration text, a recipe and the uninterrupted run."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("cli")
    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[UNK]")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=CLI_LAYERS, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    g = torch.Generator().manual_seed(2)
    lines = [
        " ".join(WORDS[i] for i in torch.randint(len(WORDS), (64,), generator=g).tolist()) for _ in range(16)
    ]
    (root / "calib.txt").write_text("\n\n".join(lines) + "\n")
    (root / "recipe.yaml").write_text(RECIPE)
    setup = {"model": root / "model", "data": root / "calib.txt", "recipe": root / "recipe.yaml"}
    assert cli_main(_cli_args(setup, root / "clean")) == 0  # the uninterrupted run (in this process)
    return {**setup, "clean": root / "clean"}


def _cli_args(setup: dict[str, Path], out: Path) -> list[str]:
    return ["oneshot", "--model", str(setup["model"]), "--recipe", str(setup["recipe"]), "--dataset",
            str(setup["data"]), "--output-dir", str(out), "--num-calibration-samples", "16",
            "--max-seq-length", "64"]  # fmt: skip


def _cli(
    setup: dict[str, Path], out: Path, *extra: str, kill_at: str | None = None
) -> subprocess.CompletedProcess:
    args = [*_cli_args(setup, out), *extra]
    cmd = (
        [sys.executable, "-c", KILLER, kill_at, *args]
        if kill_at
        else [sys.executable, "-m", "seqcal.cli", *args]
    )
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)


def _assert_same_checkpoint(out: Path, clean: Path) -> None:
    a, b = checkpoint_tensors(out), checkpoint_tensors(clean)
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert json.loads((out / "config.json").read_text()) == json.loads((clean / "config.json").read_text())
    # the same files but the shards (a killed run records progress in more, smaller shards)
    files = [{p.name for p in d.iterdir() if not p.name.startswith("model")} for d in (out, clean)]
    assert files[0] == files[1] and "seqcal_progress.json" not in files[0] and "seqcal_resume" not in files[0]


def _kill_when(proc: subprocess.Popen, file: Path) -> None:
    deadline = time.time() + 300
    while not file.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"


def test_cli_killed_at_every_point_resumes_to_the_uninterrupted_checkpoint(cli_setup, tmp_path: Path) -> None:
    # One directory, killed again at each point by the resumed run itself, then resumed to the end.
    out = tmp_path / "out"
    killed = _cli(cli_setup, out, kill_at="before_first_record")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert out.is_dir() and not any(out.iterdir())  # nothing written before the first record

    # A small model records its progress once per 64 MB: killed at 2/3 of its 33 subgraphs, the directory
    # holds only the first record (nothing finished), and --resume starts over inside it.
    cmd = [sys.executable, "-m", "seqcal.cli", *_cli_args(cli_setup, out), "--resume"]
    _kill_when(subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
               out / "seqcal_resume" / "22.st")  # fmt: skip
    assert _finished(out) == -1 and not (out / "config.json").exists()

    expected = {
        "after_record_5": lambda: _finished(out) == 5,
        "inside_record_10": lambda: _finished(out) == 9,
        "inside_write_12": lambda: (  # a half-written resume file after the last record: removed, recomputed
            _finished(out) == 11 and (out / "seqcal_resume" / "12.st").read_bytes() == b"partial"
        ),
        "save_before_config": lambda: (  # shards renamed to their final names, not yet finished
            any(out.glob("model*.safetensors")) and not (out / "config.json").exists()
        ),
        "save_after_config": lambda: (
            (out / "config.json").is_file() and (out / "seqcal_progress.json").is_file()
        ),
    }
    for point, check in expected.items():
        killed = _cli(cli_setup, out, "--resume", kill_at=point)
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr[-3000:])
        assert check(), point
    resumed = _cli(cli_setup, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_checkpoint(out, cli_setup["clean"])


def test_cli_resume_refuses_a_directory_of_other_files_untouched(cli_setup, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model.safetensors").write_bytes(b"not a seqcal checkpoint")
    result = _cli(cli_setup, out, "--resume")
    assert result.returncode != 0
    assert (
        "holds files of something other than a seqcal run" in result.stderr
        and "choose another" in result.stderr
    )
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt"]
    assert (out / "model.safetensors").read_bytes() == b"not a seqcal checkpoint"


# ---- the run's identity: data by content (a DataLoader too), foreign runs refused untouched ----------------

LOADER_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[3])
from seqcal.entrypoint import oneshot
from test_resume import RECIPE, _loader
oneshot(model=sys.argv[1], dataset=_loader(seed=0), output_dir=sys.argv[2], recipe=RECIPE)
"""


def _loader(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": torch.randint(0, len(WORDS), (64,), generator=g)} for _ in range(8)]
    return DataLoader(rows, batch_size=2)  # its repr() holds its address: only its batches identify it


def _snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_dataloader_run_resumes_and_foreign_runs_are_refused_untouched(cli_setup, tmp_path: Path) -> None:
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    args = [str(cli_setup["model"]), str(killed), str(Path(__file__).parent)]
    proc = subprocess.Popen([sys.executable, "-c", LOADER_SCRIPT, *args], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    _kill_when(proc, killed / "seqcal_resume" / "12.st")
    before = _snapshot(killed)
    assert "seqcal_progress.json" in before

    model = str(cli_setup["model"])
    other = {
        "calibration data": (_loader(1), RECIPE),
        "recipe": (_loader(0), RECIPE.replace("W4A16", "W8A16")),
    }
    for differs, (data, recipe) in other.items():
        with pytest.raises(ResumeError, match=f"holds an interrupted run whose {differs} differ from this run's; "
                           f"resume it with the same {differs}, or choose another output_dir"):  # fmt: skip
            oneshot(model=model, dataset=data, output_dir=str(killed), resume=True, recipe=recipe)
        assert _snapshot(killed) == before  # nothing overwritten

    oneshot(model=model, dataset=_loader(0), output_dir=str(killed), resume=True, recipe=RECIPE)  # accepted
    oneshot(model=model, dataset=_loader(0), output_dir=str(clean), recipe=RECIPE)
    _assert_same_checkpoint(killed, clean)


def test_data_fingerprint_is_by_content_and_differences_name_the_parts() -> None:
    from seqcal.checkpoint.identity import data_fingerprint, differences

    batches = [{"input_ids": torch.arange(6).view(2, 3), "use_cache": False}]
    same = [{"use_cache": False, "input_ids": torch.arange(6).view(2, 3).clone()}]
    assert data_fingerprint(batches) == data_fingerprint(same)  # another object, same tokens
    assert data_fingerprint(batches) != data_fingerprint(
        [{"input_ids": torch.arange(6).view(3, 2), "use_cache": False}]
    )
    assert data_fingerprint(batches) != data_fingerprint([{"input_ids": torch.arange(6).view(2, 3).int()}])
    run = {"recipe": "a", "model": "b", "dtype": "c", "pipeline": "d", "data": "e"}
    assert differences(run, dict(run)) == []
    assert differences(run, {**run, "data": "x", "recipe": "y"}) == ["recipe", "calibration data"]
    assert differences(None, run) == ["recipe", "model", "dtype", "pipeline options", "calibration data"]


def test_resume_refuses_a_progress_record_without_identity_untouched(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    manifest = {"progress": {"finished": 3, "run_id": "0123456789abcdef"}, "shards": [], "weight_map": {},
                "total_size": 0}  # fmt: skip
    (out / "seqcal_progress.json").write_text(json.dumps(manifest))
    before = _snapshot(out)
    with pytest.raises(ResumeError, match="recorded by an older seqcal, whose arguments cannot be compared"):
        oneshot(model=str(model_dir), dataset=[{"input_ids": list(range(1, 33))}] * 2, output_dir=str(out),
                resume=True, recipe="QuantizationModifier: {scheme: W4A16}")  # fmt: skip
    assert _snapshot(out) == before
