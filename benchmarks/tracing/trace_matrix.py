"""Side-by-side tracing coverage: seqcal vs llm-compressor 0.14 over the architecture zoo.

For every architecture of ``tests/zoo.py`` and every tool, a fresh subprocess (in that tool's venv)
builds the tiny model, traces it on ``make_inputs(batch=1, seq_len=12)``, then runs the partitioned
model on other inputs (``batch=2, seq_len=9, left_pad=3``) and compares the primary output (logits,
else last_hidden_state, else the first tensor) with eager ``model(**inputs)``: max abs diff
<= 1e-5 * max(1, |ref|max). The subgraph count is right when it equals the number of zoo target
modules (``target_class`` and ``other_targets`` instances) the forward calls, plus one.

The seqcal side runs in ``.venv`` (this file, ``--worker``); the peer side runs
``benchmarks/tracing/_peer_trace.py`` in ``.peer-venv`` (made by ``benchmarks/setup_peer.sh``). Both reuse
``evaluate`` of ``benchmarks/tracing/_trace_common.py``, so they differ only in the trace and run calls. These
modules import only the standard library and torch at top level, so the peer venv can import them.

Example:
    $ bash benchmarks/setup_peer.sh
    $ .venv/bin/python benchmarks/tracing/trace_matrix.py                 # plain table + totals
    $ .venv/bin/python benchmarks/tracing/trace_matrix.py --markdown      # markdown for RESULTS.md
    $ .venv/bin/python benchmarks/tracing/trace_matrix.py --archs llama t5 --json out/trace.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from _trace_common import MARKER, REPO, TOLERANCE, TOOLS, Adapter, Result, emit, evaluate, short_error

# ------------------------------------------------------------------------------------- worker side


def _seqcal_trace(model: Any, sample: dict[str, Any]) -> tuple[Any, int, str]:
    from seqcal import trace_subgraphs

    subgraphs = trace_subgraphs(model, sample)
    return subgraphs, len(subgraphs), ""


SEQCAL = Adapter("seqcal", _seqcal_trace, lambda _model, subgraphs, inputs: subgraphs.run(**inputs))


def worker_main(arch: str, adapter: Adapter = SEQCAL) -> None:
    """Entry point of a worker process: print one result line; any crash becomes an ``error`` cell."""
    try:
        emit(evaluate(arch, adapter))
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        emit(Result(arch, adapter.tool, status="error", error=f"worker: {short_error(exc)}"))


# ------------------------------------------------------------------------------- orchestrator side


def run_cell(arch: str, tool: str, timeout: float) -> Result:
    """Run one worker subprocess for (arch, tool) and parse its result; crashes become errors."""
    python, script = TOOLS[tool]
    if not python.exists():
        hint = "bash benchmarks/setup_peer.sh" if tool == "peer" else "make venv"
        return Result(arch, tool, status="error", error=f"{python} missing; run `{hint}`")
    args = [str(python), str(script), "--worker", arch]
    # One thread per worker keeps CPU use moderate; the models are tiny anyway.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return Result(arch, tool, status="error", error=f"timeout after {timeout:.0f}s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            return Result(**json.loads(line[len(MARKER) :]))
    tail = (proc.stderr.strip().splitlines() or ["<no stderr>"])[-1]
    return Result(arch, tool, status="error", error=f"worker exit {proc.returncode}: {tail[:160]}")


def _traced(r: Result) -> str:
    if r.status == "n/a":
        return "n/a in transformers " + r.versions.get("transformers", "?")
    return "yes" if r.traced else "no: " + r.error.removeprefix("trace: ")


def _count(r: Result) -> str:
    if r.count is None:
        return "-"
    return "yes" if r.count == r.expected else f"no ({r.count}, want {r.expected})"


def _equal(r: Result) -> str:
    if r.equal is None:
        return "-"
    if r.error.startswith("run:"):
        return "no: " + r.error.removeprefix("run: ")
    via = "" if r.compared == "output" else f" (via {r.compared})"
    if r.equal:
        return "yes" + via
    if r.diff is None or r.diff <= TOLERANCE * (r.scale or 1.0):  # structural: see the notes
        return "no" + via
    return f"no{via}: diff {r.diff:.2g} (scale {r.scale:.2g}) at {r.worst}"


def _cells(r: Result) -> list[str]:
    return [_traced(r), _count(r), _equal(r)]


def totals(results: Sequence[Result]) -> dict[str, int]:
    """Counts for one tool: archs, n/a, traced, count right, output equal, all three right."""
    ok = [r for r in results if r.status != "n/a"]
    return {
        "archs": len(results),
        "n/a": len(results) - len(ok),
        "traced": sum(r.traced for r in ok),
        "count right": sum(r.count is not None and r.count == r.expected for r in ok),
        "output equal": sum(bool(r.equal) for r in ok),
        "all right": sum(r.traced and r.count == r.expected and bool(r.equal) for r in ok),
    }


def _settings_summary(tool: str, results: Sequence[Result]) -> str:
    """One line on how much the tool's run settings move the eager output (the reference it gets)."""
    moved = [r for r in results if r.settings_diff]
    if not moved:
        return ""
    worst = max(r.settings_diff[0] for r in moved)
    unpadded = max(
        (r.settings_diff[1] for r in moved if r.settings_diff[1] == r.settings_diff[1]), default=worst
    )
    return (
        f"{tool}: its run settings change the eager output in {len(moved)}/{len(results)} archs, by up to "
        f"{worst:.2g}, but by at most {unpadded:.2g} on unpadded tokens; each tool is compared with the "
        "unpartitioned model run under its own settings"
    )


