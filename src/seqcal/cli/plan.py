"""seqcal plan: the memory plan of a oneshot run (device, host and disk per subgraph), before any weight is
read; with ``--world-size``, each process's share."""

from __future__ import annotations

import argparse
from typing import Any

from seqcal.cli.options import BATCH_SIZE, MAX_HOST, OFFLOAD
from seqcal.data.autobatch import parse_batch_size
from seqcal.distributed import DEFAULT_SHARDS


def cmd_plan(args: argparse.Namespace) -> int:
    from seqcal.entrypoint import oneshot
    from seqcal.multimodal.run import media_lengths

    samples, seq = args.num_calibration_samples, args.max_seq_length
    lengths = media_lengths(args.dataset, args.model, samples, seq)
    if lengths is not None:  # image or audio rows: planned at their longest row, its media's tokens included
        samples, seq = len(lengths), max(lengths)
        print(f"{args.dataset}: {samples} image or audio rows, {min(lengths)}-{seq} tokens each with their "
              f"media's tokens; planned at {samples} x {seq}\n")  # fmt: skip
    plan = oneshot(
        model=args.model, recipe=args.recipe, num_calibration_samples=samples,
        max_seq_length=seq, batch_size=args.batch_size, offload=args.offload,
        sequential_targets=args.sequential_targets, dry_run=True, max_device_memory=args.max_device_memory,
        max_host_memory=args.max_host_memory, dataset=[],
    )  # fmt: skip
    print(plan.table())
    if args.world_size > 1:
        from seqcal.distributed.plan import plan_world

        batches = -(-samples // plan.batch_size)  # the plan's (also when chosen)
        print("\n" + plan_world(plan, args.world_size, args.num_shards, batches, plan.dtype_bytes))
    return 0


def add_plan(sub: Any) -> None:
    """Register ``seqcal plan`` on the subcommand parsers ``sub``."""
    plan = sub.add_parser("plan", help="predict device/host/disk memory per subgraph (reads no weights)")
    plan.add_argument("--model", required=True)
    plan.add_argument("--recipe", required=True)
    plan.add_argument("--dataset", default=None,
                      help="a JSON lines file of image or audio rows: the plan takes their lengths (text: ignored)")  # fmt: skip
    plan.add_argument("--num-calibration-samples", type=int, default=512)
    plan.add_argument("--max-seq-length", type=int, default=2048)
    plan.add_argument("--batch-size", type=parse_batch_size, default=None, help=BATCH_SIZE)
    plan.add_argument("--offload", default="cpu", help=OFFLOAD)
    plan.add_argument("--sequential-targets", nargs="+", default=None)
    plan.add_argument("--max-device-memory", default=None, help="e.g. 8GB: finer targets, solve chunks")
    plan.add_argument("--max-host-memory", default=None, help=MAX_HOST)
    plan.add_argument("--world-size", type=int, default=1,
                      help="processes (torchrun): per-rank memory and bytes reduced/broadcast per subgraph")  # fmt: skip
    plan.add_argument("--num-shards", type=int, default=DEFAULT_SHARDS, help="virtual shards of the batches")
    plan.set_defaults(func=cmd_plan)
