"""REAPPruningModifier: remove the least salient experts of every mixture-of-experts layer (llm-compressor's).

Each expert's saliency is the mean over the calibration tokens routed to it of the router's gate weight times
the norm of the expert's output (``seqcal.algorithms.reap``). During a layer's calibration pass the layer's
``LinearExperts`` hands each expert's routed outputs to a tap; the sums reduce across virtual shards and
processes in shard order. ``compress`` then removes the lowest-scoring experts: the remaining ones are
renumbered ``0 .. E'-1`` (the checkpoint stores them per expert under those indices), the router loses the
rows of the removed ones, and the config's expert count becomes ``E'``, so transformers reloads the
checkpoint with fewer experts. The layer's propagation pass runs the pruned layer, so later layers calibrate
on what the pruned model computes.

A following quantizer in the same recipe (GPTQ, round-to-nearest) calibrates in the same pass and compresses
before REAP does (``Needs.restructures``): its Hessians and records keep the names they were gathered under,
and REAP renames the records of the experts it keeps and drops those of the others.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from seqcal.algorithms.reap import add_saliency, plan_drop, retained_experts
from seqcal.experts import LinearExperts
from seqcal.mappings.names import checkpoint_names
from seqcal.modifiers.base import BatchCursor, Modifier, RunState, Statistic
from seqcal.tracing.partition import Subgraph

logger = logging.getLogger("seqcal")

# Where transformers' configs and modules keep the expert count, the router's top-k and its routing groups.
_COUNT_KEYS = ("num_experts", "num_local_experts", "moe_num_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "top_k", "moe_top_k")
_ROUTERS = ("gate", "router")
_KEY = "reap:"


class _PrunedExpert(nn.Module):
    """A removed expert's place after the kept ones: its projections with no tensors, so that a checkpoint
    listing the layer's modules finds them and writes nothing for them."""

    def __init__(self, leaves: tuple[str, ...]) -> None:
        super().__init__()
        for leaf in leaves:
            self.add_module(leaf, nn.Module())


