"""The full-precision stream: the model's activations with no module quantized, beside the calibration's.

Asymmetric calibration (GPTAQ) fits each module to the output the full-precision model computes from its own,
full-precision inputs, on the inputs the quantized model actually gives it: ``min ||W X - Q X~||``. A modifier
asks for ``X`` by declaring a ``Gather`` with ``reference=True``; the pipeline then keeps a second activation
cache of the same tier (``run_pipeline``), and runs every subgraph once more on it, before its modules are
compressed (their weights are still the model's), storing its outputs there. A resumed run does the same for
the replayed subgraphs before their saved weights are put back.

In the one-pass cut the group's full-precision input is a cached value like the quantized one. In the layer
cut a module's input is computed inside the subgraph: each batch first runs on the full-precision stream with
pre-hooks keeping the inputs of the modules that need them (one batch's), then on the calibration stream,
whose hooks pair them (``modifiers.contract.calibrating``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from seqcal.execution.cache.store import ActivationCache
from seqcal.tracing.partition import Subgraph


def reference_pass(
    runner: Any,
    sg: Subgraph,
    batches: Sequence[Mapping[str, Any]],
    reference: ActivationCache,
    autocast: Callable[[], contextlib.AbstractContextManager],
    indices: Sequence[int] | None = None,
    capture: Sequence[str] = (),
) -> dict[str, torch.Tensor]:
    """Run ``sg`` on the full-precision stream for the batches at ``indices`` (all by default), with its weights
    as they are (call it before ``compress``), storing its outputs in ``reference``.

    Args:
        runner: the executor's GraphRunner.
        capture: modules whose input (first argument) is kept, for one batch.

    Returns:
        Module name -> its input in the last batch run (``capture``'s modules that ran).
    """
    captured: dict[str, torch.Tensor] = {}
    handles = []
    for name in capture:

        def keep(_module: torch.nn.Module, args: tuple, name: str = name) -> None:
            captured[name] = args[0].detach()

        handles.append(runner.model.get_submodule(name).register_forward_pre_hook(keep))
    try:
        with torch.no_grad(), autocast():
            for b in range(len(batches)) if indices is None else indices:
                env = {name: reference.fetch(b, name) for name in sg.inputs}
                runner.run(sg, env, release=())
                for name in sg.outputs:
                    reference.put(b, name, env[name])
            reference.settle()
    finally:
        for handle in handles:
            handle.remove()
    return captured


def reference_cache(needed: bool, make: Callable[[], ActivationCache]) -> contextlib.AbstractContextManager:
    """A second activation cache (``make()``) when some modifier reads full-precision inputs, else None."""
    return make() if needed else contextlib.nullcontext(None)