def render(rows: dict[str, dict[str, Result]], markdown: bool) -> str:
    """The side-by-side table, totals and notes, as plain text or markdown."""
    tools = list(next(iter(rows.values())))
    head = ["arch", "family"] + [f"{t} {c}" for t in tools for c in ("traced", "count", "equal")]
    body = [
        [a, next(iter(c.values())).family or "-"] + [x for t in tools for x in _cells(c[t])]
        for a, c in rows.items()
    ]
    sums = {t: totals([c[t] for c in rows.values()]) for t in tools}
    notes = [f"{a} ({t}): {c[t].note}" for a, c in rows.items() for t in tools if c[t].note]
    notes += [_settings_summary(t, [c[t] for c in rows.values()]) for t in tools]
    notes = [n for n in notes if n]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(x.replace("|", "\\|") for x in row) + " |" for row in body]
        lines += ["", "| totals | " + " | ".join(tools) + " |", "|---|" + "---|" * len(tools)]
        lines += [f"| {k} | " + " | ".join(str(sums[t][k]) for t in tools) + " |" for k in sums[tools[0]]]
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
        return "\n".join(lines)
    widths = [max(len(str(row[i])) for row in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [head, *body]]
    lines += ["", "totals: " + "; ".join(f"{t}: {sums[t]}" for t in tools), ""]
    return "\n".join(lines + [f"note: {n}" for n in notes])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the matrix (one subprocess at a time) and print it; ``--worker`` runs one seqcal cell."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="ARCH", help=argparse.SUPPRESS)
    parser.add_argument("--archs", nargs="*", help="zoo keys (default: the whole zoo)")
    parser.add_argument("--tools", nargs="*", default=list(TOOLS), choices=list(TOOLS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per (arch, tool) subprocess")
    parser.add_argument("--markdown", action="store_true", help="print markdown for benchmarks/RESULTS.md")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    sys.path.insert(0, str(REPO / "tests"))
    from zoo import ARCHS

    archs = args.archs or list(ARCHS)
    unknown = sorted(set(archs) - set(ARCHS))
    if unknown:
        parser.error(f"unknown --archs {unknown}; valid: {sorted(ARCHS)}")
    rows: dict[str, dict[str, Result]] = {}
    for arch in archs:
        rows[arch] = {}
        for tool in args.tools:
            result = run_cell(arch, tool, args.timeout)
            result.family = result.family or ARCHS[arch].family
            rows[arch][tool] = result
            print(f"[{arch} / {tool}] {' | '.join(_cells(result))}", file=sys.stderr, flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({a: {t: asdict(r) for t, r in c.items()} for a, c in rows.items()}, indent=1)
        )
    print(render(rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
