"""The full architecture zoo: seqcal's trace equivalence over every model type of transformers' auto mappings.

Each architecture of ``tests/autozoo.py`` runs ``tests/autozoo_check.check`` in its own process (forked
from this one after the imports; one torch thread, a timeout each, ``--jobs`` at a time): tiny build,
eager forward, trace on batch 1 / 12 tokens, partitioned run on batch 2 / 9 tokens with left padding
compared with eager, and the subgraph count against the target layers eager calls. Prints a table
(``--markdown`` for benchmarks/RESULTS.md), the totals per status and the wall time, and writes every
result as JSON (after each architecture, so an interrupted run keeps its rows).

Example:
    $ .venv/bin/python benchmarks/tracing/full_zoo.py --jobs 2 --markdown --json out/full_zoo.json
    $ .venv/bin/python benchmarks/tracing/full_zoo.py --archs llama t5 gemma3n     # a few, plain table
    $ .venv/bin/python benchmarks/tracing/full_zoo.py --from-json out/full_zoo.json --markdown  # re-render only
    $ .venv/bin/python benchmarks/tracing/full_zoo.py --archs xlnet --update --json out/full_zoo.json  # rerun rows
    $ .venv/bin/python benchmarks/tracing/full_zoo.py --from-json out/full_zoo.json --known  # tests/autozoo_known.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from autozoo_check import STATUSES, Check  # noqa: E402

# Statuses that say something about seqcal (the others: the model does not build or run eagerly).
RAN_EAGERLY = ("ok", "count-wrong", "mismatch", "runtime-error", "refused")


def _child(model_type: str, conn: Connection) -> None:
    """Body of the forked process of one architecture: send its ``Check`` as a dict."""
    import torch

    from autozoo_check import check

    torch.set_num_threads(1)  # one thread per architecture process: --jobs of them share the cores
    try:
        conn.send(asdict(check(model_type)))
    finally:
        conn.close()
        # Skip interpreter shutdown: finalizing the heap inherited from the parent touches (copies) all
        # of it, which costs seconds per architecture.
        os._exit(0)


def run_all(names: Sequence[str], jobs: int, timeout: float) -> Iterator[Check]:
    """Check ``names``, each in its own forked process, ``jobs`` at a time; yields results as they end.

    The parent imports torch, transformers and seqcal once, so a child starts in milliseconds instead of
    re-importing them; a child that crashes or outlives ``timeout`` becomes a ``runtime-error`` result.
    """
    import transformers
    from transformers.models.auto import modeling_auto  # noqa: F401

    import autozoo_check  # noqa: F401 - imported before forking, so every child has them
    import seqcal  # noqa: F401
    from seqcal import trace_subgraphs  # noqa: F401

    transformers.PreTrainedModel  # noqa: B018 - resolves the lazy module once, here

    context = multiprocessing.get_context("fork")
    pending, running = list(names), {}
    try:
        yield from _schedule(context, pending, running, jobs, timeout)
    finally:  # interrupted: no child outlives the run
        for process, _receive, _started in running.values():
            process.kill()


def _schedule(
    context: Any, pending: list[str], running: dict[str, Any], jobs: int, timeout: float
) -> Iterator[Check]:
    while pending or running:
        while pending and len(running) < max(1, jobs):
            name = pending.pop(0)
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(name, send), daemon=True)
            process.start()
            send.close()
            running[name] = (process, receive, time.perf_counter())
        for name, (process, receive, started) in list(running.items()):
            elapsed = time.perf_counter() - started
            result = None
            if receive.poll():
                try:
                    result = Check(**receive.recv())
                except EOFError:
                    result = Check(name, status="runtime-error", error=f"worker exit {process.exitcode}")
            elif not process.is_alive():
                result = Check(name, status="runtime-error", error=f"worker exit {process.exitcode}")
            elif elapsed > timeout:
                process.kill()
                result = Check(name, status="runtime-error", error=f"timeout after {timeout:.0f}s")
            if result is not None:
                process.join(1)  # it exits right after sending
                del running[name]
                result.seconds = result.seconds or round(elapsed, 2)
                yield result
        time.sleep(0.05)


def totals(results: Sequence[Check], wall: float | None = None) -> dict[str, object]:
    """Counts per status, and the acceptance numbers over the architectures that run eagerly."""
    counts = Counter(r.status for r in results)
    ran = [r for r in results if r.status in RAN_EAGERLY]
    equal = [r for r in ran if r.status in ("ok", "count-wrong")]
    count_right = [r for r in ran if r.count is not None and r.count == r.expected]
    out: dict[str, object] = {"architectures": len(results), **{s: counts.get(s, 0) for s in STATUSES}}
    out["run eagerly"] = len(ran)
    out["outputs equal eager"] = f"{len(equal)}/{len(ran)} ({100 * len(equal) / max(len(ran), 1):.1f}%)"
    out["subgraph count right"] = (
        f"{len(count_right)}/{len(ran)} ({100 * len(count_right) / max(len(ran), 1):.1f}%)"
    )
    out["silent mismatches"] = counts.get("mismatch", 0)
    out["seconds per arch (median / max)"] = _median_max([r.seconds for r in results])
    if wall is not None:
        out["wall time"] = f"{wall:.0f} s"
    return out


def _median_max(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[len(ordered) // 2]:.1f} / {ordered[-1]:.1f}"


def _row(r: Check) -> list[str]:
    count = "-" if r.count is None else f"{r.count}/{r.expected}"
    error = f"{r.error} ({r.where})" if r.where else r.error
    return [r.model_type, r.class_name, r.family, r.status, count, f"{r.seconds:.1f}", error]


def render(results: Sequence[Check], markdown: bool, wall: float | None = None) -> str:
    """The per-architecture table and the totals, as plain text or markdown."""
    head = ["arch", "class", "family", "status", "subgraphs/want", "s", "error (where)"]
    body = [_row(r) for r in results]
    sums = totals(results, wall)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(x.replace("|", "\\|") for x in row) + " |" for row in body]
        lines += ["", "| total | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in sums.items()]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head) - 1)] + [0]
    lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in [head, *body]]
    return "\n".join(lines + [""] + [f"{k}: {v}" for k, v in sums.items()])


def known(results: Sequence[Check]) -> str:
    """``tests/autozoo_known.py``'s ``KNOWN`` dict for these results: every model type that is not ok."""
    lines = ["KNOWN: dict[str, tuple[str, str]] = {"]
    for r in results:
        if r.status != "ok":
            error = f"{r.error} ({r.where})" if r.where else r.error
            lines.append(f"    {r.model_type!r}: ({r.status!r}, {error!r}),")
    return "\n".join(lines + ["}"])


