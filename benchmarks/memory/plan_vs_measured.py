"""The memory plan's predicted host peak against the measured one, through the ``seqcal oneshot`` command.

Runs GPTQ W4A16 g64 (``recipes/gptq_w4a16_g64.yaml``) on SmolLM2-135M (``--model default``, float32) with 32 x 512
tokens of WikiText-2 validation (``--concatenate``) under GNU ``time -v``, four ways, each in a fresh process:

    a  default    --max-host-memory 8GB (the plan is made; not binding): the one-pass cut, the cache in RAM
    b  layer-cut  the same with --layer-cut (a calibration and a propagation pass per layer)
    c  disk       the same with --offload disk (the activation cache in files)
    d  binding    --max-host-memory 5% under (a)'s predicted peak: the run must choose (its "max_host_memory ..."
                  lines) and stay under the budget

Prints one table: the case, the plan's predicted host peak (quantization_report.json's ``host_memory``), the
measured peak (the report's, VmHWM, and GNU time's maximum RSS), their difference (predicted vs GNU time), wall
and CPU (user + sys) seconds, then each run's decisions. Exits 1 when a case's prediction is off by more than 10%
(of either measured peak) or a run exceeds a budget that binds. ``--profile`` writes each run's Chrome trace
(``benchmarks/.work/planpeak-<case>.trace.json``; ``--work`` names another folder, for cases run side by side),
whose per-subgraph RSS shows which part of the plan is off. Case d also fails when its budget chose nothing (its
own process may measure a lower baseline than a's and predict under the budget).

Usage (from the repo root):
    PYTHONPATH=src .venv/bin/python benchmarks/memory/plan_vs_measured.py [--cases a b c d] [--samples 32] [--seq 512]
        [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / ".work"
RECIPE = ROOT / "recipes" / "gptq_w4a16_g64.yaml"
TOLERANCE = 0.10  # the claim: the prediction within 10% of the measured peak
BINDING = 0.95  # case d's budget: this fraction of case a's predicted peak
CHOICES = ("instead of", "spills", "own memory")  # words of fit_host's decisions that change the run
CASES = {
    "a": ("default", ()),
    "b": ("layer-cut", ("--layer-cut",)),
    "c": ("disk", ("--offload", "disk")),
    "d": ("binding", ()),
}


@dataclass
class Run:
    """One case's measurements: bytes and seconds, and the plan's decisions."""

    case: str
    budget: int
    predicted: int
    reported: int
    gnu_peak: int
    wall: float
    cpu: float
    decisions: list[str] = field(default_factory=list)

    def off(self, measured: int) -> float:
        """The prediction's relative difference from ``measured`` (positive: the plan says more; 0 if refused)."""
        return (self.predicted - measured) / measured if self.predicted else 0.0


def calibration_text() -> Path:
    """WikiText-2 validation beside the repository (``../shared/data``), where the benchmarks expect it."""
    for candidate in (
        ROOT.parent / "shared" / "data" / "wiki.valid.raw",
        Path("/work/shared/data/wiki.valid.raw"),
    ):
        if candidate.is_file():
            return candidate
    raise SystemExit("plan_vs_measured: WikiText-2 (wiki.valid.raw) is not in ../shared/data; put it there.")


def run_case(case: str, budget: int, args: argparse.Namespace) -> Run:
    """Runs ``seqcal oneshot`` for ``case`` with ``--max-host-memory budget`` under GNU time; returns its Run.

    Raises:
        SystemExit: the command failed (its last lines of stderr), or its report holds no plan.
    """
    name, extra = CASES[case]
    out = args.work / f"planpeak-{name}"
    if args.profile:
        extra += ("--profile", str(args.work / f"planpeak-{name}.trace.json"))
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "seqcal.cli", "oneshot", "--model", "default",
           "--dtype", "float32", "--recipe", str(RECIPE), "--dataset", str(calibration_text()),
           "--num-calibration-samples", str(args.samples), "--max-seq-length", str(args.seq), "--concatenate",
           "--output-dir", str(out), "--overwrite", "--max-host-memory", str(budget), *extra]  # fmt: skip
    print(f"[{case}] seqcal {' '.join(cmd[5:])}", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}  # the user's environment
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - start
    stats = dict(line.strip().rsplit(": ", 1) for line in proc.stderr.splitlines() if ": " in line)
    refusal = [line for line in proc.stderr.splitlines() if "cannot be kept" in line]
    if proc.returncode and refusal:  # the plan's floor is above the budget: refused before any weight is read
        return Run(f"{case} {name}", budget, 0, 0, int(stats["Maximum resident set size (kbytes)"]) * 1024, wall,
                   float(stats["User time (seconds)"]) + float(stats["System time (seconds)"]), refusal)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"[{case}] seqcal oneshot failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    host = json.loads((out / "quantization_report.json").read_text()).get("host_memory") or {}
    if host.get("predicted_peak") is None:
        raise SystemExit(
            f"[{case}] {out}/quantization_report.json holds no predicted peak: no plan was made."
        )
    logged = [line for line in proc.stderr.splitlines() if "max_host_memory" in line]
    return Run(
        case=f"{case} {name}",
        budget=budget,
        predicted=host["predicted_peak"],
        reported=host["measured_peak"],
        gnu_peak=int(stats["Maximum resident set size (kbytes)"]) * 1024,
        wall=wall,
        cpu=float(stats["User time (seconds)"]) + float(stats["System time (seconds)"]),
        decisions=logged or list(host.get("decisions", [])),
    )