@dataclass
class REAPPruningModifier(Modifier):
    """REAP (Lasby et al., 2025): remove ``sparsity`` of the routed experts of every MoE layer.

    Args (llm-compressor's names):
        sparsity: fraction of each layer's experts to remove, in (0, 1).
        ignore: ``re.search`` patterns (a ``re:`` prefix is accepted) of MoE blocks to leave alone; it may
            name all of them or none, since the config holds one expert count for every layer.
        report_path: a ``.json`` file that receives each pruned block's kept experts (original indices).

    Example:
        >>> REAPPruningModifier(sparsity=0.25)  # doctest: +SKIP
    """

    name: ClassVar[str] = "REAPPruningModifier"
    needs_calibration: ClassVar[bool] = True
    input_only: ClassVar[bool] = False  # it reads the experts' outputs and the router's weights
    resumable: ClassVar[bool] = False  # a replayed subgraph cannot renumber experts back
    restructures: ClassVar[bool] = True
    compresses_everywhere: ClassVar[bool] = True  # every process removes the same experts from its model

    sparsity: float | None = None
    ignore: list[str] = field(default_factory=list)
    report_path: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ignore, str):
            self.ignore = [self.ignore]
        if isinstance(self.sparsity, bool) or not isinstance(self.sparsity, (int, float)):
            raise ValueError(f"{self.name}: sparsity must be a number in (0, 1), the fraction of each MoE layer's "
                             f"experts to remove; got {self.sparsity!r}")  # fmt: skip
        if not 0.0 < self.sparsity < 1.0:
            raise ValueError(f"{self.name}: sparsity must be in (0, 1), got {self.sparsity}")
        if not all(isinstance(p, str) for p in self.ignore):
            raise ValueError(f"{self.name}: ignore must be a list of patterns (strings), got {self.ignore!r}")
        if self.report_path is not None and not str(self.report_path).endswith(".json"):
            raise ValueError(f"{self.name}: report_path must name a .json file, got {self.report_path!r}")
        self._blocks: dict[str, int] = {}  # MoE block -> experts per layer (after validate)
        self._routers: dict[str, str] = {}  # MoE block -> its router's name
        self._sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # this shard's saliency sums, counts
        self._reduced: dict[str, dict[str, torch.Tensor]] = {}
        self.retained: dict[str, list[int]] = {}  # block -> kept experts (original indices), after compress

    # --- before any weight is read ------------------------------------------------------------------------

    def validate(self, model: nn.Module) -> None:
        """Find the MoE blocks and check the sparsity against the router (raises ValueError naming the fix)."""
        found = _moe_blocks(model)
        if not found:
            raise ValueError(f"{self.name}: the model has no mixture-of-experts layer with fused experts and a "
                             "router (gate) that seqcal can prune; REAP prunes routed experts only")  # fmt: skip
        aliases = checkpoint_names(model)
        patterns = [p.removeprefix("re:") for p in self.ignore]
        kept = {n: e for n, e in found.items() if not any(re.search(p, a) for p in patterns
                                                           for a in (n, aliases.get(n, n)))}  # fmt: skip
        if kept and len(kept) < len(found):
            skipped = next(n for n in found if n not in kept)
            raise ValueError(f"{self.name}: ignore leaves {skipped} unpruned while other MoE layers lose experts, "
                             "but the config holds one expert count for every layer, so the checkpoint would not "
                             "reload; ignore all MoE layers or none")  # fmt: skip
        if not kept:
            logger.warning("seqcal: %s: ignore matches every MoE layer; no expert is removed", self.name)
        config = _text_config(model)
        count_key = _first_key(config, _COUNT_KEYS, "the number of experts")
        counts = set(kept.values()) | {getattr(config, count_key)}
        if len(counts) > 1:
            raise ValueError(f"{self.name}: the MoE layers hold {sorted(counts)} experts (config.{count_key} = "
                             f"{getattr(config, count_key)}); REAP needs one expert count for every layer")  # fmt: skip
        top_k = getattr(config, _first_key(config, _TOP_K_KEYS, "the experts picked per token"))
        groups, top_k_groups = getattr(config, "n_group", None), getattr(config, "topk_group", None)
        self._plan = plan_drop(counts.pop(), float(self.sparsity), top_k, groups, top_k_groups)  # type: ignore[arg-type]
        self._blocks, self._count_key = kept, count_key
        self._routers = {b: f"{b}.{_router_attr(model.get_submodule(b))}" for b in kept}

    # --- calibration --------------------------------------------------------------------------------------

    def modules_in(self, subgraph: Subgraph) -> list[str]:
        """The routers of the MoE blocks in ``subgraph`` (the modules whose weights REAP edits)."""
        return [self._routers[b] for b in self._blocks_in(subgraph)]

    def _blocks_in(self, subgraph: Subgraph) -> list[str]:
        return [n for n in self._blocks if subgraph.holds(n)]

    @contextlib.contextmanager
    def calibrate(
        self, subgraph: Subgraph, model: nn.Module, state: RunState, batches: BatchCursor
    ) -> Iterator[None]:
        """A tap on the experts of each MoE block of ``subgraph``: gate weight times output norm, per expert."""
        tapped = []
        for block in self._blocks_in(subgraph):
            experts = model.get_submodule(block).experts
            experts.taps.append(self._tap(block, experts.layout.num_experts, batches))
            tapped.append(experts)
        try:
            yield
        finally:
            for experts in tapped:
                experts.taps.pop()

    def _tap(self, block: str, num_experts: int, batches: BatchCursor) -> Any:
        def tap(expert: int, tokens: torch.Tensor, gate: torch.Tensor, output: torch.Tensor) -> None:
            sums = self._sums.get(block)
            if sums is None:
                zeros = torch.zeros(num_experts, dtype=torch.float64, device=output.device)
                sums = self._sums[block] = (zeros, zeros.clone())
            mask = batches.current.token_mask
            if mask is not None:  # the experts see the batch's tokens flattened: drop the padding
                real = mask.reshape(-1).to(tokens.device, torch.bool)[tokens]
                gate, output = gate[real], output[real]
            add_saliency(sums[0], sums[1], expert, gate, output)

        return tap

    def partial_statistics(self) -> dict[str, dict[str, Statistic]]:
        out = {
            _KEY + b: {"saliency": Statistic(s), "tokens": Statistic(c)} for b, (s, c) in self._sums.items()
        }
        self._sums = {}
        return out

    def load_statistics(self, reduced: dict[str, dict[str, torch.Tensor]]) -> None:
        for key, stats in reduced.items():
            self._reduced[key[len(_KEY) :]] = stats

    def shares_statistics(self) -> bool:
        return True

    # --- pruning ------------------------------------------------------------------------------------------

    def compress(self, subgraph: Subgraph, model: nn.Module, state: RunState) -> bool:
        """Remove the least salient experts of each MoE block of ``subgraph``; True when any were removed."""
        pruned = False
        for block in self._blocks_in(subgraph):
            stats = self._reduced.pop(block, None)
            if stats is None:
                state.results.log.append(
                    f"{block}: no calibration token reached its experts; {self.name} left it whole"
                )
                continue
            keep = retained_experts(stats["saliency"], stats["tokens"], self._plan.drop, self._plan.per_group,
                                    self._plan.groups)  # fmt: skip
            _prune_block(model, block, keep, state)
            self.retained[block] = keep
            state.results.module_errors.setdefault(block, {}).update(
                experts_kept=len(keep), routed_tokens=float(stats["tokens"].sum())
            )
            pruned = True
        if pruned:  # what config.json says: transformers builds every MoE layer with this many experts
            setattr(_text_config(model), self._count_key, len(next(iter(self.retained.values()))))
        return pruned

    def finalize(self, model: nn.Module, state: RunState) -> None:
        rank = state.config.sharding.group.rank if state.config.sharding is not None else 0
        if self.report_path is not None and rank == 0:
            Path(self.report_path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.report_path).write_text(json.dumps(self.retained, indent=1), encoding="utf-8")
        if self.retained:
            kept = len(next(iter(self.retained.values())))
            logger.info("seqcal: REAP kept %d of %d experts in %d MoE layers", kept, kept + self._plan.drop,
                        len(self.retained))  # fmt: skip


