"""What `seqcal` writes for a person to look at: graph files, the error plot, the profile and its timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from seqcal.checkpoint.writer import ERRORS_PNG
from seqcal.cli import main
from seqcal.report import TRACKS, Profiler, plot_timeline

PNG = b"\x89PNG\r\n\x1a\n"


def _trace(path: Path) -> None:
    with Profiler(path) as prof:
        for index in range(3):
            for track in ("onload", "calibration", "compress"):
                with prof.span(track, f"subgraph {index}", subgraph=index):
                    pass


def test_timeline_png_from_a_trace(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _trace(tmp_path / "run.trace.json")
    out = plot_timeline(tmp_path / "run.trace.json", tmp_path / "pics" / "run.png")
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000
    empty = {"traceEvents": [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "seqcal"}}]}
    with pytest.raises(ValueError, match="no stage spans"):
        plot_timeline(empty, tmp_path / "e.png")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a Chrome trace written by Profiler.close"):
        plot_timeline(tmp_path / "bad.json", tmp_path / "e.png")


def test_oneshot_cli_writes_error_plot_and_timeline(
    tokenized_llama_dir: Path, tmp_path: Path, capsys
) -> None:
    pytest.importorskip("matplotlib")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("GPTQModifier: {scheme: W4A16, ignore: [lm_head]}\n")
    out, trace = tmp_path / "out", tmp_path / "run.trace.json"
    args = ["oneshot", "--model", str(tokenized_llama_dir), "--recipe", str(recipe), "--num-calibration-samples", "4",
            "--max-seq-length", "32", "--output-dir", str(out), "--profile", str(trace)]  # fmt: skip
    assert main(args) == 0
    assert (out / ERRORS_PNG).read_bytes()[:8] == PNG  # next to the checkpoint, by default
    assert (tmp_path / "run.timeline.png").read_bytes()[:8] == PNG  # next to the trace
    printed = capsys.readouterr().out
    assert "profile (" in printed and "timeline:" in printed
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["cat"] for e in events if e["ph"] == "X"} <= set(TRACKS)
    # bytes moved: every weight is onloaded at least once (the model is read from its directory), but for the
    # embedding, whose rows are read as the batches name them (execution.embedding_rows)
    model = LlamaForCausalLM.from_pretrained(tokenized_llama_dir)
    table = model.get_input_embeddings().weight
    weights = sum(p.numel() * 4 for p in model.parameters() if p is not table)
    assert sum(e["args"]["bytes"] for e in events if e.get("cat") == "onload") >= weights
    assert main([*args[:-2], "--overwrite", "--plot", "none"]) == 0
    assert not (out / ERRORS_PNG).exists()


def test_trace_cli_format_and_output(tokenized_llama_dir: Path, tmp_path: Path) -> None:
    graph = tmp_path / "graph.data"
    assert (
        main(["trace", "--model", str(tokenized_llama_dir), "--format", "json", "--output", str(graph)]) == 0
    )
    data = json.loads(graph.read_text())
    assert data["nodes"] and data["edges"] and len(data["subgraphs"]) == 3  # 2 layers + the tail
    assert main(["trace", "--model", str(tokenized_llama_dir), "--output", str(tmp_path / "g.dot")]) == 0
    assert (tmp_path / "g.dot").read_text().startswith("digraph")
    for bad in (["--format", "svg"], ["--output", str(tmp_path / "g.txt")]):
        with pytest.raises(SystemExit):
            main(["trace", "--model", str(tokenized_llama_dir), *bad])


def test_explicit_plot_without_matplotlib_is_reported_not_raised(tmp_path: Path, monkeypatch, capsys) -> None:
    import sys

    from seqcal.cli import oneshot as cli

    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    cli._plot_errors({"subgraphs": [], "modules": {}}, tmp_path, str(tmp_path / "e.png"))
    assert "pip install matplotlib" in capsys.readouterr().err and not (tmp_path / "e.png").exists()


def test_every_profile_track_has_a_timeline_colour() -> None:
    from seqcal.report.timeline import _COLORS

    assert set(TRACKS) <= set(_COLORS), set(TRACKS) - set(_COLORS)
