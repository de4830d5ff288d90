"""A large Linear whose weight is on meta when it runs (the lm_head in the check of the partition, a head run in
opaque code) computes its outputs a chunk of rows at a time, each chunk read from the store, never its whole weight.

Calibration does not run the lm_head after the last quantized layer, but the check of the partition runs the
model's forward and the partition's last subgraph, logits included: read whole, DeepSeek-V3's head is 1.85 GB in
bf16, Gemma 3 270M's tied one 0.34 GB of its 0.54 GB. ``chunked_heads`` gives each ``nn.Linear`` (its own forward)
of at least ``HEAD_BYTES`` a forward that, while its weight is on meta, fills the output ``CHUNK_BYTES`` of weight
rows at a time (``WeightStore.read_rows``: one read per chunk); with its weight onloaded it runs as before.
A chunk's outputs are ``F.linear`` of the chunk's rows: the whole product's values up to the summation order a
matrix product picks for its shape, the same in every process and in both runs the check compares.

Example:
    >>> with chunked_heads(model, store, torch.device("cpu")) as heads:  # doctest: +SKIP
    ...     logits = model(**batch).logits      # lm_head read 64 MiB at a time
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from seqcal.execution.store import WeightStore

HEAD_BYTES = 64 << 20  # a Linear's weight from this size is read in chunks when it runs on meta
CHUNK_BYTES = 32 << 20  # weight rows read per chunk


def _chunked(module: torch.nn.Linear, name: str, store: WeightStore, device: torch.device) -> object:
    """``module``'s forward, reading its weight's rows a chunk at a time while the weight is on meta."""
    plain = module.forward
    prefix = f"{name}." if name else ""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if module.weight.device.type != "meta":
            return plain(x)
        dtype = module.weight.dtype
        bias = None
        if module.bias is not None:
            bias = module.bias if module.bias.device.type != "meta" else store.read(prefix + "bias")
            bias = bias.to(device, dtype)
        out = None  # in the dtype F.linear gives (autocast's, where it is on)
        rows = max(1, CHUNK_BYTES // (module.in_features * dtype.itemsize))
        for start in range(0, module.out_features, rows):
            ids = torch.arange(start, min(start + rows, module.out_features))
            weight = store.read_rows(prefix + "weight", ids).to(device, dtype)
            part = F.linear(x, weight, None if bias is None else bias[start : start + len(ids)])
            if out is None:
                out = part.new_empty(*part.shape[:-1], module.out_features)
            out[..., start : start + len(ids)] = part
        return out

    return forward


def is_chunked_head(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Linear (its own forward) of at least ``HEAD_BYTES`` of weight."""
    return (
        isinstance(module, torch.nn.Linear)
        and type(module).forward is torch.nn.Linear.forward
        and module.weight.numel() * module.weight.element_size() >= HEAD_BYTES
    )


@contextlib.contextmanager
def chunked_heads(model: torch.nn.Module, store: WeightStore, device: torch.device) -> Iterator[list[str]]:
    """Within the block, every chunked head of ``model`` (``is_chunked_head``) computes by chunks while its weight
    is on meta; yields their names (the safety hooks leave them alone)."""
    swapped = [(n, m) for n, m in model.named_modules() if is_chunked_head(m)]
    for name, module in swapped:
        module.forward = _chunked(module, name, store, device)  # an instance attribute: nn.Module calls it
    try:
        yield [name for name, _ in swapped]
    finally:
        for _, module in swapped:
            del module.forward
