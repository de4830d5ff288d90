"""The finer cut the memory plan retries with when a subgraph does not fit ``max_device_memory``.

A layer's subgraph that needs more device memory than the budget is cut at the layer's children
(attention, MLP); when no finer cut exists the plan keeps its cut and says why in one note.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from seqcal.tracing.partition import Subgraph


def finer_targets(model: torch.nn.Module, subgraphs: list[Subgraph]) -> list[str] | None:
    """Class names of the children (attention, MLP, ...) of the current target layers, or None."""
    names = [t for sg in subgraphs for t in sg.targets]
    if not names:
        return None
    layer = model.get_submodule(names[0])
    children = [c for c in layer.children() if any(True for _ in c.parameters())]
    # a class also found inside another child (Qwen3's RMSNorm: the layer's norms and the attention's q/k
    # norms) would give nested targets: it runs between the targets instead
    nested = {type(m).__name__ for c in children for m in c.modules() if m is not c}
    return sorted({type(c).__name__ for c in children} - nested) or None


def over_budget_note(
    index: int, targets: list[str], device_peak: int, max_device_memory: int, why: str
) -> str:
    """The note for a plan whose largest subgraph (``index``) exceeds ``max_device_memory`` with no finer cut left."""
    gib = 1024**3
    return (
        f"subgraph {index} ({', '.join(targets[:1]) or '-'}) needs {device_peak / gib:.2f} GiB "
        f"of device memory, more than max_device_memory ({max_device_memory / gib:.2f} GiB), and {why}; the "
        "run goes ahead as planned: lower batch_size or max_seq_length, or raise max_device_memory"
    )
