"""Memory bound on the user's path: the real ``seqcal oneshot`` command on a synthetic >= 1.5B Llama.

Writes a random bf16 Llama checkpoint shard by shard (never the whole model in RAM) with SmolLM2's tokenizer
(copied from the converted default model; vocab size 49152 to match), then runs the CLI exactly as a user
would, with the default outputs (error table, quantization_errors.png, quantization_report.json):

    seqcal oneshot --model DIR --recipe gptq.yaml --dataset TEXT --num-calibration-samples 16
                   --max-seq-length 256 --output-dir OUT --overwrite

TEXT is WikiText-2 validation (../shared/data/wiki.valid.raw) when present, else the embedded calibration
text. Peak RSS is taken two ways: GNU ``time -v`` (the CLI process) and psutil polling of the whole process
tree every 20 ms (the sum over the tree; the RSS over time goes to ``rss.tsv`` next to the output). Prints
both against the size on disk and exits 1 when the peak is above one third of it.

Usage: .venv/bin/python benchmarks/cli_membound.py [--layers 32] [--samples 16] [--seq 256] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from big_offload import write_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "benchmarks" / ".work"
RECIPE = "GPTQModifier:\n  scheme: W4A16\n  ignore: [lm_head]\n"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def make_model(path: Path, layers: int) -> int:
    """The synthetic checkpoint with SmolLM2's tokenizer next to it; returns its safetensors bytes on disk."""
    from seqcal.models import default_model_dir

    if not (path / "config.json").exists() or not any(path.glob("*.safetensors")):
        write_checkpoint(path, layers, vocab_size=49152)  # SmolLM2's vocabulary
    source = Path(default_model_dir())
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def calibration_text() -> Path:
    """WikiText-2 validation if it is next to the repository, else the embedded text written to a file."""
    wiki = ROOT.parent / "shared" / "data" / "wiki.valid.raw"
    for candidate in (wiki, Path("/work/shared/data/wiki.valid.raw")):
        if candidate.is_file():
            return candidate
    from seqcal.data.batches import default_calibration_text

    out = WORK / "calibration.txt"
    out.write_text(default_calibration_text(), encoding="utf-8")
    return out


class TreeRSS:
    """Polls the RSS summed over a process and its children; keeps the peak and the series."""

    def __init__(self, pid: int, period: float = 0.02) -> None:
        self.root, self.period = psutil.Process(pid), period
        self.peak, self.series, self.start = 0, [], time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        total = 0
        for proc in [self.root, *self.root.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.Error:  # exited between listing and reading
                pass
        return total

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                rss = self._rss()
            except psutil.Error:
                break
            self.peak = max(self.peak, rss)
            self.series.append((time.perf_counter() - self.start, rss))
            time.sleep(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_cli(
    model: Path, out: Path, text: Path, samples: int, seq: int, stages: bool, synchronous_save: bool = False
) -> tuple[float, int, int, str]:
    """Runs ``seqcal oneshot`` under GNU time; returns seconds, GNU time's peak, the tree's peak, stdout.

    With ``stages`` the command runs in-process under ``_rss_stages.py``, which adds the peak RSS of each stage;
    with ``synchronous_save`` the checkpoint's files are written on the calibration's thread
    (``streaming.BACKGROUND = False``, set before the command runs).
    """
    recipe = WORK / "gptq_w4a16.yaml"
    recipe.write_text(RECIPE)
    script = str(Path(__file__).with_name("_rss_stages.py"))
    entry = [script] if stages else ["-m", "seqcal.cli"]
    if synchronous_save:
        run = f"runpy.run_path({script!r}, run_name='__main__')" if stages else \
            "runpy.run_module('seqcal.cli', run_name='__main__', alter_sys=True)"  # fmt: skip
        entry = ["-c", "import runpy, sys; import seqcal.checkpoint.streaming as s; s.BACKGROUND = False; "
                 f"sys.argv[0] = 'seqcal'; {run}"]  # fmt: skip
    cmd = ["/usr/bin/time", "-v", sys.executable, *entry, "oneshot", "--model", str(model),
           "--recipe", str(recipe), "--dataset", str(text), "--num-calibration-samples", str(samples),
           "--max-seq-length", str(seq), "--output-dir", str(out), "--overwrite"]  # fmt: skip
    print("command:", "seqcal", " ".join(cmd[3 + len(entry) :]), flush=True)
    start = time.perf_counter()
    # the user's environment: tokenizers' own default parallelism, not the test suite's setting
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    poller = TreeRSS(proc.pid)
    stdout, stderr = proc.communicate()
    poller.stop()
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"seqcal oneshot failed ({proc.returncode}):\n{stderr[-4000:]}")
    if stages:
        print(stderr[stderr.index("stage" + " " * 20) : stderr.index("\tCommand being timed")].rstrip())
    stats = dict(line.strip().rsplit(": ", 1) for line in stderr.splitlines() if ": " in line)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rss.tsv").write_text("".join(f"{t:.2f}\t{r}\n" for t, r in poller.series))
    return seconds, int(stats["Maximum resident set size (kbytes)"]) * 1024, poller.peak, stdout


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--keep", action="store_true", help="keep the synthetic model and the output")
    parser.add_argument("--stages", action="store_true", help="also print the peak RSS of each stage")
    parser.add_argument("--synchronous-save", action="store_true",
                        help="write the checkpoint on the calibration's thread, not on the worker")  # fmt: skip
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    model, out = WORK / f"synthetic-llama-cli-{args.layers}L", WORK / f"out-cli-{args.layers}L"
    size = make_model(model, args.layers)
    text = calibration_text()
    print(f"checkpoint: {size / 2e9:.2f}B params, {size / 1e9:.3f} GB bf16 on disk; calibration text: {text}")
    seconds, gnu_peak, tree_peak, stdout = run_cli(
        model, out, text, args.samples, args.seq, args.stages, args.synchronous_save
    )
    bound = size / 3
    print(f"seqcal oneshot: {seconds:.0f} s; plot written: {(out / 'quantization_errors.png').is_file()}")
    print(f"{'':<24}{'peak RSS GB':>12}{'x size on disk':>16}")
    for name, peak in (("GNU time (CLI process)", gnu_peak), ("psutil (process tree)", tree_peak)):
        print(f"{name:<24}{peak / 1e9:>12.3f}{peak / size:>16.3f}")
    print(f"{'bound (one third)':<24}{bound / 1e9:>12.3f}{1 / 3:>16.3f}")
    if not args.keep:
        shutil.rmtree(model, ignore_errors=True)
    ok = max(gnu_peak, tree_peak) <= bound
    print("within the bound" if ok else "ABOVE the bound of one third of the size on disk")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
