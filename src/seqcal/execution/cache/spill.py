"""Safetensors files of the activation cache: the disk tier, and spans spilled over the RAM budget.

``SpillFolder`` owns one temporary folder with one safetensors file per stored span. The folder is created
on the first write (or at once with ``create=True``) and removed on ``close()`` or at garbage collection.
Files hold a single (n,) uint8 tensor and are read back with safetensors, never unpickled (DESIGN
invariant 8).

Example:
    >>> folder = SpillFolder(None)
    >>> path, size = folder.write(torch.arange(4, dtype=torch.uint8))
    >>> folder.read(path, "cpu").tolist(), folder.nbytes == size
    ([0, 1, 2, 3], True)
    >>> folder.close()
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import torch
from safetensors.torch import load_file, save_file


class SpillFolder:
    """A temporary folder of safetensors files, one (n,) uint8 tensor each.

    Args:
        parent: parent folder of the temporary folder (created if missing); None: the system temp dir.
        create: make the folder now instead of at the first write.
    """

    def __init__(self, parent: str | os.PathLike | None, create: bool = False) -> None:
        self._parent = parent
        self._path: str | None = None
        self._files = 0
        self.nbytes = 0  # bytes of the files now in the folder
        self._finalizer: weakref.finalize | None = None
        if create:
            self._make()

    @property
    def path(self) -> str | None:
        """The folder, None until the first write (or after close)."""
        return self._path

    def write(self, flat: torch.Tensor) -> tuple[str, int]:
        """Store (n,) uint8 `flat` (any device) in a new file; returns (file path, file size in bytes)."""
        folder = self._path if self._path is not None else self._make()
        path = os.path.join(folder, f"{self._files}.safetensors")
        self._files += 1
        save_file({"bytes": flat.cpu()}, path)
        size = os.path.getsize(path)
        self.nbytes += size
        return path, size

    def read(self, path: str, device: torch.device | str) -> torch.Tensor:
        """The (n,) uint8 tensor of a file written by `write`, on `device`."""
        return load_file(path, device=str(device))["bytes"]

    def remove(self, path: str) -> None:
        """Delete one file written by `write`."""
        self.nbytes -= os.path.getsize(path)
        os.remove(path)

    def close(self) -> None:
        """Remove the folder and its files; idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        self.nbytes = 0

    def _make(self) -> str:
        if self._parent is not None:
            os.makedirs(self._parent, exist_ok=True)
        self._path = tempfile.mkdtemp(prefix="seqcal-cache-", dir=self._parent)
        # Safety net: the folder goes even if close() is never called; must not reference self.
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._path, ignore_errors=True)
        return self._path
