"""The streaming checkpoint's files written on a worker thread while the next subgraph computes.

The worker writes what the calling thread prepared, in the order a synchronous save would, so the checkpoint
is the same file for file; at most one subgraph's writes are pending; an error writing them is raised from
the run, and the directory stays resumable.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import seqcal.checkpoint.streaming as streaming
from save_helpers import checkpoint_tensors, save_llama
from seqcal.checkpoint.writer import CheckpointWriter
from seqcal.entrypoint import oneshot
from seqcal.evaluation.errors import REPORT_FILENAME
from seqcal.report import Profiler

GPTQ = "GPTQModifier: {scheme: W4A16, ignore: [lm_head], block_size: 32}"
# a smoothing fold into the norms (written by the subgraph that folds into them), pruning, then GPTQ
FOLDS = """
SmoothQuantModifier: {smoothing_strength: 0.5}
SparseGPTModifier: {sparsity: 0.5, mask_structure: "2:4", targets: [re:.*mlp.down_proj$]}
GPTQModifier: {scheme: W8A8, ignore: [lm_head], block_size: 32}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("model"), 3)


def _data(n: int = 8) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [
        {"input_ids": (torch.randint(-3, 4, (48,), generator=g).cumsum(0) % 256).tolist()} for _ in range(n)
    ]


def _run(model_dir: Path, out: Path, recipe: str = GPTQ, **kwargs) -> None:
    oneshot(model=str(model_dir), dataset=_data(), output_dir=str(out), recipe=recipe, max_seq_length=48,
            **kwargs)  # fmt: skip


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


@pytest.mark.parametrize("recipe", [GPTQ, FOLDS], ids=["gptq", "smoothquant-sparsegpt-gptq"])
def test_background_writes_give_the_synchronous_checkpoint_byte_for_byte(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipe: str
) -> None:
    monkeypatch.setattr(streaming, "CHECKPOINT_BYTES", 1)  # a record (and a shard) after every subgraph
    monkeypatch.setattr(streaming, "BACKGROUND", False)
    _run(model_dir, tmp_path / "sync", recipe)
    monkeypatch.setattr(streaming, "BACKGROUND", True)
    _run(model_dir, tmp_path / "background", recipe)
    sync, background = _files(tmp_path / "sync"), _files(tmp_path / "background")
    shards = [n for n in sync if n.startswith("model-")]
    assert len(shards) > 3  # one per subgraph: the order of bytes and records shows in the files
    assert sync.keys() == background.keys()
    for name in sync:
        if name != REPORT_FILENAME and not name.endswith(".png"):  # the report holds timings
            assert sync[name] == background[name], name


def test_writes_overlap_the_next_subgraph_one_at_a_time(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each subgraph's writes are slowed down: the worker must run them beside the next subgraph's passes, and
    # never two at once (the next subgraph's save waits for them).
    active, most, threads = [0], [0], set()
    lock = threading.Lock()
    add = CheckpointWriter.add_tensors

    def slow(self: CheckpointWriter, tensors: dict) -> None:
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        threads.add(threading.current_thread().name)
        time.sleep(0.02)
        add(self, tensors)
        with lock:
            active[0] -= 1

    monkeypatch.setattr(CheckpointWriter, "add_tensors", slow)
    trace = tmp_path / "trace.json"
    _run(model_dir, tmp_path / "out", profile=str(trace))
    assert most[0] == 1 and threads and all(t.startswith("seqcal-write") for t in threads)
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    writes = [e for e in events if e["cat"] == "write"]
    assert len(writes) == len([e for e in events if e["cat"] == "save" and "subgraph" in e["args"]]) > 3
    passes = [e for e in events if e["cat"] in ("calibration", "propagation", "compress")]
    overlapping = [
        w for w in writes
        if any(p["ts"] < w["ts"] + w["dur"] and w["ts"] < p["ts"] + p["dur"] for p in passes)
    ]  # fmt: skip
    assert overlapping, "no write ran while a subgraph computed"
    summary = Profiler.load(trace).summary()
    assert "subgraphs written on a worker thread" in summary


def test_an_error_writing_in_the_background_is_raised_and_the_run_resumes(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(streaming, "CHECKPOINT_BYTES", 1)
    save = streaming.save_file
    calls = [0]

    def failing(tensors: dict, path: str, metadata: dict | None = None) -> None:
        calls[0] += 1
        if Path(path).name == "5.st":
            raise OSError(28, "No space left on device")
        save(tensors, path, metadata=metadata)

    monkeypatch.setattr(streaming, "save_file", failing)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space left"):
        _run(model_dir, out)
    progress = json.loads((out / "seqcal_progress.json").read_text())["progress"]
    assert progress["finished"] == 4 and not (out / "config.json").exists()
    assert not any(t.name.startswith("seqcal-write") for t in threading.enumerate())  # the worker stopped
    monkeypatch.setattr(streaming, "save_file", save)
    _run(model_dir, out, resume=True)
    _run(model_dir, tmp_path / "clean")
    a, b = checkpoint_tensors(out), checkpoint_tensors(tmp_path / "clean")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# up_proj kept in full precision: a consumer of the norm's fold in its own subgraph (saved there), then the
# producer down_proj's fold divides in place, in the next subgraph
UP_UNQUANTIZED = ("SmoothQuantModifier: {smoothing_strength: 0.8}\n"
                  "GPTQModifier: {scheme: W8A8, ignore: [lm_head, 're:.*up_proj$'], block_size: 16}")  # fmt: skip


@pytest.mark.parametrize("recipe", ["smoothquant", "smoothquant_gptq", UP_UNQUANTIZED])
def test_resume_files_hold_each_subgraph_as_it_finished_while_later_folds_change_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipe: str
) -> None:
    """The one-pass cut folds down_proj's smoothing scales into up_proj after up_proj's subgraph finished: that
    subgraph's resume file must hold up_proj from before the fold, as a synchronous save writes it, even when the
    worker writes it only while the next subgraph folds (writes slowed down here so that they do)."""
    from test_resume_modifiers import RECIPES
    from test_resume_modifiers import _data as vocab_128_data

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))  # fmt: skip
    with torch.no_grad():
        for layer in model.model.layers:  # outlier channels: smoothing has something to do
            layer.input_layernorm.weight[[3, 17, 40]] = 20.0
            layer.post_attention_layernorm.weight[[5, 33]] = 15.0
    model.save_pretrained(tmp_path / "model")
    save = streaming.save_file
    written: dict[str, dict[str, dict[str, torch.Tensor]]] = {}

    def recording(tensors: dict, path: str, metadata: dict | None = None) -> None:
        if streaming.BACKGROUND:
            time.sleep(0.05)  # the next subgraph runs (and folds) meanwhile
        written.setdefault(mode, {})[Path(path).name] = {k: v.clone() for k, v in tensors.items()}
        save(tensors, path, metadata=metadata)

    monkeypatch.setattr(streaming, "save_file", recording)
    for mode, background in (("sync", False), ("background", True)):
        monkeypatch.setattr(streaming, "BACKGROUND", background)
        oneshot(model=str(tmp_path / "model"), dataset=vocab_128_data(), recipe=RECIPES.get(recipe, recipe),
                output_dir=str(tmp_path / mode), max_seq_length=32)  # fmt: skip
    sync, background = written["sync"], written["background"]
    assert sync.keys() == background.keys() and len(sync) > 1
    differ = [(f, k) for f in sync for k in sync[f] if not torch.equal(sync[f][k], background[f][k])]
    assert not differ, differ[:5]
