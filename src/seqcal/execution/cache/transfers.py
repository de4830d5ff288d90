"""The activation cache's copies between a CUDA device and pinned host RAM, on side streams.

On the compute stream, every put's device-to-host copy and every fetch's host-to-device copy sits between two
batches' kernels: GPTQ of a 1B Llama over 256 x 2048 tokens moves about 300 GB each way, some 12 s at PCIe 5's
rate against ~25 s of compute (benchmarks/RESULTS.md). Here the copies run on two side streams per device, one
each way, while the compute stream goes on with the next batch:

- **Out** (``copy_out``, a put): the copy waits for the compute stream's work so far (which made the value),
  and the value's device memory is marked as in use by the copy stream (``record_stream``), so that the
  caching allocator does not give it to a later kernel before the copy has read it. The first copy of a new
  batch waits (on the host) for the previous batch's copies: while one batch computes, only the outputs of the
  batch before it stay alive on the device past their put, which bounds the memory the overlap costs.
- **In** (``copy_in``, a prefetch): the executor asks for the next batch's inputs before it runs the current
  one; the copy goes into memory allocated on the compute stream (after waiting for the work queued there, which
  may still use that memory's previous tenant) and the compute stream waits for its event only when the
  batch is fetched.
- ``settle``: the compute stream waits for every copy out. The executor calls it at the end of each pass, before
  a solve writes weights in place, so a copy still reading a value that shares memory with a weight or buffer
  reads it as it was when put.

torch's own ``Tensor.to(non_blocking=True)`` already avoids blocking the host; what it cannot do is run beside
the compute stream's kernels, which is why this is written out here.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch


class Transfers:
    """Side streams and in-flight bookkeeping of one cache's copies to and from one CUDA device.

    Args:
        device: the CUDA device the cache fetches to.

    Example:
        >>> t = Transfers(torch.device("cuda"))  # doctest: +SKIP
        >>> host, ready = t.copy_out(batch=0, flat=torch.zeros(8, dtype=torch.uint8, device="cuda"))  # doctest: +SKIP
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.out = torch.cuda.Stream(device)
        self.inward = torch.cuda.Stream(device)
        self._batches: deque[tuple[int, torch.cuda.Event]] = deque()  # (batch, its last copy's event)
        self.waited = 0.0  # seconds the host spent waiting for copies out (the bound on what stays alive)

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def copy_out(self, batch: int, flat: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned (n,) uint8 host copy of the device bytes ``flat`` (being written) and its completion event."""
        new_batch = not self._batches or self._batches[-1][0] != batch
        if new_batch:  # the older batches' copies must be done: what the overlap keeps alive stays bounded
            start = time.perf_counter()
            while self._batches:
                self._batches.popleft()[1].synchronize()
            self.waited += time.perf_counter() - start
        host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        self.out.wait_stream(self._compute())  # the kernels that wrote ``flat``
        with torch.cuda.stream(self.out):
            host.copy_(flat, non_blocking=True)
        flat.record_stream(self.out)  # not reused by the allocator until this copy has read it
        event = torch.cuda.Event()
        event.record(self.out)
        if not new_batch:
            self._batches.pop()  # events of one stream complete in order: the batch's last one stands for all
        self._batches.append((batch, event))
        return host, event

    def copy_in(self, host: torch.Tensor, ready: Any) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Device copy of the pinned (n,) uint8 ``host`` (being written; ``ready``: its own copy out, if pending)
        and the event the compute stream must wait for before reading it."""
        # allocated on the compute stream
        device_bytes = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        self.inward.wait_stream(self._compute())  # that memory's previous tenant may still be in use there
        if ready is not None:
            self.inward.wait_event(ready)
        with torch.cuda.stream(self.inward):
            device_bytes.copy_(host, non_blocking=True)
        device_bytes.record_stream(self.inward)  # dropped unread, it is not reused before the copy is done
        event = torch.cuda.Event()
        event.record(self.inward)
        return device_bytes, event

    def use(self, event: torch.cuda.Event) -> None:
        """Make the compute stream wait for a copy in before it reads the copied bytes."""
        self._compute().wait_event(event)

    def settle(self) -> None:
        """The compute stream waits for every copy out queued so far (no host wait)."""
        self._compute().wait_stream(self.out)

    def finish(self) -> None:
        """Wait on the host for every copy either way (closing the cache)."""
        self.out.synchronize()
        self.inward.synchronize()
        self._batches.clear()
