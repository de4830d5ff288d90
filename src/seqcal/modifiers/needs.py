"""What a modifier declares: the services it needs (``Needs``) and the statistics it gathers (``Gather``).

A low module (only ``seqcal.records`` below it): ``modifiers.base`` declares with it and ``modifiers.contract`` (the
``ModifierSet`` every stage asks) reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from seqcal.records import REDUCTIONS


@dataclass(frozen=True)
class Needs:
    """What a modifier needs from the pipeline, declared once (``Modifier.needs()``).

    Attributes:
        calibration: it reads calibration data (False: data-free; no forward pass runs for it).
        input_only: it needs only the inputs of its own modules, so the run may cut before each module
            group and run every subgraph once (False: the run cuts after each layer, two passes per layer).
        transforms: it edits weights upstream of a group (``state.fold``) before any quantizer of the group
            sees its inputs.
        graph: ``prepare(graph, model, state)`` gets the traced graph with every Linear as a node.
        everywhere: ``compress`` runs on every process (with its statistics loaded on each), not only on the
            process that solves the subgraph.
        shared_statistics: everything it gathers from data reduces across processes (declared ``gathers``,
            or ``partial_statistics`` / ``load_statistics``); False refuses a run with more than one process.
        resumable: a replayed subgraph can put back every weight it changed (quantized, pruned or recorded
            in ``state.ledger.changed``); False refuses to resume an interrupted run.
        restructures: ``compress`` removes or renumbers modules (expert pruning): it runs after every other
            modifier's ``compress`` in a subgraph, so their records keep the names they were gathered under.
        one_solver: its modules in one subgraph are solved by one process, in module order, never spread over
            several (each choice depends on those made before it: mixed precision's allocation).
        own_modules_only: it changes no weight besides those of the modules it quantizes or prunes, so the run
            may leave other weights on disk where it reads only part of them (an embedding read by the rows
            a batch names: ``execution.embedding_rows``). False (the default, and a user modifier's unless it
            says so) reads every weight a subgraph uses whole.
    """

    calibration: bool = False
    input_only: bool = False
    transforms: bool = False
    graph: bool = False
    everywhere: bool = False
    shared_statistics: bool = True
    resumable: bool = True
    restructures: bool = False
    one_solver: bool = False
    own_modules_only: bool = False


@dataclass(frozen=True)
class Gather:
    """One statistic a modifier gathers per module from the module's inputs; the framework accumulates it.

    Attributes:
        name: the statistic's name (``Modifier.gathered(module)[name]``).
        of: one batch's contribution from the module's input ``x [tokens, in]`` (float32, padding tokens
            dropped); e.g. ``lambda x: x.pow(2).sum(0)``, or ``lambda x: x.new_tensor([len(x)])`` for a count.
        reduce: how contributions combine, elementwise: "sum", "max" or "min".
        reference: ``of(x, x_ref)`` also gets the module's input in the full-precision model (the same tokens
            with no module before it quantized), for asymmetric calibration (GPTAQ). The pipeline then keeps a
            second, full-precision stream of the activations beside the calibration's (twice the activation
            cache, and one more forward pass of every subgraph).

    Example:
        >>> g = Gather("sq", lambda x: x.pow(2).sum(0))
        >>> g.of(torch.ones(3, 2))
        tensor([3., 3.])
    """

    name: str
    of: Callable[..., torch.Tensor]
    reduce: str = "sum"
    reference: bool = False

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"Gather {self.name!r}: reduce={self.reduce!r} is not one of {REDUCTIONS}")


# Methods through which a modifier gathers data, and those through which its data reduces across processes.
_GATHERING = ("observe", "calibrate")
_SHARING = ("partial_statistics", "load_statistics", "shares_statistics")


def _definer(cls: type, names: Iterable[str]) -> type:
    """The most derived class of ``cls``'s MRO that defines one of ``names``."""
    return next(k for k in cls.__mro__ if any(n in vars(k) for n in names))


def gathers_unshared(cls: type) -> bool:
    """Whether ``cls`` gathers data below the class that says how its data reduces: a subclass that overrides
    ``observe`` or ``calibrate`` without its own ``partial_statistics`` (or ``shares_statistics``) gathers
    something its parent's reduction does not know, so several processes would each solve on their own share.

    Example:
        >>> from seqcal.modifiers import QuantizationModifier
        >>> class Mine(QuantizationModifier):
        ...     def observe(self, names, x, state, batch): ...
        >>> gathers_unshared(Mine), gathers_unshared(QuantizationModifier)
        (True, False)
    """
    gathering, sharing = _definer(cls, _GATHERING), _definer(cls, _SHARING)
    return gathering is not sharing and issubclass(gathering, sharing)
