"""A Hessian's values kept while its memory serves as scratch (GPTQ's and SparseGPT's factor), written back bit
for bit: the upper triangle of an exactly symmetric one in host memory, or, on the CPU past ``SPILL_BYTES``, in
an unnamed temporary file.
"""

from __future__ import annotations

import tempfile
import weakref
from typing import Any

import torch
from torch import Tensor

from seqcal.algorithms.hessian import UPPER_BLOCK, is_symmetric, symmetrize_upper

KEPT_ROWS = 2 * UPPER_BLOCK  # rows per kept block of a Hessian's upper triangle (KeptHessian)
# A CPU Hessian whose kept triangle is this large or larger keeps it in a temporary file, not in RAM: at a 8192-wide
# down_proj that is 134 MB of the process's peak (the solve's largest part after the Hessian itself), for about
# 0.1 s of writing and reading back per solve. Smaller ones (SmolLM2's 1536 inputs: 5 MB) stay in memory.
SPILL_BYTES = 32 << 20


def read_exactly(file: Any, t: Tensor, what: str) -> None:
    """Fill contiguous cpu ``t`` from ``file``'s next ``t.nbytes`` bytes, in its own memory (no temporary).

    Raises:
        OSError: the file ends first (``what``: the values, named in the message).
    """
    if file.readinto(memoryview(t.numpy()).cast("B")) != t.nbytes:
        raise OSError(f"{what} could not be read back from their temporary file")


def kept_bytes(n: int, rows: int = KEPT_ROWS) -> int:
    """Bytes :class:`KeptHessian` keeps of an exactly symmetric float32 [n, n] Hessian."""
    return sum((n - r) * min(rows, n - r) for r in range(0, n, rows)) * 4


def kept_in_ram(n: int, device_type: str = "cpu") -> int:
    """Bytes of host memory :class:`KeptHessian` takes for an [n, n] Hessian on ``device_type``: none when a CPU
    Hessian's kept triangle goes to a file (``SPILL_BYTES``)."""
    kept = kept_bytes(n)
    return 0 if device_type == "cpu" and kept >= SPILL_BYTES else kept


class KeptHessian:
    """A Hessian's values while its memory serves as scratch; :meth:`restore` writes them back, bit for bit.

    What is kept is the upper triangle in copies of row blocks (``H[r:r + rows, r:]``): about half of ``H``'s
    memory (``n^2 / 2 + n rows / 2`` values) where ``H`` is exactly symmetric (``symmetrize_upper`` makes it
    so), a whole copy otherwise. It is kept in host memory: on a GPU that takes nothing from the device, where
    the solve then holds the Hessian and the Cholesky factor only. The copies are pinned and asynchronous on
    CUDA, ordered on the current stream with the kernels that overwrite and later restore ``H``. On the CPU, a
    kept triangle of ``SPILL_BYTES`` or more is written to an unnamed temporary file instead (``spill``), read
    back block by block by :meth:`restore`: the solve's peak then holds the Hessian and the factor's scratch only.

    Example:
        >>> from seqcal.algorithms.hessian import accumulate_hessian
        >>> H = symmetrize_upper(accumulate_hessian(None, torch.randn(64, 500), 0)[0])
        >>> before, kept = H.clone(), KeptHessian(H)
        >>> torch.equal(kept.restore(H.fill_(0.0)), before)
        True
    """

    def __init__(self, H: Tensor, rows: int = KEPT_ROWS, spill: bool | None = None) -> None:
        self.symmetric = is_symmetric(H)
        parts = [H[r : r + rows, r:] for r in range(0, H.shape[0], rows)] if self.symmetric else [H]
        self.shapes = [part.shape for part in parts]
        self.nbytes = sum(part.numel() for part in parts) * H.element_size()
        spill = H.device.type == "cpu" and self.nbytes >= SPILL_BYTES if spill is None else spill
        self.file = (
            tempfile.TemporaryFile() if spill else None
        )  # unnamed: gone when closed, or the process ends
        self.blocks: list[Tensor] = []  # the upper triangle's row blocks, or the whole matrix (in RAM)
        if self.file is not None:
            weakref.finalize(self, self.file.close)
            for part in parts:  # a row at a time: a row of a contiguous H is written without a copy
                for row in part:
                    row.numpy().tofile(self.file)
            return
        # one allocation for all of it: large enough to be mapped on its own (backend.host), so that its
        # pages go back to the OS when the solve ends instead of staying in the heap
        flat = _host_empty(sum(p.numel() for p in parts), H)
        asynchronous = H.device.type == "cuda"
        start = 0
        for part in parts:
            block = flat[start : start + part.numel()].view(part.shape)
            self.blocks.append(block.copy_(part, non_blocking=asynchronous))
            start += part.numel()

    def _read_rows(self, H: Tensor) -> Tensor:
        """The spilled values read back straight into ``H``'s rows (no temporary); returns ``H``."""
        self.file.seek(0)
        r = 0
        for shape in self.shapes:
            for row in H[r : r + shape[0], H.shape[1] - shape[1] :]:
                read_exactly(self.file, row, "the Hessian's kept values")
            r += shape[0]
        return H

    def restore(self, H: Tensor) -> Tensor:
        """The kept values into ``H``'s memory (in place), both triangles; returns ``H``."""
        if self.file is not None:
            self._read_rows(H)
        elif not self.symmetric:
            H.copy_(self.blocks[0], non_blocking=H.device.type == "cuda")
        else:
            r = 0
            for block in self.blocks:
                H[r : r + block.shape[0], r:].copy_(block, non_blocking=H.device.type == "cuda")
                r += block.shape[0]
        return symmetrize_upper(H) if self.symmetric else H


def _host_empty(numel: int, like: Tensor) -> Tensor:
    """Host memory for ``numel`` values of ``like``'s dtype: pinned when ``like`` is on CUDA (asynchronous,
    stream-ordered copies)."""
    return torch.empty(numel, dtype=like.dtype, pin_memory=like.device.type == "cuda")
