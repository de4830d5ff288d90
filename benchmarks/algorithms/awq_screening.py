"""How AWQ's grid screening chooses, against the exhaustive search, on SmolLM2-135M-Instruct.

Runs seqcal's AWQ W4A16 (asymmetric, group 64) with the exhaustive search (``screen_keep: null``) on the
first ``--samples`` of the shared 128 x 512-token WikiText-2 valid windows, one virtual shard, and records the
squared error of every grid point on every recorded batch of every span search (attention and MLP spans). Then,
for each screening policy (every n-th batch screens, the identity and the k best kept), it prints how many
searches pick the exhaustive winner, the mean and worst loss excess of the picked point, and the share of span
runs the policy needs. The default (every 4th, k = 3) is the row ``every 4, keep 3``.

Usage (from the repo root, after gptq_smollm2.py made the calibration windows):
    PYTHONPATH=src:benchmarks/_lib HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/algorithms/awq_screening.py \
        --samples 32 [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

import seqcal.modifiers.awq as awq
from seqcal.entrypoint import oneshot
from seqcal.models import default_model_dir
from seqcal.modifiers import AWQModifier

WORK = Path(__file__).resolve().parents[1] / ".work"
os.environ["SEQCAL_BENCH_SYMMETRIC"] = "0"  # W4A16 asymmetric g64, as awq_smollm2.py runs it
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
from scheme import SCHEME  # noqa: E402  (reads the variable above)


def record_searches(samples: int, n_grid: int) -> list[dict]:
    """Per span search: ``{"span": name, "errors": [[error of point c on batch i] for c] }``, exhaustive."""
    searches: list[dict] = []
    calls: list[float] = []
    mse = awq.masked_mse
    search = awq.search_all_scales

    def recording_mse(reference, output, mask):  # every batch of every grid point, in the search's order
        error, count = mse(reference, output, mask)
        calls.append(error)
        return error, count

    def recording_search(losses, x_mean, w_mean, n_grid, duo_scaling):
        def recorded(candidates):
            calls.clear()
            values = losses(candidates)
            if calls:  # a span run per point (a Gram-scored single Linear records nothing)
                per = len(calls) // len(candidates)
                searches.append({"errors": [calls[c * per : (c + 1) * per] for c in range(len(candidates))]})
            return values

        return search(recorded, x_mean, w_mean, n_grid, duo_scaling)

    awq.masked_mse, awq.search_all_scales = recording_mse, recording_search
    tokens = load_file(str(WORK / "calib_128x512.safetensors"))["input_ids"][:samples]
    data = [{"input_ids": row.tolist()} for row in tokens]
    recipe = AWQModifier(config_groups=SCHEME, ignore=["lm_head"], n_grid=n_grid, screen_keep=None)
    with tempfile.TemporaryDirectory() as out:
        oneshot(model=str(default_model_dir()), dataset=data, recipe=recipe, output_dir=out,
                num_calibration_samples=len(data), max_seq_length=tokens.shape[1], num_shards=1,
                shuffle_calibration_samples=False, overwrite=True)  # fmt: skip
    return searches


def policy(searches: list[dict], every: int, keep: int) -> dict:
    """What screening on every ``every``-th batch and keeping the identity and the ``keep`` best would choose."""
    same, excess, runs, total = 0, [], 0, 0
    for search in searches:
        errors = search["errors"]
        points, batches = len(errors), len(errors[0])
        screen = list(range(0, batches, every))
        screened = [sum(errors[c][i] for i in screen) for c in range(points)]
        kept = sorted({0, *sorted(range(points), key=lambda c: (screened[c], c))[:keep]})
        full = [sum(e) for e in errors]
        best = min(range(points), key=lambda c: (full[c], c))
        pick = min(kept, key=lambda c: (full[c], c))
        same += pick == best
        excess.append(full[pick] / full[best] - 1)
        runs += points * len(screen) + len(kept) * (batches - len(screen))
        total += points * batches
    return {"every": every, "keep": keep, "same": same, "searches": len(searches),
            "mean_excess": sum(excess) / len(excess), "max_excess": max(excess), "runs": runs / total}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--n-grid", type=int, default=20)
    parser.add_argument("--json", default=None, help="also write the recorded errors and the table here")
    args = parser.parse_args()
    searches = record_searches(args.samples, args.n_grid)
    rows = [policy(searches, every, keep) for every in (8, 4, 2) for keep in (1, 2, 3, 4)]
    print(f"{'policy':<18} {'same winner':>12} {'mean excess':>12} {'max excess':>11} {'span runs':>10}")
    for r in rows:
        print(f"every {r['every']}, keep {r['keep']:<5} {r['same']:>6}/{r['searches']:<5} {r['mean_excess']:>12.3%} "
              f"{r['max_excess']:>11.3%} {r['runs']:>10.3f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"searches": searches, "policies": rows}))


if __name__ == "__main__":
    main()
