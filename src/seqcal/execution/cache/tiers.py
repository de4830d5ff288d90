"""The activation cache's tiers and where each keeps its bytes: host RAM (``"cpu"``), files (``"disk"``), the
execution device (``"device"``) or a named accelerator (``"cuda:1"``); and when two devices are one.
"""

from __future__ import annotations

import torch

OFFLOAD_TIERS = ("cpu", "disk", "device")  # or an accelerator's name, such as "cuda:1" (``tier_device``)


def tier_device(offload: str, device: torch.device | str) -> torch.device | None:
    """Where a cache with tier ``offload`` keeps its bytes: the host for "cpu", the execution ``device`` for
    "device", the named accelerator for a name such as "cuda:1"; None for "disk" (files).

    Raises:
        ValueError: ``offload`` is neither a tier nor an accelerator's name.

    Example:
        >>> tier_device("device", "cpu"), tier_device("cuda:1", "cpu"), tier_device("disk", "cpu")
        (device(type='cpu'), device(type='cuda', index=1), None)
    """
    if offload == "disk":
        return None
    if offload in ("cpu", "device"):
        return torch.device("cpu" if offload == "cpu" else device)
    try:
        named = torch.device(offload) if isinstance(offload, str) else None
    except RuntimeError:  # not a device name
        named = None
    if named is None or named.type in ("cpu", "meta"):
        raise ValueError(
            f"offload={offload!r} is not a tier of the activation cache: valid are {list(OFFLOAD_TIERS)} or an "
            "accelerator's name such as 'cuda:1'"
        )
    return named


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether two devices are one: an accelerator without an index is its current one ("cuda" is "cuda:0"
    while device 0 is current; where CUDA is absent, index 0). Stricter than ``entries._same_device``, which
    lets a device without an index match any index (a tensor's device against the cache's).

    Example:
        >>> same_device("cuda", "cuda:0"), same_device("cuda:1", "cuda:0"), same_device("cpu", "cpu")
        (True, False, True)
    """
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True

    def index(d: torch.device) -> int:
        if d.index is not None:
            return d.index
        return torch.cuda.current_device() if d.type == "cuda" and torch.cuda.is_initialized() else 0

    return index(a) == index(b)
