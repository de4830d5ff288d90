"""What a run over several processes adds to the memory plan: per-rank memory and bytes exchanged per subgraph."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from seqcal.distributed.shards import ShardPlan, assign_owners

_SCALES_PER_WEIGHT = 4 / 32  # bytes of scales per quantized weight at the smallest group (32), as fp32


@dataclass
class RankTraffic:
    """Predicted per subgraph: the owner, bytes sent to it (statistics), bytes it broadcasts (weights)."""

    index: int
    owner: int
    reduce_bytes: int
    broadcast_bytes: int


def world_rows(plan: Any, world_size: int, num_shards: int, num_batches: int, dtype_bytes: int) -> list[dict]:
    """Per subgraph of ``plan`` (a ``MemoryPlan``) run on ``world_size`` processes with ``num_shards`` virtual
    shards of ``num_batches`` batches: its owner, device and host bytes per rank, bytes reduced and broadcast.

    Per rank: its activation cache holds its shards' batches only; the device holds what one process holds,
    and the owner of a subgraph also one partial Hessian it receives. Reduced: every shard the owner does not
    run sends its Hessians (fp32, summed); broadcast: per quantized weight its int8 codes, the fake-quantized
    weight and scales, to each other rank. Owners come from the same greedy assignment by solve cost as in
    the run (``assign_owners``).

    Example:
        >>> world_rows(make_plan(...), 2, 8, 128, 2)[1]["reduce_bytes"]  # doctest: +SKIP
    """

    shards = ShardPlan(num_batches, num_shards, world_size)
    batches_of = [sum(len(shards.batches_of(s)) for s in shards.shards_of(r)) for r in range(world_size)]
    share = max(batches_of) / max(num_batches, 1)
    owners = assign_owners([r.solve_cost for r in plan.rows], world_size)
    rows = []
    for row, owner in zip(plan.rows, owners):
        foreign = shards.shards - len(shards.shards_of(owner))
        rows.append({
            "index": row.index, "owner": owner, "reduce_bytes": foreign * row.hessians,
            "broadcast_bytes": int(row.quantized_numel * (1 + dtype_bytes + _SCALES_PER_WEIGHT)) * (world_size - 1),
            "host": row.host - row.host_cache + int(row.host_cache * share),
            "device": row.device_peak + (row.hessians if foreign else 0),  # the owner's received partial
        })  # fmt: skip
    return rows


def plan_world(plan: Any, world_size: int, num_shards: int, num_batches: int, dtype_bytes: int) -> str:
    """``world_rows`` as a table (``seqcal plan --world-size N``)."""
    rows = world_rows(plan, world_size, num_shards, num_batches, dtype_bytes)
    shards = ShardPlan(num_batches, num_shards, world_size)
    gb, mb = 1024**3, 1e6
    lines = [f"{world_size} processes, {shards.shards} virtual shards of {num_batches} batches",
             f"{'#':>3} {'owner':>5} {'device':>9} {'host/rank':>10} {'reduced':>10} {'broadcast':>10}"]  # fmt: skip
    for r in rows:
        lines.append(f"{r['index']:>3} {r['owner']:>5} {r['device'] / gb:>8.3f}G {r['host'] / gb:>9.3f}G "
                     f"{r['reduce_bytes'] / mb:>9.2f}M {r['broadcast_bytes'] / mb:>9.2f}M")  # fmt: skip
    reduce, bcast = sum(r["reduce_bytes"] for r in rows), sum(r["broadcast_bytes"] for r in rows)
    lines.append(f"total: reduced {reduce / mb:.1f} MB, broadcast {bcast / mb:.1f} MB to each of the "
                 f"{world_size - 1} other processes")  # fmt: skip
    return "\n".join(lines)
