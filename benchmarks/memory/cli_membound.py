"""Memory bound on the user's path: the real ``seqcal oneshot`` command on a synthetic >= 1.5B Llama.

Writes a random bf16 Llama checkpoint (hidden 2048, ``--intermediate`` 8192 as Llama-3.2-1B or 5632) shard by shard (never the whole model in RAM) with SmolLM2's tokenizer
(copied from the converted default model; vocab size 49152 to match), then runs the CLI exactly as a user
would, with the default outputs (error table, quantization_errors.png, quantization_report.json):

    seqcal oneshot --model DIR --recipe gptq.yaml --dataset TEXT --num-calibration-samples 16
                   --max-seq-length 256 --output-dir OUT --overwrite [--max-host-memory B] [--profile T]

TEXT is WikiText-2 validation (../shared/data/wiki.valid.raw) when present, else the embedded calibration
text. Peak RSS is taken two ways: GNU ``time -v`` (the CLI process) and psutil polling of the whole process
tree every 20 ms (the sum over the tree; the RSS over time goes to ``rss.tsv`` next to the output). Prints
both against the size on disk, and the plan's predicted host peak (quantization_report.json) against the measured
one when ``--max-host-memory`` makes a plan; exits 1 when the peak is above one third of the size on disk (or
above the budget given). ``--reload`` loads the checkpoint written (``evaluation.loading.load_causal_lm``) and
runs one forward.

Usage: .venv/bin/python benchmarks/memory/cli_membound.py [--layers 24] [--intermediate 8192] [--samples 16] [--seq 256]
           [--max-host-memory 900MB] [--reload] [--keep]
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

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / ".work"
RECIPE = "GPTQModifier:\n  scheme: W4A16\n  ignore: [lm_head]\n"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def make_model(path: Path, layers: int, intermediate: int) -> int:
    """The synthetic checkpoint with SmolLM2's tokenizer next to it; returns its safetensors bytes on disk."""
    from seqcal.models import default_model_dir

    if not (path / "config.json").exists() or not any(path.glob("*.safetensors")):
        write_checkpoint(path, layers, vocab_size=49152, intermediate=intermediate)  # SmolLM2's vocabulary
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
    model: Path,
    out: Path,
    text: Path,
    samples: int,
    seq: int,
    stages: bool,
    synchronous_save: bool = False,
    extra: tuple[str, ...] = (),
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
           "--max-seq-length", str(seq), "--output-dir", str(out), "--overwrite", *extra]  # fmt: skip
    print("command:", "seqcal", " ".join(cmd[3 + len(entry) :]), flush=True)
    start = time.perf_counter()
    # the user's environment: tokenizers' own default parallelism, not the test suite's setting
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    poller = TreeRSS(proc.pid)
    stdout, stderr = proc.communicate()
    poller.stop()
    seconds = time.perf_counter() - start
    print("\n".join(line for line in stderr.splitlines() if line.startswith("seqcal")), flush=True)
    if proc.returncode:
        raise SystemExit(f"seqcal oneshot failed ({proc.returncode}):\n{stderr[-4000:]}")
    if stages:
        print(stderr[stderr.index("stage" + " " * 20) : stderr.index("\tCommand being timed")].rstrip())
    stats = dict(line.strip().rsplit(": ", 1) for line in stderr.splitlines() if ": " in line)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rss.tsv").write_text("".join(f"{t:.2f}\t{r}\n" for t, r in poller.series))
    print(
        f"CPU s (user + sys): {float(stats['User time (seconds)']) + float(stats['System time (seconds)']):.0f}"
    )
    return seconds, int(stats["Maximum resident set size (kbytes)"]) * 1024, poller.peak, stdout


def reload(out: Path) -> None:
    """Load the checkpoint written (packed int4, dequantized as it loads) and run one forward on it."""
    import torch

    from seqcal.evaluation.loading import load_causal_lm

    model = load_causal_lm(out, torch.bfloat16)
    with torch.no_grad():
        logits = model(input_ids=torch.arange(16).unsqueeze(0)).logits
    if not torch.isfinite(logits).all():
        raise SystemExit(f"{out}: the reloaded checkpoint gives non-finite logits")
    print(
        f"reloaded {out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, logits finite"
    )


def predicted(out: Path) -> int | None:
    """The plan's predicted host peak from the run's quantization_report.json (None: no plan was made)."""
    import json

    report = json.loads((out / "quantization_report.json").read_text())
    return (report.get("host_memory") or {}).get("predicted_peak")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--intermediate", type=int, default=8192, help="8192: Llama-3.2-1B's MLP width")
    parser.add_argument("--max-host-memory", default=None, help="passed to seqcal oneshot; then the bound")
    parser.add_argument("--profile", action="store_true", help="write the run's trace (per-subgraph RSS)")
    parser.add_argument("--reload", action="store_true", help="load the checkpoint written and run a forward")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--keep", action="store_true", help="keep the synthetic model and the output")
    parser.add_argument("--stages", action="store_true", help="also print the peak RSS of each stage")
    parser.add_argument("--synchronous-save", action="store_true",
                        help="write the checkpoint on the calibration's thread, not on the worker")  # fmt: skip
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    shape = f"{args.layers}L" + ("" if args.intermediate == 5632 else f"-{args.intermediate}")
    budget = f"-{args.max_host_memory}" if args.max_host_memory else ""
    model, out = WORK / f"synthetic-llama-cli-{shape}", WORK / f"out-cli-{shape}{budget}"
    size = make_model(model, args.layers, args.intermediate)
    text = calibration_text()
    print(f"checkpoint: {size / 2e9:.2f}B params, {size / 1e9:.3f} GB bf16 on disk; calibration text: {text}")
    extra = ("--max-host-memory", args.max_host_memory) if args.max_host_memory else ()
    extra += ("--profile", str(out.with_suffix(".trace.json"))) if args.profile else ()
    seconds, gnu_peak, tree_peak, stdout = run_cli(
        model, out, text, args.samples, args.seq, args.stages, args.synchronous_save, extra
    )
    bound = size / 3
    if args.max_host_memory:
        from seqcal.run_args import parse_bytes

        bound = min(bound, parse_bytes(args.max_host_memory, "max_host_memory"))
    plan = predicted(out)
    if plan is not None:
        print(f"plan's predicted host peak {plan / 1e9:.3f} GB, measured {gnu_peak / 1e9:.3f} GB "
              f"({(plan - gnu_peak) / gnu_peak:+.1%})")  # fmt: skip
    if args.reload:
        reload(out)
    print(f"seqcal oneshot: {seconds:.0f} s; plot written: {(out / 'quantization_errors.png').is_file()}")
    print(f"{'':<24}{'peak RSS GB':>12}{'x size on disk':>16}")
    for name, peak in (("GNU time (CLI process)", gnu_peak), ("psutil (process tree)", tree_peak)):
        print(f"{name:<24}{peak / 1e9:>12.3f}{peak / size:>16.3f}")
    print(f"{'bound':<24}{bound / 1e9:>12.3f}{bound / size:>16.3f}")
    if not args.keep:
        shutil.rmtree(model, ignore_errors=True)
    ok = max(gnu_peak, tree_peak) <= bound
    print("within the bound" if ok else "ABOVE the bound (one third of the size on disk, or the budget)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
