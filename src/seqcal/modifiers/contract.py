"""The modifier contract: what a modifier declares, and the one place every stage asks about it.

A modifier declares what it needs from the pipeline in one frozen value, ``Needs`` (``Modifier.needs()``),
and the statistics it gathers from data in ``Modifier.gathers`` (``Gather``: a name, a per-batch function of
the module's input, and how shards combine). The pipeline builds a ``ModifierSet`` from the recipe's
modifiers once, and every stage (the cut, the executor, the memory plan, several processes, resume, the
checkpoint's preflight) asks it, never a modifier's attributes.

Declared statistics are the framework's: it feeds them the same way in every cut (the cached input of a
module group in the one-pass cut, a forward pre-hook in the layer cut), drops padding tokens, accumulates per
virtual shard, folds the shards in shard order on the process that solves the module (one process or many:
the same bytes) and hands the result to ``compress`` through ``Modifier.gathered(module)``. A modifier built
on them has no distributed or resume code of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from seqcal.modifiers.base import Statistic
from seqcal.modifiers.needs import Gather, Needs, gathers_unshared
from seqcal.modifiers.state import Batch, BatchCursor, RunState, real_tokens

if TYPE_CHECKING:
    from seqcal.modifiers.base import Modifier
    from seqcal.tracing.partition import Subgraph

# The prefix of declared statistics' keys among a modifier's partial statistics: ``gather:<module>``, so that
# a subgraph's module groups spread over processes find each module's statistics with it.
GATHER_KEY = "gather:"


def _combine(reduce: str, total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    if total is None:
        return value
    if reduce == "sum":
        return total.add_(value)
    return torch.maximum(total, value) if reduce == "max" else torch.minimum(total, value)


class Gathered:
    """A modifier's declared statistics: this shard's running values, and the reduced ones ``compress`` reads."""

    def __init__(self, gathers: Sequence[Gather]) -> None:
        self.gathers = {g.name: g for g in gathers}
        self._shard: dict[
            str, dict[str, torch.Tensor]
        ] = {}  # module -> name -> value since the last hand-over
        self.reduced: dict[str, dict[str, torch.Tensor]] = {}  # module -> name -> value of every shard

    def add(
        self, module: str, x: torch.Tensor, mask: torch.Tensor | None, ref: torch.Tensor | None = None
    ) -> None:
        """One batch's input ``x [..., in]`` of ``module``; ``mask`` is its token mask (False: padding); ``ref``
        the same batch's input of ``module`` in the full-precision model (for ``Gather.reference``)."""
        rows = real_tokens(x.detach(), mask).float()  # [tokens, in]
        ref_rows = real_tokens(ref.detach(), mask).float() if ref is not None else None
        values = self._shard.setdefault(module, {})
        for name, g in self.gathers.items():
            if not g.reference:
                value = g.of(rows)
            elif ref_rows is None:
                raise RuntimeError(f"{module}: the statistic {name!r} needs the full-precision input, which the "
                                   "run did not provide")  # fmt: skip
            else:
                value = g.of(rows, ref_rows.to(rows.device))
            values[name] = _combine(g.reduce, values.get(name), value)

    def partials(self) -> dict[str, dict[str, Statistic]]:
        """This shard's values as partial statistics (``gather:<module>`` keys), handed over and forgotten."""
        out = {
            GATHER_KEY + module: {n: Statistic(v, self.gathers[n].reduce) for n, v in values.items()}
            for module, values in self._shard.items()
        }
        self._shard = {}
        return out

    def load(self, reduced: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take the values of every shard, folded in shard order (the keys of ``partials``)."""
        for key, values in reduced.items():
            self.reduced[key[len(GATHER_KEY) :]] = dict(values)

    def finish_local(self) -> None:
        """Without virtual shards (the whole-model pipelines): this process's values are the result."""
        self.reduced.update(self._shard)
        self._shard = {}


def gathered_of(modifier: Modifier) -> Gathered:
    """The framework's store of ``modifier``'s declared statistics (made on first use)."""
    store = modifier.__dict__.get("_gathered")
    if store is None:
        store = modifier.__dict__["_gathered"] = Gathered(modifier.gathers)
    return store


class ModifierSet(tuple):
    """The recipe's modifiers in order, with their declarations: the one thing the stages ask.

    Built once (``ModifierSet.of``); a tuple of the modifiers, so loops over it see them in recipe order
    (those that restructure the model, ``Needs.restructures``, last).

    Example:
        >>> from seqcal.modifiers import GPTQModifier
        >>> mods = ModifierSet.of([GPTQModifier(scheme="W4A16")])
        >>> mods.input_only, mods.calibrating
        (True, True)
    """

    needs: tuple[Needs, ...]

    @classmethod
    def of(cls, modifiers: Iterable[Modifier]) -> ModifierSet:
        if isinstance(modifiers, ModifierSet):
            return modifiers
        listed = list(modifiers)
        # modifiers that renumber modules compress last, after the others' records of the old names are used
        mods = cls(sorted(listed, key=lambda m: m.needs().restructures))
        # whatever a modifier declares, hooks of its own below its parent's reduction do not reduce
        mods.needs = tuple(
            replace(n, shared_statistics=False) if gathers_unshared(type(m)) else n
            for m, n in ((m, m.needs()) for m in mods)
        )
        if mods.float_inputs and (mods.transforms() or mods.kv()):
            what = (mods.transforms() or mods.with_kv())[0].name
            raise ValueError(f"{what} cannot run in one recipe with a modifier that reads the full-precision "
                             "inputs (a Gather with reference=True): its folds or fp8 KV cache would reach only one "
                             "of the two streams; run them in separate recipes")  # fmt: skip
        for m, needs in zip(mods, mods.needs):
            if m.gathers and needs.transforms:
                raise ValueError(f"{m.name}: declared statistics (gathers) are not available to transforms yet; "
                                 "gather them in observe/calibrate with partial_statistics/load_statistics")  # fmt: skip
        return mods

    def split(self) -> tuple[ModifierSet, ModifierSet]:
        """(the transforms, the others), each in recipe order: inside a group the transforms fold first."""
        parts: tuple[list[int], list[int]] = ([], [])
        for i, n in enumerate(self.needs):
            parts[0 if n.transforms else 1].append(i)
        return self._subset(parts[0]), self._subset(parts[1])

    def _subset(self, indices: list[int]) -> ModifierSet:
        sub = ModifierSet(self[i] for i in indices)
        sub.needs = tuple(self.needs[i] for i in indices)
        return sub

    @property
    def float_inputs(self) -> bool:
        """Some modifier reads its modules' inputs in the full-precision model too (``Gather.reference``)."""
        return any(g.reference for m in self for g in m.gathers)

    def float_modules(self, subgraph: Subgraph) -> list[str]:
        """The modules of ``subgraph`` whose full-precision inputs a modifier reads."""
        return [n for m in self if any(g.reference for g in m.gathers) for n in m.modules_in(subgraph)]

    def need(self, modifier: Modifier) -> Needs:
        return self.needs[self.index(modifier)]

    @property
    def calibrating(self) -> bool:
        """Some modifier reads calibration data."""
        return any(n.calibration for n in self.needs)

    @property
    def input_only(self) -> bool:
        """Every modifier needs only its modules' inputs (the one-pass cut applies)."""
        return all(n.input_only for n in self.needs)

    def transforms(self) -> list[Modifier]:
        return [m for m, n in zip(self, self.needs) if n.transforms]

    def own_modules_only(self) -> bool:
        """Every modifier changes only the weights of the modules it quantizes or prunes (``Needs``)."""
        return all(n.own_modules_only for n in self.needs)

    def preparing(self) -> list[Modifier]:
        """The modifiers whose ``prepare`` gets the graph (transforms and those that ask for it)."""
        return [m for m, n in zip(self, self.needs) if n.transforms or n.graph]

    def everywhere(self, modifier: Modifier) -> bool:
        """Whether ``modifier``'s statistics are loaded on every process (transforms, and what compresses there)."""
        need = self.need(modifier)
        return need.transforms or need.everywhere

    def compresses_everywhere(self, modifier: Modifier) -> bool:
        """Whether ``modifier``'s ``compress`` runs on every process with the whole subgraph (AWQ)."""
        return self.need(modifier).everywhere

    def unshared(self) -> list[str]:
        """Names of the modifiers whose statistics do not reduce across processes."""
        return [m.name for m, n in zip(self, self.needs) if not n.shared_statistics]

    def not_resumable(self) -> list[str]:
        return [m.name for m, n in zip(self, self.needs) if not n.resumable]

    def quantized(self) -> dict[str, Any]:
        """Module name -> compressed-tensors scheme, over every modifier that quantizes weights."""
        return {name: scheme for m in self for name, scheme in m.quantizes().items()}

    def pruned(self) -> dict[str, Any]:
        """Module name -> sparsity, over every pruning modifier."""
        return {name: s for m in self for name, s in m.prunes().items()}

    def kv(self) -> list[Any]:
        """The KV-cache calibrations of the modifiers that quantize the KV cache."""
        return [kv for m in self if (kv := m.kv_calibration()) is not None]

    def kv_cache_scheme(self) -> Any:
        """The ``kv_cache_scheme`` (compressed-tensors QuantizationArgs) of the last modifier that quantizes the
        KV cache, or None: the run's configuration and the checkpoint's ``quantization_config`` hold it."""
        return next((kv.args for kv in reversed(self.kv())), None)

    def with_kv(self) -> list[Modifier]:
        return [m for m in self if m.kv_calibration() is not None]

    def owns(self, subgraph: Subgraph) -> bool:
        """Whether some modifier has modules in ``subgraph``."""
        return any(m.modules_in(subgraph) for m in self)

    def sequential_targets(self) -> Any:
        """The first ``sequential_targets`` a modifier names (llm-compressor's GPTQ argument), or None."""
        return next((t for m in self if (t := m.layer_targets())), None)


def observe(
    modifier: Modifier, names: list[str], x: torch.Tensor, state: RunState, batch: Batch,
    ref: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """One batch's input ``x`` of the module group ``names`` (the one-pass cut): declared statistics of the
    modifier's modules among them, then the modifier's own ``observe``; ``ref`` is the group's input in the
    full-precision stream, when the run keeps one."""
    if modifier.gathers:
        store, mine = gathered_of(modifier), modifier.quantizes().keys() | modifier.prunes().keys()
        for name in names:
            if name in mine:
                store.add(name, x, batch.token_mask, ref)
    modifier.observe(names, x, state, batch)


@contextlib.contextmanager
def calibrating(
    modifier: Modifier, subgraph: Subgraph, model: torch.nn.Module, state: RunState, batches: BatchCursor,
    reference: dict[str, torch.Tensor] | None = None,
) -> Iterator[None]:  # fmt: skip
    """The layer cut's calibration pass of ``subgraph``: pre-hooks feeding the declared statistics of the
    modifier's modules in it, and the modifier's own ``calibrate``; every hook removed on exit. ``batches``:
    the batch being run (moved by the pass); ``reference``: module name -> the batch's input of that module
    in the full-precision stream (one batch per pass)."""
    handles = []
    try:
        if modifier.gathers:
            store = gathered_of(modifier)
            for name in modifier.modules_in(subgraph):

                def hook(_module: torch.nn.Module, args: tuple, name: str = name) -> None:
                    store.add(name, args[0], batches.current.token_mask, (reference or {}).get(name))

                handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
        with modifier.calibrate(subgraph, model, state, batches):
            yield
    finally:
        for handle in handles:
            handle.remove()


def partial_statistics(modifier: Modifier) -> dict[str, dict[str, Statistic]]:
    """Everything ``modifier`` gathered since the last call: its declared statistics and its own partials."""
    declared = gathered_of(modifier).partials() if modifier.gathers else {}
    return {**modifier.partial_statistics(), **declared}


def load_statistics(modifier: Modifier, reduced: dict[str, dict[str, torch.Tensor]]) -> None:
    """Hand ``modifier`` the folded statistics of every shard: declared ones to the framework's store."""
    if modifier.gathers:
        gathered_of(modifier).load({k: v for k, v in reduced.items() if k.startswith(GATHER_KEY)})
    modifier.load_statistics({k: v for k, v in reduced.items() if not k.startswith(GATHER_KEY)})


def finish_local(modifiers: Iterable[Modifier]) -> None:
    """Without virtual shards: each modifier's declared statistics as gathered are its result."""
    for m in modifiers:
        if m.gathers:
            gathered_of(m).finish_local()
