"""Checks before any calibration work: a run must not fail at the end for a reason known at the start."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from seqcal.checkpoint.writer import CONFIG_NAME, PROGRESS_NAME
from seqcal.errors import SeqcalError
from seqcal.execution.cache.tiers import OFFLOAD_TIERS

# Headroom on free-space estimates: shards are written whole, and the filesystem needs slack.
DISK_MARGIN = 1.1


class DiskSpaceError(SeqcalError, OSError):
    """The machine cannot hold what the run will write (disk space, permissions)."""


def check_output_dir(output_dir: str | None, *, overwrite: bool, resume: bool) -> None:
    """Refuse to start when ``output_dir`` holds something this run would clobber or cannot write.

    Raises:
        FileExistsError: a finished checkpoint or an interrupted run is there (and neither overwrite nor resume).
        NotADirectoryError: output_dir, or a parent it would be created under, is a file.
        PermissionError: the directory (or its nearest existing parent) is not writable.
    """
    if output_dir is None:
        return
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"output_dir {path} is a file; give a directory path")
    if (path / PROGRESS_NAME).is_file() and not (resume or overwrite):
        raise FileExistsError(
            f"output_dir {path} holds an interrupted run; continue it with resume=True (CLI: --resume) "
            "and the same arguments, or pass overwrite=True to start again"
        )
    if resume:
        check_resumable(path)
    if path.exists() and any(path.iterdir()) and not (overwrite or resume):
        raise FileExistsError(
            f"output_dir {path} exists and is not empty; choose another directory or pass overwrite=True"
        )
    _check_creatable(path)


def _check_creatable(path: Path) -> None:
    """``path`` exists as a directory or can be created: its nearest existing ancestor takes a new folder.

    The check creates and removes a folder there, as permission bits do not tell for root, ACLs or
    read-only mounts; nothing is left behind.
    """
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(
            f"output_dir {path} cannot be created: {existing} is a file, not a directory; "
            "choose a path under a directory"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".seqcal-check-", dir=existing))
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise PermissionError(
            f"output_dir {path} cannot be {'written' if existing == path else 'created'}: {existing} "
            f"is not writable ({reason}); choose a directory you can write"
        ) from None


def check_resumable(path: Path) -> None:
    """``resume=True`` continues only a run seqcal started in ``path``: refuse a directory of other files.

    An absent or empty directory is fine (the run starts there); one with seqcal's progress record or a
    finished checkpoint is checked further by ``StreamingCheckpoint``, which compares the run's identity.

    Raises:
        FileExistsError: ``path`` holds files but no seqcal run; nothing in it is touched.
    """
    if not path.is_dir() or (path / PROGRESS_NAME).is_file() or (path / CONFIG_NAME).is_file():
        return
    files = sorted(p.name for p in path.iterdir())
    if files:
        shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
        raise FileExistsError(
            f"output_dir {path} holds files of something other than a seqcal run ({shown}) and no "
            f"{PROGRESS_NAME}, so there is no run to resume; choose another output_dir (nothing there was "
            "changed)"
        )


def estimate_checkpoint_bytes(model: torch.nn.Module, modifiers: Sequence[Any]) -> int:
    """Bytes the compressed checkpoint will take (weights at their quantized width plus scales)."""
    bits: dict[str, int] = {}
    for modifier in modifiers:
        for name, scheme in modifier.quantizes().items():
            bits[name] = scheme.weights.num_bits
    total = 0
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            element = param.element_size()
            if pname == "weight" and name in bits:
                total += param.numel() * bits[name] // 8 + param.numel() * element // 32  # codes + scales
            else:
                total += param.numel() * element
    return total


def check_environment(
    model: torch.nn.Module,
    modifiers: Sequence[Any],
    output_dir: str | None,
    offload: str,
    offload_dir: str | None,
) -> None:
    """Enough free disk for the checkpoint (and the disk activation cache's folder must be writable); an
    accelerator named as the activation cache's tier must be there.

    Raises:
        DiskSpaceError: not enough free space; says how much is needed and where.
        PermissionError: the offload folder is not writable.
        ValueError: ``offload`` names a CUDA device this machine does not have.
    """
    if offload not in OFFLOAD_TIERS and torch.device(offload).type == "cuda":  # a device named as the tier
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = torch.device(offload).index or 0
        if index >= count:
            raise ValueError(
                f"offload={offload!r}: the activation cache's device is not there ({count} CUDA device(s) "
                "visible); name one that is, use offload='device' for the execution device, or 'cpu'"
            )
    if output_dir is not None:
        need = int(estimate_checkpoint_bytes(model, modifiers) * DISK_MARGIN)
        existing = Path(output_dir)
        while not existing.exists():
            existing = existing.parent
        free = shutil.disk_usage(existing).free
        if free < need:
            raise DiskSpaceError(
                f"output_dir {output_dir}: the checkpoint needs about {need / 1e9:.2f} GB but only "
                f"{free / 1e9:.2f} GB are free on that disk; free space or choose another output_dir"
            )
    if offload == "disk":
        folder = Path(offload_dir or tempfile.gettempdir())
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"offload_dir {folder} is not a writable directory; pass offload_dir=...")
