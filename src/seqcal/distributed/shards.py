"""Virtual shards: which batches form a shard, which rank runs it, which rank solves a subgraph."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from seqcal.errors import SeqcalError

# Shards when the run does not say: enough for 8 processes, few enough that folding their partial
# Hessians stays cheap. The checkpoint depends on it (partials are folded per shard), never on the world size.
DEFAULT_SHARDS = 8


class ShardingError(SeqcalError, ValueError):
    """The run cannot be split over this many processes."""


@dataclass
class ShardPlan:
    """The fixed split of ``num_batches`` batches into shards, and of the shards over ``world_size`` ranks.

    Shard ``s`` is the contiguous batch range ``[s * B // S, (s + 1) * B // S)``; rank ``r`` runs the
    contiguous shard range ``[r * S // W, (r + 1) * S // W)``. ``S = min(num_shards, B)``: a shard is never
    empty, and S depends on the data and the setting only.

    Example:
        >>> plan = ShardPlan(num_batches=7, num_shards=8, world_size=2)
        >>> plan.shards, plan.shards_of(1), list(plan.batches_of(6))
        (7, range(3, 7), [6])
    """

    num_batches: int
    num_shards: int = DEFAULT_SHARDS
    world_size: int = 1
    shards: int = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.num_shards, bool) or not isinstance(self.num_shards, int) or self.num_shards < 1:
            raise ValueError(f"num_shards={self.num_shards!r} must be a positive integer")
        self.shards = max(1, min(self.num_shards, self.num_batches))
        if self.world_size > self.shards:
            raise ShardingError(
                f"{self.world_size} processes but only {self.shards} virtual shards ({self.num_batches} "
                f"calibration batches, num_shards={self.num_shards}): every process needs a shard; run at most "
                f"{self.shards} processes, or give more calibration samples (and num_shards) per process"
            )

    def batches_of(self, shard: int) -> range:
        """The global batch indices of ``shard``."""
        return range(shard * self.num_batches // self.shards, (shard + 1) * self.num_batches // self.shards)

    def shards_of(self, rank: int) -> range:
        """The shards ``rank`` runs."""
        return range(rank * self.shards // self.world_size, (rank + 1) * self.shards // self.world_size)

    def rank_of(self, shard: int) -> int:
        """The rank that runs ``shard``."""
        return next(r for r in range(self.world_size) if shard in self.shards_of(r))

    def local_batches(self, rank: int) -> list[range]:
        """For each of ``rank``'s shards, its batches as indices into the rank's own batch list."""
        first = self.batches_of(self.shards_of(rank).start).start if self.shards_of(rank) else 0
        return [range(b.start - first, b.stop - first) for b in map(self.batches_of, self.shards_of(rank))]


def assign_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """The rank that solves each subgraph: greedily the least loaded so far (ties: the lowest rank).

    Args:
        costs: estimated solve cost of each subgraph, in execution order.
        world_size: number of ranks.

    Returns:
        One owner rank per subgraph.

    Example:
        >>> assign_owners([4.0, 1.0, 1.0, 2.0], 2)
        [0, 1, 1, 1]
    """
    load = [0.0] * world_size
    owners = []
    for cost in costs:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += cost
        owners.append(rank)
    return owners
