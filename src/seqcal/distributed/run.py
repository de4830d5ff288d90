"""ShardedRun: what the executor calls around each subgraph's calibration (``RunState.sharding``)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from seqcal.checkpoint.identity import data_fingerprint
from seqcal.distributed.exchange import load_statistics, pack, partials_of, unpack
from seqcal.distributed.group import DistributedError, ProcessGroup, process_group
from seqcal.distributed.parts import part_of, solve_costs
from seqcal.distributed.reduce import (
    Partial,
    SpilledSum,
    fold,
    fold_spilled,
    partial_from_bytes,
    partial_to_bytes,
    restore_sums,
    spill_sums,
    tensors_of,
)
from seqcal.distributed.shards import ShardPlan, assign_owners
from seqcal.modifiers.contract import ModifierSet
from seqcal.modifiers.formats import fused_groups
from seqcal.modifiers.state import RunState
from seqcal.tracing.partition import Subgraph


class _Nothing:
    """Takes no statistics (a modifier whose statistics stay on the owner)."""

    gathers = ()  # declares none

    def load_statistics(self, reduced: dict) -> None:
        pass


_NOTHING = _Nothing()


class ShardedRun:
    """The shards of this rank, the reduction of statistics to the processes that solve, and their results.

    Each subgraph has an owner (assigned by solve cost over the subgraphs). When a subgraph holds several module
    groups (the layer cut: q/k/v, o, gate/up, down, experts), the groups are spread over the processes by their
    solve cost instead, each solved by one process; a group is what a statistic key names
    (``<kind>:<module>[,<module>...]``, q/k/v's shared Hessian), joined with the groups vLLM fuses. The owner
    solves what no key names and keeps the subgraph's other work.

    Args:
        plan: the split of the batches into shards and of the shards over the ranks.
        group: this rank's process group (a group of one for a single process).
        costs: estimated solve cost of each subgraph (``solve_costs``); owners are assigned from it.
        shapes: ``(out, in)`` of every module a modifier may solve (the cost of a group).
        together: groups of modules always solved by one process (fused groups sharing a global scale).

    Example:
        >>> run = ShardedRun(ShardPlan(7, 8, 1), ProcessGroup(), [1.0])
        >>> [list(r) for r in run.local_shards()][:2]
        [[0], [1]]
    """

    def __init__(self, plan: ShardPlan, group: ProcessGroup, costs: Sequence[float],
                 shapes: dict[str, tuple[int, int]] | None = None,
                 together: Sequence[Sequence[str]] = ()) -> None:  # fmt: skip
        self.plan, self.group = plan, group
        self.owners = assign_owners(costs, group.world_size)
        self.shapes = shapes or {}
        self._together = {n: tuple(g) for g in together for n in g}
        # module -> rank solving it, in the subgraph being reduced ({}: the subgraph's owner solves it all)
        self.parts: dict[str, int] = {}
        self._folders: list[int] = []  # the ranks folding statistics of the subgraph being reduced
        self._total: Partial | None = None  # this rank's fold of the current subgraph's shards so far
        self._next = 0  # the first shard not folded yet
        # the fold's large cpu sums while the next shard accumulates: in temporary files (reduce.SPILL_BYTES)
        self._spilled: dict[tuple[str, str], SpilledSum] = {}
        self.traffic: list[dict[str, Any]] = []  # per subgraph: bytes this rank sent, seconds communicating

    def local_batches(self, batches: Sequence[Any]) -> list[Any]:
        """This rank's batches, out of the run's."""
        mine = self.plan.shards_of(self.group.rank)
        if not mine:
            return []
        return list(
            batches[self.plan.batches_of(mine.start).start : self.plan.batches_of(mine.stop - 1).stop]
        )

    def local_shards(self) -> Iterator[range]:
        """For each of this rank's shards in order, its batches (indices into the rank's batch list)."""
        yield from self.plan.local_batches(self.group.rank)

    def owns(self, index: int) -> bool:
        """Whether this rank solves subgraph ``index``."""
        return self.owners[index] == self.group.rank

    def collect(self, index: int, shard: int, modifiers: Sequence[Any], device: torch.device,
                split: bool = True) -> None:  # fmt: skip
        """Take the modifiers' statistics of this rank's ``shard``-th local shard of subgraph ``index``.

        They move on at once, so that no rank holds more than its fold and one shard's statistics: every rank
        that folds (the owner, and the ranks solving a group of the subgraph) first folds every shard before
        this one (receiving those it does not run, in shard order), sends each other folding rank its part of
        this one, then folds its own part.

        Args:
            split: whether the subgraph's module groups may be solved by several ranks (False for statistics
                every rank needs whole, the transforms').
        """
        partial = partials_of(modifiers)
        if shard == 0:
            self._start(index)
            self._agree_parts(index, partial, modifiers, split)
        number = self.plan.shards_of(self.group.rank)[shard]
        me = self.group.rank
        if me in self._folders:
            self._fold_until(number, index, device)
        for rank in self._folders:
            if rank != me:
                self.group.send(partial_to_bytes(self._part_for(partial, rank, index, modifiers)), rank,
                                self._what(index))  # fmt: skip
        if me in self._folders:
            self._fold(self._part_for(partial, me, index, modifiers), number)

    def _agree_parts(self, index: int, partial: Partial, modifiers: Sequence[Any], split: bool) -> None:
        """Which rank solves each module group of subgraph ``index``: rank 0 decides from its first shard's
        statistic keys (shard 0's, whatever the world size) and tells the others."""
        parts: dict[str, int] = {}
        if split and self.group.world_size > 1:
            mine = self._assign_parts(partial, modifiers) if self.group.rank == 0 else None
            data = self.group.broadcast(
                json.dumps(mine).encode() if mine is not None else None, 0,
                f"agreeing who solves what in subgraph {index}",
            )  # fmt: skip
            parts = json.loads(data)
        self.parts = parts
        self._folders = sorted({self.owners[index], *parts.values()})

    def _assign_parts(self, partial: Partial, modifiers: Sequence[Any]) -> dict[str, int]:
        """Groups of modules named by the keys of ``partial`` (joined where keys or ``together`` share a module),
        each to the least loaded rank, largest solve first; {} when the subgraph has fewer than two groups."""
        root: dict[str, str] = {}

        def find(n: str) -> str:
            while root.setdefault(n, n) != n:
                n = root[n]
            return n

        for key in partial:
            names = self._modules_of(key, modifiers)
            for n in names:
                for other in (*names, *self._together.get(n, ())):
                    if other in self.shapes:
                        root[find(other)] = find(n)
        groups: dict[str, list[str]] = {}
        for n in sorted(root):
            groups.setdefault(find(n), []).append(n)
        if len(groups) < 2:
            return {}

        def cost(names: list[str]) -> float:  # a stacked solve: sum(out) * in^2, and one inverse in^3
            shapes = [self.shapes[n] for n in names]
            return sum(float(o) * i**2 for o, i in shapes) + float(max(i for _, i in shapes)) ** 3

        load = [0.0] * self.group.world_size
        parts = {}
        for names in sorted(groups.values(), key=lambda g: (-cost(g), g[0])):
            rank = min(range(self.group.world_size), key=lambda r: (load[r], r))
            load[rank] += cost(names)
            parts.update(dict.fromkeys(names, rank))
        return parts

    def _modules_of(self, key: str, modifiers: Sequence[Any]) -> list[str]:
        """The modules a statistic key ``<modifier>/<kind>:<module>[,<module>...]`` names; none for the keys of a
        modifier whose statistics every rank loads (transforms, ``compresses_everywhere``)."""
        position, _, rest = key.partition("/")
        mods = ModifierSet.of(modifiers)
        if mods.everywhere(mods[int(position)]):
            return []
        return [n for n in rest.partition(":")[2].split(",") if n in self.shapes]

    def _part_for(self, partial: Partial, rank: int, index: int, modifiers: Sequence[Any]) -> Partial:
        """The keys of ``partial`` that ``rank`` folds: those naming modules it solves, the rest to the owner."""
        out: Partial = {}
        for key, stats in partial.items():
            ranks = {self.parts.get(n, self.owners[index]) for n in self._modules_of(key, modifiers)}
            if len(ranks) > 1:
                raise RuntimeError(
                    f"statistic {key} of subgraph {index} names modules that different processes solve (a key "
                    "that no module group of the first shard had); run this recipe in one process"
                )
            if (ranks.pop() if ranks else self.owners[index]) == rank:
                out[key] = stats
        return out

    def part(self, sg: Subgraph) -> Subgraph | None:
        """What this rank compresses of ``sg`` (the modifiers that do not compress everywhere), or None."""
        return part_of(sg, self.parts, self.group.rank, self.owners[sg.index])

    def solvers(self, index: int) -> list[int]:
        """The ranks that compress part of subgraph ``index`` and send their results (after ``reduce``)."""
        return sorted({self.owners[index], *self.parts.values()})

    def reduce(
        self, index: int, modifiers: Sequence[Any], device: torch.device, everywhere: bool = False
    ) -> None:
        """Every rank that folds (``collect``) folds the shards still to come and loads the result into the
        modifiers: the owner of subgraph ``index`` the statistics no other rank solves with, each other solver
        its groups'. The statistics of the modifiers that ``compresses_everywhere`` (all of them with
        ``everywhere``: the transforms, which every rank folds into its own weights and cached inputs) are then
        sent by the owner to every rank, which loads them too."""
        if not self.plan.shards_of(self.group.rank):
            self._start(index)  # a rank without shards collects nothing
            self.parts, self._folders = {}, [self.owners[index]]
        me, owner = self.group.rank, self.owns(index)
        if me in self._folders:
            self._fold_until(self.plan.shards, index, device)
            self._total = restore_sums(self._total, self._spilled)
        mods = ModifierSet.of(modifiers)
        shared = [i for i, m in enumerate(mods) if everywhere or mods.compresses_everywhere(m)]
        if shared and self.group.world_size > 1:
            data = None
            if owner:  # sent before any modifier takes (and may scale in place) its statistics
                prefixes = tuple(f"{i}/" for i in shared)
                data = partial_to_bytes(
                    {k: v for k, v in (self._total or {}).items() if k.startswith(prefixes)}
                )
            data = self.group.broadcast(
                data, self.owners[index], f"sending the statistics of subgraph {index}"
            )
            if not owner:
                load_statistics([m if i in shared else _NOTHING for i, m in enumerate(modifiers)],
                                partial_from_bytes(data, device))  # fmt: skip
        if owner:
            load_statistics(modifiers, self._total)
        elif me in self._folders:  # a solver of some of the subgraph's groups: their statistics
            load_statistics([_NOTHING if i in shared else m for i, m in enumerate(modifiers)], self._total)
        self._total = None
        self.traffic[-1]["reduce_bytes"] = self.group.bytes_sent - self.traffic[-1]["reduce_bytes"]
        self.traffic[-1]["reduce_seconds"] = self.group.comm_seconds - self.traffic[-1]["reduce_seconds"]
        if self.parts:
            self.traffic[-1]["solvers"] = self.solvers(index)

    def reduce_round(
        self, per_shard: Sequence[Partial], device: torch.device
    ) -> dict[str, dict[str, torch.Tensor]]:
        """One more reduction of the current subgraph (``RunState.reduce_shards``): ``per_shard`` holds a partial
        per local shard; the owner folds all shards in shard order and sends the fold to every rank."""
        index = self.traffic[-1]["subgraph"]
        what = f"reducing more statistics of subgraph {index}"
        mine = self.plan.shards_of(self.group.rank)
        if len(per_shard) != len(mine):
            raise ValueError(f"reduce_round: {len(per_shard)} partials for this rank's {len(mine)} shards")
        if not self.owns(index):
            for partial in per_shard:
                self.group.send(partial_to_bytes(partial), self.owners[index], what)
            return tensors_of(
                partial_from_bytes(self.group.broadcast(None, self.owners[index], what), device)
            )
        total: Partial | None = None
        for shard in range(self.plan.shards):
            if shard in mine:
                partial = per_shard[shard - mine.start]
            else:
                partial = partial_from_bytes(self.group.recv(self.plan.rank_of(shard), what), device)
            total = fold(total, partial)
        if self.group.world_size > 1:
            self.group.broadcast(partial_to_bytes(total or {}), self.group.rank, what)
        return tensors_of(total or {})

    def _start(self, index: int) -> None:
        self._total, self._next, self._spilled = None, 0, {}
        self.traffic.append({"subgraph": index, "reduce_bytes": self.group.bytes_sent,
                             "reduce_seconds": self.group.comm_seconds})  # fmt: skip  # until reduce: the start

    def _fold_until(self, stop: int, index: int, device: torch.device) -> None:
        """Fold the shards ``self._next .. stop - 1`` that other ranks run, received in shard order."""
        while self._next < stop:
            holder = self.plan.rank_of(self._next)
            data = self.group.recv(holder, self._what(index))
            self._fold(partial_from_bytes(data, device), self._next)

    def _fold(self, partial: Partial, number: int) -> None:
        """Fold shard ``number``'s ``partial`` into the total. While another shard is still to come, the total's
        large cpu sums wait in temporary files (``reduce.spill_sums``): the next shard's accumulators then grow
        beside no second copy of them, and its fold adds them back in place, with the same bits."""
        self._total = fold_spilled(self._total, partial, self._spilled)
        self._next = number + 1
        if self._next < self.plan.shards:
            spill_sums(self._total, self._spilled)

    @staticmethod
    def _what(index: int) -> str:
        return f"reducing the statistics of subgraph {index}"

    def share(self, index: int, src: int, names: Sequence[str], model: torch.nn.Module, state: RunState,
              modifiers: Sequence[Any] = (), subgraph: Any = None) -> bool:  # fmt: skip
        """Send the compressed modules ``names`` of subgraph ``index`` from ``src`` to every rank, which puts
        them into ``state.results.quantized`` and the model's weights, and the ``modifiers``' other ``results`` of
        ``subgraph`` (``load_results`` on the other ranks). Returns whether anything was sent."""
        if self.group.world_size == 1:
            return bool(names)
        seconds = self.group.comm_seconds
        payload = None
        if self.group.rank == src:
            results = {i: m.results(subgraph, model) for i, m in enumerate(modifiers)} if subgraph else {}
            payload = pack(names, model, state, results)
        data = self.group.broadcast(payload, src, f"sending the weights of subgraph {index}")
        # the source compressed: whether its weights changed is its own ``compress``' answer
        got = unpack(data, model, state, modifiers, subgraph) if self.group.rank != src else names
        row = (
            self.traffic[-1]
            if self.traffic and self.traffic[-1]["subgraph"] == index
            else {"subgraph": index}
        )
        if row not in self.traffic:
            self.traffic.append(row)
        row["broadcast_bytes"] = row.get("broadcast_bytes", 0) + len(data)  # one per solver
        row["broadcast_seconds"] = row.get("broadcast_seconds", 0.0) + self.group.comm_seconds - seconds
        return bool(got)


def start_sharded_run(model: torch.nn.Module, modifiers: Sequence[Any], subgraphs: Sequence[Any],
                      batches: Sequence[Any], num_shards: int, identity: str) -> ShardedRun:  # fmt: skip
    """The sharded run of this process: the ranks compared first (same arguments, model, recipe and data),
    then the shards split and the subgraphs' owners assigned, the same way on every rank.

    Args:
        model, modifiers, subgraphs, batches: the run's (``batches``: all of them, as every rank builds them).
        num_shards: virtual shards (``PipelineArgs.num_shards``).
        identity: what else identifies the run (the pipeline arguments, the run's identity).

    Raises:
        DistributedError: the ranks were started differently. ShardingError: more ranks than shards.
    """

    group = process_group()
    shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    # the intra-op threads too: a matmul may sum in another order with another number of them
    threads = f"threads={torch.get_num_threads()}"
    group.check_same_run(
        f"{identity}|{modifiers!r}|{shapes}|{num_shards}|{data_fingerprint(batches)}|{threads}"
    )
    plan = ShardPlan(len(batches), num_shards, group.world_size)
    unshared = [m for m in modifiers if m.name in ModifierSet.of(modifiers).unshared()]
    if group.world_size > 1 and unshared:
        raise DistributedError(
            f"{unshared[0].name} {unshared[0].not_shared_because}; run it in one process, without torchrun, or "
            "with --nproc-per-node 1"
        )
    costs = solve_costs(subgraphs, modifiers, model)
    if group.world_size == 1:  # one process solves everything: no module groups to spread
        return ShardedRun(plan, group, costs)
    shapes = {name: (int(w.shape[0]), int(w.shape[1])) for name, module in model.named_modules()
              if isinstance(w := getattr(module, "weight", None), torch.Tensor) and w.ndim == 2}  # fmt: skip
    mods = ModifierSet.of(modifiers)
    quantized = [n for n in mods.quantized() if n in shapes]
    together = list(fused_groups(model, quantized))  # one global scale per fused group
    # a modifier whose choices depend on those before them (mixed precision): a subgraph's modules on one process
    together += [m.modules_in(sg) for m in mods if mods.need(m).one_solver for sg in subgraphs]
    return ShardedRun(plan, group, costs, shapes, together)


def resume_point(run: ShardedRun, stream: Any) -> int:
    """The first subgraph to calibrate: after the last one the checkpoint holds (its writer tells the others)."""
    value = stream.finished + 1 if stream is not None else 0
    if run.group.world_size == 1:
        return value
    data = run.group.broadcast(
        str(value).encode() if run.group.writes else None, 0, "agreeing where to resume"
    )
    return int(data.decode())


def traffic_report(run: ShardedRun | None) -> dict[str, Any] | None:
    """Per rank: bytes it sent and seconds it spent communicating, in total and per subgraph (gathered on every
    rank, so rank 0's quantization_report.json holds them all)."""
    if run is None:
        return None
    mine = {"rank": run.group.rank, "bytes_sent": run.group.bytes_sent,
            "comm_seconds": round(run.group.comm_seconds, 4), "subgraphs": run.traffic}  # fmt: skip
    ranks = []
    for r in range(run.group.world_size):
        data = json.dumps(mine).encode() if r == run.group.rank else None
        ranks.append(json.loads(run.group.broadcast(data, r, "gathering the traffic report").decode()))
    return {
        "world_size": run.group.world_size,
        "shards": run.plan.shards,
        "owners": run.owners,
        "ranks": ranks,
    }