def _moe_blocks(model: nn.Module) -> dict[str, int]:
    """MoE block name -> its experts, for each block with linearized experts and a router holding one row each."""
    out = {}
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, LinearExperts):
            continue
        router = _router(module)
        if router is not None and router.weight.shape[0] == experts.layout.num_experts:
            out[name] = experts.layout.num_experts
    return out


def _router_attr(block: nn.Module) -> str | None:
    """The attribute of ``block`` holding its router (a module with a [experts, hidden] weight), or None."""
    for attr in _ROUTERS:
        router = getattr(block, attr, None)
        weight = getattr(router, "weight", None)
        if isinstance(router, nn.Module) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return attr
    return None


def _router(block: nn.Module) -> nn.Module | None:
    attr = _router_attr(block)
    return None if attr is None else getattr(block, attr)


def _text_config(model: nn.Module) -> Any:
    config = model.config  # type: ignore[union-attr]
    return getattr(config, "text_config", None) or config


def _first_key(config: Any, keys: tuple[str, ...], what: str) -> str:
    key = next((k for k in keys if isinstance(getattr(config, k, None), int)), None)
    if key is None:
        raise ValueError(f"REAPPruningModifier: {type(config).__name__} has none of {', '.join(keys)} for "
                         f"{what}; REAP cannot prune this architecture")  # fmt: skip
    return key


def _prune_block(model: nn.Module, block: str, keep: list[int], state: RunState) -> None:
    """Keep experts ``keep`` of ``block``, renumbered 0..len(keep)-1; shrink the router; rename the records."""
    moe = model.get_submodule(block)
    experts: LinearExperts = moe.experts
    total, leaves = experts.layout.num_experts, experts.layout.names
    old = [experts.get_submodule(str(e)) for e in range(total)]
    for new, e in enumerate(keep):
        experts.register_module(str(new), old[e])
    leaves_of = tuple(n for n, _ in old[0].named_children()) or leaves
    for new in range(len(keep), total):
        experts.register_module(str(new), _PrunedExpert(leaves_of))
    experts.layout = replace(experts.layout, num_experts=len(keep))
    router = _router(moe)
    router_name = f"{block}.{_router_attr(moe)}"
    if router_name in state.results.quantized:
        raise ValueError(f"REAPPruningModifier: the router {router_name} is quantized, so its rows cannot be "
                         "removed; add it to the quantizer's ignore list (re:.*gate$)")  # fmt: skip
    index = torch.tensor(keep, device=router.weight.device)
    for holder in (router, moe):
        for pname in ("weight", "bias", "e_score_correction_bias"):
            value = (
                holder._parameters.get(pname) if pname in holder._parameters else holder._buffers.get(pname)
            )
            if value is None or (holder is moe and pname != "e_score_correction_bias"):
                continue
            shrunk = value.detach()[index].contiguous()
            if pname in holder._parameters:
                holder._parameters[pname] = nn.Parameter(shrunk, requires_grad=value.requires_grad)
            else:
                holder._buffers[pname] = shrunk
    for holder in (router, moe, experts.fused):
        for key in _COUNT_KEYS:
            if isinstance(getattr(holder, key, None), int) and not isinstance(getattr(holder, key), bool):
                setattr(holder, key, len(keep))
    if isinstance(getattr(router, "out_features", None), int):
        router.out_features = len(keep)
    _rename_records(state, f"{block}.experts.", {e: new for new, e in enumerate(keep)})
    # the router changed; the kept experts hold other values under their names now (an offloaded model keeps
    # them instead of reading those names from the original checkpoint again)
    state.ledger.changed.update([router_name, *(f"{block}.experts.{new}.{leaf}" for new in range(len(keep))
                                         for leaf in leaves_of)])  # fmt: skip


def _rename_records(state: RunState, prefix: str, renumber: dict[int, int]) -> None:
    """Records of the experts under ``prefix``, renamed to their new index (those of removed experts dropped)."""

    def moved(name: str) -> str | None:
        if not name.startswith(prefix):
            return name
        index, _, rest = name[len(prefix) :].partition(".")
        if not index.isdigit():
            return name
        new = renumber.get(int(index))
        return None if new is None else f"{prefix}{new}" + (f".{rest}" if rest else "")

    # with several processes, which one solved each module of the subgraph: its weights are sent under the new
    # name by the process that solved it (``ShardedRun.parts``)
    parts = getattr(state.config.sharding, "parts", None)
    for records in (
        state.results.quantized,
        state.results.sparsity,
        state.results.module_errors,
        *([parts] if parts else []),
    ):
        items = [(moved(n), v) for n, v in records.items()]
        records.clear()
        records.update({n: v for n, v in items if n is not None})
    names = {moved(n) for n in state.ledger.changed}
    state.ledger.changed.clear()
    state.ledger.changed.update(n for n in names if n is not None)
