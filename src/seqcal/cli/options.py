"""Help texts of the options several subcommands share (``oneshot``, ``plan``, ``trace``), written once so
the commands describe an option alike."""

from __future__ import annotations

NO_VERIFY = (
    "skip checking the partition against the model's own forward on a second, differently shaped batch "
    "(on by default: a partition that differs is refused)"
)
BATCH_SIZE = (
    "samples per batch, or 'auto': samples grouped by length, as many per batch as memory allows "
    "(default: auto on a GPU, 1 on the CPU)"
)
OFFLOAD = (
    "activation cache tier: cpu (RAM), disk (files), device (the execution device's memory: fastest on a GPU "
    "with room for every cached value) or an accelerator's name such as cuda:1"
)
TRACE_INTO = "trace into these modules too ('all': full graph; torch.nn modules such as Linear stay nodes)"

MAX_HOST = ("e.g. 12GB: resident memory to stay under; the plan picks the cache's RAM (the rest spilled to disk) "
             "and the cut, or refuses before any weight is read")  # fmt: skip