def verdicts(run: Run, binding: bool) -> list[str]:
    """What is wrong with ``run``: a prediction off by more than TOLERANCE, a binding budget exceeded."""
    if not run.predicted:
        return [f"{run.case}: refused, {run.decisions[0]}"]
    wrong = [f"{run.case}: predicted {run.off(m):+.1%} vs {what}" for what, m in
             (("the report's peak", run.reported), ("GNU time's peak", run.gnu_peak)) if abs(run.off(m)) > TOLERANCE]  # fmt: skip
    if binding and max(run.reported, run.gnu_peak) > run.budget:
        wrong.append(f"{run.case}: peak {max(run.reported, run.gnu_peak) / 1e9:.3f} GB above the budget "
                     f"{run.budget / 1e9:.3f} GB")  # fmt: skip
    if binding and not any(w in d for d in run.decisions for w in CHOICES):
        wrong.append(f"{run.case}: the budget did not bind (the run chose nothing: {run.decisions})")
    return wrong


def table(runs: list[Run]) -> str:
    """The results as a Markdown table (GB are 1e9 bytes)."""
    lines = ["| case | budget GB | predicted GB | measured GB (report) | measured GB (GNU time) | difference "
             "| wall s | CPU s |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        if not r.predicted:
            lines.append(f"| {r.case} | {r.budget / 1e9:.3f} | refused | - | {r.gnu_peak / 1e9:.3f} | - | "
                         f"{r.wall:.0f} | {r.cpu:.0f} |")  # fmt: skip
            continue
        lines.append(f"| {r.case} | {r.budget / 1e9:.3f} | {r.predicted / 1e9:.3f} | {r.reported / 1e9:.3f} | "
                     f"{r.gnu_peak / 1e9:.3f} | {r.off(r.gnu_peak):+.1%} | {r.wall:.0f} | {r.cpu:.0f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--budget", type=int, default=8 * 10**9, help="bytes for cases a-c (default 8 GB)")
    parser.add_argument("--binding", type=int, default=None,
                        help="case d's budget in bytes (default: 95%% of case a's predicted peak; a runs first)")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="write each run's Chrome trace")
    parser.add_argument(
        "--work", type=Path, default=WORK, help="where the outputs go (default benchmarks/.work)"
    )
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    runs, wrong = [], []
    for case in args.cases:
        if (
            case == "d" and args.binding is None
        ):  # case a's prediction, run for it when a is not among the cases
            first = next((r for r in runs if r.case.startswith("a ")), None) or run_case(
                "a", args.budget, args
            )
            args.binding = int(BINDING * first.predicted)
        run = run_case(case, args.binding if case == "d" else args.budget, args)
        runs.append(run)
        wrong += verdicts(run, binding=case == "d")
        print(f"[{case}] predicted {run.predicted / 1e9:.3f} GB, measured {run.gnu_peak / 1e9:.3f} GB "
              f"({run.off(run.gnu_peak):+.1%}), {run.wall:.0f} s", flush=True)  # fmt: skip
    print(table(runs))
    for run in runs:
        print(f"{run.case}:", *run.decisions, sep="\n  ")
    print(
        "\n".join(wrong) if wrong else f"every prediction within {TOLERANCE:.0%}; every binding budget kept"
    )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
