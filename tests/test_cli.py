"""The ``seqcal`` command as a user meets it: errors are one line, decisions are logged, nothing is lost.

Most tests run the real command in a subprocess on a tiny Llama saved next to the default model's
tokenizer, and check stderr and the exit status.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from seqcal.checkpoint.preflight import check_output_dir
from seqcal.entrypoint import oneshot

ROOT = Path(__file__).resolve().parents[1]
RTN = str(ROOT / "recipes" / "rtn_w4a16.yaml")
# a short calibration: every test run of oneshot stays within seconds
SMALL = ["--num-calibration-samples", "2", "--max-seq-length", "32"]


@pytest.fixture(scope="module")
def tiny_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with the default model's tokenizer (same vocabulary), saved as a checkpoint."""
    torch.manual_seed(0)
    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    # tied embeddings and wide MLPs: the layers hold enough of the parameters to be found as the targets
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=1024, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)  # fmt: skip
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def broken_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory transformers cannot load: its config.json is not JSON."""
    path = tmp_path_factory.mktemp("broken")
    (path / "config.json").write_text("{ not json")
    return path


def seqcal(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real command line (the environment, PYTHONPATH included, is inherited)."""
    return subprocess.run([sys.executable, "-m", "seqcal.cli", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=dict(os.environ))  # fmt: skip


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("seqcal: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def assert_user_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    line = error_line(result.stderr)
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


def bad_recipe(tmp_path: Path) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text("OutputDistillationModifier:\n  comparison: l2\n")
    return str(path)


def _oneshot(d: dict[str, Path], t: Path, recipe: str, *extra: str) -> list[str]:
    """``seqcal oneshot`` on the tiny model, saving under ``t``, with ``recipe`` and ``extra`` options."""
    return ["oneshot", "--model", str(d["tiny"]), "--recipe", recipe, "--output-dir", str(t / "out"), *extra]


def test_seqcal_alone_prints_the_usage_and_its_commands(capsys: pytest.CaptureFixture) -> None:
    from seqcal.cli import build_parser, main

    assert main([]) == 2  # argparse's status for a missing command
    out = capsys.readouterr()
    assert out.err.startswith("usage: seqcal") and out.out == ""
    commands = build_parser()._subparsers._group_actions[0].choices  # every command, whoever added it
    for name in commands:
        line = next((li for li in out.err.splitlines() if li.strip().startswith(f"{name} ")), "")
        assert len(line.split()) > 2, f"{name} has no one-line description in:\n{out.err}"
    assert "seqcal COMMAND --help" in out.err and "error" not in out.err.split("commands:")[1]


# --- errors: one line, a traceback only with -v ------------------------------------------------------------
CASES = {
    "trace: a checkpoint transformers cannot load": (
        lambda d, t: ["trace", "--model", str(d["broken"])],
        ["cannot load the model", "config.json"],
    ),
    "trace: a missing --dataset file": (
        lambda d, t: ["trace", "--model", str(d["tiny"]), "--dataset", str(t / "none.txt")],
        ["none.txt"],
    ),
    "oneshot: a refused recipe": (
        lambda d, t: _oneshot(d, t, bad_recipe(t)),
        ["recipe.yaml", "OutputDistillationModifier"],
    ),
    "oneshot: a missing dataset": (
        lambda d, t: _oneshot(d, t, RTN, "--dataset", str(t / "calib.jsonl"), *SMALL),
        ["calib.jsonl"],
    ),
    "oneshot: a bad argument value": (
        lambda d, t: _oneshot(d, t, RTN, "--num-calibration-samples", "0"),
        ["num_calibration_samples"],
    ),
    "plan: a bad --max-device-memory": (
        lambda d, t: ["plan", "--model", str(d["tiny"]), "--recipe", RTN, "--max-device-memory", "8XB"],
        ["max_device_memory='8XB'", "8GB"],
    ),
    "plan: a model that does not exist": (
        lambda d, t: ["plan", "--model", str(t / "nowhere"), "--recipe", RTN],
        ["nowhere"],
    ),
    "eval ppl: a missing evaluation file": (
        lambda d, t: ["eval", "ppl", "--model", str(d["tiny"]), "--dataset", str(t / "wiki.txt")],
        ["wiki.txt"],
    ),
    "eval ppl: a bad argument type": (
        lambda d, t: ["eval", "ppl", "--model", str(d["tiny"]), "--eval-windows", "many"],
        ["--eval-windows"],
    ),
}


# -v once per subcommand (each run imports torch: seconds on a loaded machine)
WITH_V = ("trace: a checkpoint transformers cannot load", "oneshot: a refused recipe",
          "plan: a bad --max-device-memory", "eval ppl: a missing evaluation file")  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_user_error_is_one_line_and_the_traceback_needs_v(
    case: str, tiny_dir: Path, broken_dir: Path, tmp_path: Path
) -> None:
    build, fragments = CASES[case]
    args = build({"tiny": tiny_dir, "broken": broken_dir}, tmp_path)
    line = assert_user_error(seqcal(*args), *fragments)
    assert "\n" not in line
    if case not in WITH_V:
        return
    verbose = seqcal("-v", *args)  # the top-level flag; the internal-error test gives it after the command
    assert verbose.returncode == 2
    assert "Traceback (most recent call last)" in verbose.stderr
    assert verbose.stderr.rstrip().splitlines()[-1] == line


def test_an_internal_error_says_it_is_a_bug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import seqcal.entrypoint
    from seqcal.cli import main

    def broken(**kwargs: object) -> None:
        raise KeyError("subgraph 3")

    monkeypatch.setattr(seqcal.entrypoint, "oneshot", broken)
    assert main(["plan", "--model", "m", "--recipe", RTN]) == 3
    err = capsys.readouterr().err
    assert err.startswith("seqcal: error: internal error (a bug") and "KeyError: subgraph 3" in err
    assert "Traceback" not in err and "-v" in err
    assert main(["plan", "-v", "--model", "m", "--recipe", RTN]) == 3
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_seqcal_errors_share_one_base() -> None:
    from seqcal.checkpoint.preflight import DiskSpaceError
    from seqcal.checkpoint.streaming import ResumeError
    from seqcal.data.sources import CalibrationDataError
    from seqcal.errors import SeqcalError
    from seqcal.recipe.llmc_format import RecipeError
    from seqcal.tracing import TracingError

    for cls, builtin in ((TracingError, RuntimeError), (RecipeError, ValueError), (ResumeError, RuntimeError),
                         (CalibrationDataError, ValueError), (DiskSpaceError, OSError)):  # fmt: skip
        assert issubclass(cls, SeqcalError) and issubclass(cls, builtin)  # callers' except clauses still hold


# --- nothing lost ---------------------------------------------------------------------------------------
def test_oneshot_cli_without_output_dir_or_eval_is_refused_before_any_work(tiny_dir: Path) -> None:
    result = seqcal("oneshot", "--model", str(tiny_dir), "--recipe", RTN, *SMALL)
    assert_user_error(result, "--output-dir", "--eval")
    assert "one pass" not in result.stderr and "cutting" not in result.stderr  # no calibration started


def test_oneshot_on_a_directory_without_output_dir_returns_the_quantized_weights(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    original = LlamaForCausalLM.from_pretrained(tiny_dir).model.layers[0].mlp.up_proj.weight
    data = [{"input_ids": list(range(5 + i, 37 + i))} for i in range(4)]
    with caplog.at_level(logging.INFO, logger="seqcal"):
        model = oneshot(model=str(tiny_dir), dataset=data, recipe=RTN, max_seq_length=32)
    assert not [n for n, p in model.named_parameters() if p.device.type == "meta"]
    weight = model.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(weight, original)
    # W4A16 groups of 128 (one group per row here): at most 16 distinct values in each row
    assert max(len(row.unique()) for row in weight) <= 16
    assert any("into RAM" in r.getMessage() and "output_dir" in r.getMessage() for r in caplog.records)


# --- the output directory -----------------------------------------------------------------------------------
def test_an_output_dir_under_a_file_is_refused_before_calibrating(tiny_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "out"
    result = seqcal("oneshot", "--model", str(tiny_dir), "--recipe", RTN, "--output-dir", str(target), *SMALL)
    line = assert_user_error(result, str(target), "is a file")
    assert "one pass" not in result.stderr and "cutting" not in result.stderr, line


def test_an_output_dir_in_a_read_only_place_is_refused(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        parent = Path("/sys")  # root writes through permission bits; sysfs takes no new folder from anyone
        if not parent.is_dir():
            pytest.skip("running as root without /sys: no read-only place to test")
    else:
        parent = tmp_path / "ro"
        parent.mkdir()
        parent.chmod(0o555)
    with pytest.raises(PermissionError, match=rf"output_dir {parent / 'out' / 'run'} cannot be created"):
        check_output_dir(str(parent / "out" / "run"), overwrite=False, resume=False)
    assert not (parent / "out").exists()


def test_the_output_dir_check_leaves_nothing_behind(tmp_path: Path) -> None:
    check_output_dir(str(tmp_path / "a" / "b"), overwrite=False, resume=False)
    assert list(tmp_path.iterdir()) == []


# --- data arguments ---------------------------------------------------------------------------------------
def test_text_column_reaches_the_data(tiny_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "calib.jsonl"
    rows = [
        {"content": f"Sentence number {i} is about the river, the town and its old bridge."} for i in range(4)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    base = ["oneshot", "--model", str(tiny_dir), "--recipe", RTN, "--dataset", str(data), *SMALL]
    assert_user_error(seqcal(*base, "--output-dir", str(tmp_path / "a"), "--text-column", "body"), "body")
    result = seqcal(*base, "--output-dir", str(tmp_path / "b"), "--text-column", "content")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "b" / "config.json").is_file()
    # the default shows the run's decisions: how the graph is cut, once
    assert sum("seqcal: one pass: cut before each group" in line for line in result.stderr.splitlines()) == 1
    quiet = seqcal(*base, "-q", "--output-dir", str(tmp_path / "c"), "--text-column", "content")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr  # no log line, bar or library warning


def test_the_data_options_reach_oneshot(monkeypatch: pytest.MonkeyPatch) -> None:
    import seqcal.entrypoint
    from seqcal.cli import main

    seen: list[dict] = []
    monkeypatch.setattr(seqcal.entrypoint, "oneshot", lambda **kwargs: seen.append(kwargs))
    args = ["oneshot", "--model", "m", "--recipe", RTN, "--output-dir", "o", "--text-column", "content",
            "--splits", "train[:64]", "--dataset-config-name", "wikitext-2-raw-v1", "--no-shuffle"]  # fmt: skip
    assert main(args) == 0
    assert seen[0]["text_column"] == "content" and seen[0]["splits"] == "train[:64]"
    assert seen[0]["dataset_config_name"] == "wikitext-2-raw-v1"
    assert seen[0]["shuffle_calibration_samples"] is False


def test_quiet_eval_prints_the_result_only(tiny_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "eval.txt"
    text.write_text(" The river runs past the old town and under its bridge. " * 40)
    args = [
        "eval",
        "ppl",
        "--model",
        str(tiny_dir),
        "--dataset",
        str(text),
        "--seq-len",
        "32",
        "--eval-windows",
        "2",
    ]
    default, quiet = seqcal(*args), seqcal(*args, "-q")
    assert default.returncode == quiet.returncode == 0
    assert "perplexity" in default.stderr  # its progress bar and the summary line
    assert "perplexity on" in quiet.stdout and quiet.stderr == "", quiet.stderr
