"""Memory plan vs measurement: ``oneshot(dry_run=True)``'s predicted peaks next to a real run's, per subgraph.

Two fresh processes: one asks for the plan (no weight read), one runs ``oneshot`` while a thread samples the
process RSS every 2 ms and charges each sample to the subgraph the profiler says is running (its open
``subgraph N`` span; the time between spans goes to the last one). On a cpu-only machine the device is the
host, so the plan's per-subgraph ``host`` (baseline + cache + pending checkpoint + the device's share) is
compared with the measured peak RSS of that subgraph, and the plan's host peak with the run's peak RSS.

Usage (from the repo root):
    .venv/bin/python benchmarks/memory/plan_accuracy.py --model benchmarks/.work/synthetic-llama-32L --samples 16 --seq 256
    .venv/bin/python benchmarks/memory/plan_accuracy.py --model default --tokens benchmarks/.work/calib_128x512.safetensors \\
        --dtype bfloat16 --group-size 64
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / ".work"
GIB = 1024**3

COMMON = """
import json, sys, torch
from seqcal.entrypoint import oneshot
from seqcal.models import resolve_model
cfg = json.loads(sys.argv[1])
model = str(resolve_model(cfg["model"]))
if cfg["tokens"]:
    from safetensors.torch import load_file
    data = [{"input_ids": r.tolist()} for r in load_file(cfg["tokens"])["input_ids"][: cfg["samples"], : cfg["seq"]]]
else:
    vocab = json.load(open(model + "/config.json"))["vocab_size"]
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, vocab, (cfg["seq"],), generator=g).tolist()} for _ in range(cfg["samples"])]
scheme = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                         "strategy": "group", "group_size": cfg["group_size"]}}}
from seqcal.modifiers import GPTQModifier
kw = dict(model=model, dataset=data, recipe=GPTQModifier(config_groups=scheme, ignore=["lm_head"]),
          num_calibration_samples=len(data), max_seq_length=cfg["seq"], dtype=cfg["dtype"],
          shuffle_calibration_samples=False)
"""

PLAN = (
    COMMON
    + """
plan = oneshot(**kw, dry_run=True)
rows = [{"index": r.index, "targets": r.targets, "device": r.device_peak, "host": r.host, "cache": r.host_cache}
        for r in plan.rows]
print(plan.table(), file=sys.stderr)
print(json.dumps({"rows": rows, "host_peak": plan.host_peak, "device_peak": plan.device_peak}))
"""
)

MEASURE = (
    COMMON
    + """
import resource, threading, time, psutil
from seqcal.report import profile
proc, state, peaks, starts = psutil.Process(), {"prof": None, "current": -1, "done": False}, {}, {}
init = profile.Profiler.__init__
def keep(self, path):  # the run's profiler: its open spans say which subgraph is running
    init(self, path)
    state["prof"] = self
profile.Profiler.__init__ = keep
def sample():
    while not state["done"]:
        rss, prof = proc.memory_info().rss, state["prof"]
        try:
            names = list(prof._open_spans.values()) if prof is not None else []
        except RuntimeError:  # the dict changed while being read: keep the last subgraph
            names = []
        for name in names:
            if name.startswith("subgraph "):
                state["current"] = int(name.split()[1])
        i = state["current"]
        starts.setdefault(i, rss)
        peaks[i] = max(peaks.get(i, 0), rss)
        time.sleep(0.002)
thread = threading.Thread(target=sample, daemon=True)
thread.start()
oneshot(**kw, output_dir=cfg["out"], overwrite=True, profile=cfg["out"] + ".trace.json")
state["done"] = True
thread.join()
print(json.dumps({"peaks": peaks, "starts": starts, "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""
)


def child(code: str, cfg: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cfg)], capture_output=True, text=True, cwd=ROOT
    )
    if proc.returncode:
        raise SystemExit(proc.stderr[-4000:])
    if "plan.table" in code:
        print(proc.stderr.split("\n", 1)[-1] if "[transformers]" in proc.stderr[:200] else proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kind(targets: list[str]) -> str:
    """``self_attn.q_proj`` for ``model.layers.3.self_attn.q_proj``: subgraphs of one kind compare together."""
    if not targets:
        return "(no target)"
    parts = targets[0].split(".")
    return ".".join(p for p in parts if not p.isdigit() and p not in ("model", "layers"))


def compare(plan: dict, measured: dict) -> list[str]:
    """Per kind of subgraph: the largest predicted and measured peak and the worst ratio; then the run peak."""
    peaks = {int(k): v for k, v in measured["peaks"].items() if int(k) >= 0}
    by_kind: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for row in plan["rows"]:
        if row["index"] in peaks:
            by_kind[kind(row["targets"])].append((row["index"], row["host"] / GIB, peaks[row["index"]] / GIB))
    lines = [f"{'subgraph kind':<22} {'n':>4} {'pred. max':>10} {'meas. max':>10} {'worst pred/meas':>16}"]
    worst = 1.0
    for name, rows in by_kind.items():
        ratios = [p / m for _, p, m in rows]
        bad = max(ratios, key=lambda r: abs(r - 1))
        worst = max(worst, bad, key=lambda r: abs(r - 1))
        pred, meas = max(p for _, p, _ in rows), max(m for _, _, m in rows)
        lines.append(f"{name:<22} {len(rows):>4} {pred:>9.3f}G {meas:>9.3f}G {bad:>16.2f}")
    host, peak = plan["host_peak"] / GIB, measured["maxrss"] / GIB
    lines.append(
        f"run peak: predicted {host:.3f} GiB, measured {peak:.3f} GiB (ratio {host / peak:.2f}); "
        f"worst subgraph ratio {worst:.2f}; {len(peaks)} of {len(plan['rows'])} subgraphs measured"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="checkpoint directory or 'default' (SmolLM2-135M)")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--tokens", default=None, help="safetensors file with input_ids (else random tokens)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    name = Path(args.model).name
    cfg = {"model": args.model, "samples": args.samples, "seq": args.seq, "tokens": args.tokens,
           "dtype": args.dtype, "group_size": args.group_size, "out": str(WORK / f"plan-accuracy-{name}")}  # fmt: skip
    WORK.mkdir(parents=True, exist_ok=True)
    plan = child(PLAN, cfg)
    measured = child(MEASURE, cfg)
    (WORK / f"plan-accuracy-{name}.json").write_text(json.dumps({"plan": plan, "measured": measured}))
    print("\n".join(compare(plan, measured)))


if __name__ == "__main__":
    main()