def _merge(results: Sequence[Check], fresh: Sequence[Check]) -> list[Check]:
    """``results`` with the rows of ``fresh`` replacing theirs (reruns of some architectures)."""
    merged = {r.model_type: r for r in results}
    merged.update({r.model_type: r for r in fresh})
    return sorted(merged.values(), key=lambda r: r.model_type)


def _load(path: Path) -> tuple[list[Check], float | None]:
    data = json.loads(path.read_text())
    return [Check(**r) for r in data["results"]], data.get("wall_s")


def _write(path: Path, results: Sequence[Check], wall: float | None, jobs: int) -> None:
    """The run as JSON; ``wall_s`` is None until the run is complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(results, key=lambda r: r.model_type)
    payload = {
        "wall_s": None if wall is None else round(wall, 1),
        "jobs": jobs,
        "results": [asdict(r) for r in ordered],
    }
    path.write_text(json.dumps(payload, indent=1))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="*", help="model types (default: every candidate)")
    parser.add_argument("--jobs", type=int, default=2, help="processes at a time")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per architecture")
    parser.add_argument("--markdown", action="store_true", help="print markdown for benchmarks/RESULTS.md")
    parser.add_argument("--known", action="store_true", help="print KNOWN of tests/autozoo_known.py instead")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--from-json", type=Path, help="render the results of an earlier --json run")
    parser.add_argument(
        "--update", action="store_true", help="rerun --archs into --json, keep its other rows"
    )
    parser.add_argument(
        "--merge", nargs="*", type=Path, help="with --from-json: JSON files of reruns of some rows"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the zoo (or re-render a JSON of an earlier run) and print the table and totals."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.from_json:
        results, wall = _load(args.from_json)
        for extra in args.merge or ():  # reruns of some rows replace them
            results = _merge(results, _load(extra)[0])
        if args.json:
            _write(args.json, results, wall, args.jobs)
        print(known(results) if args.known else render(results, args.markdown, wall))
        return 0
    if args.update and not (args.json and args.json.is_file() and args.archs):
        parser.error("--update needs --archs and the --json file of an earlier full run")
    from autozoo import candidates

    archs = candidates()
    names = args.archs or list(archs)
    unknown = sorted(set(names) - set(archs))
    if unknown:
        parser.error(f"unknown --archs {unknown}; valid: {sorted(archs)}")
    start = time.perf_counter()
    results = []
    for result in run_all(names, args.jobs, args.timeout):
        result.class_name = result.class_name or archs[result.model_type].class_name
        result.family = result.family or archs[result.model_type].family
        results.append(result)
        if args.json and not args.update:  # after every result, so an interrupted run keeps its rows
            _write(args.json, results, None, args.jobs)
        print(f"[{len(results)}/{len(names)} {result.model_type}] {result.status} {result.error[:120]}",
              file=sys.stderr, flush=True)  # fmt: skip
    wall: float | None = time.perf_counter() - start
    if args.update:
        earlier, wall = _load(args.json)
        results = _merge(earlier, results)
    results.sort(key=lambda r: r.model_type)
    if args.json:
        _write(args.json, results, wall, args.jobs)
    print(known(results) if args.known else render(results, args.markdown, wall))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the finally that kills the children
    sys.exit(main())
