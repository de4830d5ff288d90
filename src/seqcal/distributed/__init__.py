"""Data-parallel calibration on ``torch.distributed``, bit for bit equal to one process.

The calibration batches are cut into a fixed number of *virtual shards* (``num_shards``, independent of the
number of processes). Every process runs its shards through each subgraph with its own activation cache;
a modifier hands over what it accumulated after each shard (``Modifier.partial_statistics``), the partials
of all shards are folded in shard order on the process that solves the subgraph (its *owner*), the owner
compresses and sends the packed weights to every process, and each one propagates its own shards. One
process runs the very same folds, so the checkpoint does not depend on the number of processes.

    shards.py   ShardPlan: shards -> batches, shards -> ranks, subgraph -> owner (by estimated solve cost)
    reduce.py   fold partial statistics in shard order; named tensors <-> bytes (safetensors, no pickle)
    group.py    the process group: launch from torchrun's environment, point-to-point and broadcast with
                one clear error when a peer is gone, agreement on a step (fingerprint, output directory)
    run.py      ShardedRun: what the executor calls (state.config.sharding)
"""

from seqcal.distributed.group import (
    DistributedError,
    ProcessGroup,
    launched,
    process_group,
    rank_path,
    writer_rank,
)
from seqcal.distributed.reduce import fold
from seqcal.distributed.run import ShardedRun
from seqcal.distributed.shards import DEFAULT_SHARDS, ShardPlan

__all__ = [
    "DEFAULT_SHARDS",
    "DistributedError",
    "ProcessGroup",
    "ShardPlan",
    "ShardedRun",
    "fold",
    "launched",
    "process_group",
    "rank_path",
    "writer_rank",
]
