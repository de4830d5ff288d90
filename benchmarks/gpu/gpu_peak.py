"""Where a run's peak device memory goes: every CUDA allocation of a runner recorded, the live ones at the peak
grouped by the line of seqcal (or of the script) that made them.

The profile's samples between spans miss the peak (it lies inside a span), and its summary names only the span.
This runs a benchmark runner (``run_seqcal.py`` and its arguments) under torch's allocation history
(``torch.cuda.memory._record_memory_history``, Python frames only), replays the history after the run (allocated
bytes rise at each ``alloc`` and fall at each ``free_completed``, as ``torch.cuda.memory_allocated`` counts them),
and prints the blocks alive at the highest point: their sum, and per site (the innermost frame in seqcal, else in
the runner) their count and bytes, with the innermost frame of all (the torch call) of the largest block.

    SEQCAL_BENCH_GROUP_SIZE=128 PYTHONPATH=src:benchmarks/_lib python benchmarks/gpu/gpu_peak.py --report peak.txt \\
        benchmarks/_lib/run_seqcal.py --algo gptq --dtype bfloat16 --model M --tokens T --samples 64 --out O

``benchmarks/gpu/gpu_all.sh`` runs it on the 1B Llama of its comparison.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

MAX_ENTRIES = 2_000_000  # allocation events kept (the oldest go first); a 64-sample 1B run makes far fewer


def live_at_peak(events: Iterable[Mapping[str, Any]]) -> tuple[int, int, dict[int, tuple[int, list]]]:
    """Replay allocation events: (peak bytes, index of the event that reached it, live blocks then: addr -> (size,
    frames)). Frees of blocks allocated before the history started are ignored.

    Example:
        >>> live_at_peak([{"action": "alloc", "addr": 1, "size": 8}, {"action": "alloc", "addr": 2, "size": 4},
        ...               {"action": "free_completed", "addr": 1, "size": 8}])[:2]
        (12, 1)
    """
    live: dict[int, tuple[int, list]] = {}
    current = peak = 0
    at, snapshot = -1, {}
    for i, event in enumerate(events):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames") or [])
            current += event["size"]
            if current > peak:
                peak, at, snapshot = current, i, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])[0]
    return peak, at, snapshot


def site(frames: Sequence[Mapping[str, Any]], prefixes: Sequence[str]) -> str:
    """The innermost frame whose file lies under one of ``prefixes`` (``file:line in function``), else the
    innermost frame of all."""
    chosen = next((f for f in frames if any(p in str(f.get("filename", "")) for p in prefixes)), None)
    chosen = chosen or (frames[0] if frames else {})
    where = Path(str(chosen.get("filename", "?")))
    return f"{'/'.join(where.parts[-3:])}:{chosen.get('line', '?')} in {chosen.get('name', '?')}"


def report(peak: int, live: Mapping[int, tuple[int, list]], top: int = 20) -> str:
    """The table of live blocks at the peak, by site, largest first."""
    sites: dict[str, list[int]] = {}
    example: dict[str, list] = {}
    for size, frames in live.values():
        key = site(frames, ("/seqcal/", "benchmarks/"))
        sites.setdefault(key, []).append(size)
        if size >= max(sites[key]):
            example[key] = frames
    mib = 2**20
    lines = [f"peak allocated {peak / mib:.1f} MiB in {len(live)} blocks", f"{'MiB':>9} {'blocks':>6}  site"]
    for key, sizes in sorted(sites.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"{sum(sizes) / mib:9.1f} {len(sizes):6d}  {key}  [largest {max(sizes) / mib:.1f} MiB, "
                     f"made by {site(example[key], ('',))}]")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, default=None, help="also write the table here")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("runner", help="a benchmark runner script, then its own arguments")
    args, rest = parser.parse_known_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_peak.py: needs a CUDA device")
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    sys.argv = [args.runner, *rest]
    sys.path.insert(0, str(Path(args.runner).resolve().parent))
    runpy.run_path(args.runner, run_name="__main__")
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, at, live = live_at_peak(trace)
    text = report(peak, live, args.top)
    if at >= 0:  # the allocation that reached the peak, innermost frame first: what the run was doing
        frames = trace[at].get("frames") or []
        text += "\nthe allocation that reached it, from:\n" + "\n".join(
            f"  {site([f], ('',))}" for f in frames[:12]
        )
    text += f"\n(torch.cuda.max_memory_allocated: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB; the history "
    text += f"holds {len(trace)} events, the peak at event {at})"
    print(text)
    if args.report is not None:
        args.report.write_text(text + "\n")


if __name__ == "__main__":
    main()
