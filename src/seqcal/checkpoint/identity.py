"""What identifies a run, so that ``resume=True`` continues only the run that was interrupted.

A run is identified by parts (recipe, model, pipeline options, calibration data), each a short content hash,
never an object's ``repr()`` (which holds memory addresses for a DataLoader or a Dataset and would differ in
every process). The data part hashes the calibration batches themselves, after loading: files, lists,
tensors, datasets and DataLoaders are compared by the tokens they produce. ``differences`` names the parts
that differ, for the sentence a refused resume prints.

Example:
    >>> run = run_identity(recipe=recipe_yaml, model=model, pipeline=repr(pipe_args), dtype="auto")  # doctest: +SKIP
    >>> run["data"] = data_fingerprint(batches)  # doctest: +SKIP
    >>> differences(run, other)  # doctest: +SKIP
    ['calibration data']
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

# How each part is named in a refusal, in this order.
PARTS = {
    "recipe": "recipe",
    "model": "model",
    "dtype": "dtype",
    "pipeline": "pipeline options",
    "data": "calibration data",
}


def fingerprint(*parts: Any) -> str:
    """A short hash of JSON-able ``parts`` (``str()`` for anything else)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _model_part(model: Any) -> str:
    """Class, source path and config of the model: what differs between two models, without reading weights."""
    config = getattr(model, "config", None)
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else ""
    return fingerprint(type(model).__name__, str(getattr(model, "name_or_path", "") or ""), text)


def run_identity(*, recipe: str, model: Any, pipeline: str, dtype: str) -> dict[str, str]:
    """The parts of a run known before its data is loaded (``data`` is added by ``data_fingerprint``).

    Args:
        recipe: the recipe as YAML.
        model: the loaded model (its class, ``name_or_path`` and config are hashed; no weight is read).
        pipeline: the pipeline options that change results (``repr`` of a dataclass of plain values).
        dtype: the dtype the weights were loaded in.

    Returns:
        Part name -> short hash.

    Example:
        >>> run_identity(recipe="GPTQModifier: {}", model=model, pipeline="...", dtype="auto")  # doctest: +SKIP
        {'recipe': '1f0c...', 'model': '9a2b...', 'pipeline': '...', 'dtype': '...'}
    """
    return {
        "recipe": fingerprint(recipe),
        "model": _model_part(model),
        "pipeline": fingerprint(pipeline),
        "dtype": fingerprint(dtype),
    }


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        digest.update(f"tensor {t.dtype} {list(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            digest.update(f"{key}=".encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"seq {len(value)}|".encode())
        for item in value:
            _feed(digest, item)
    else:  # plain values (use_cache=False, ...): their repr is their content
        digest.update(f"{type(value).__name__} {value!r}|".encode())


def data_fingerprint(batches: Sequence[Mapping[str, Any]]) -> str:
    """A hash of the calibration batches actually used (token ids, masks and any other key, by content).

    Args:
        batches: the loaded calibration batches (dicts of tensors and plain values).

    Returns:
        A short hex hash; equal batches give equal hashes in any process.

    Example:
        >>> data_fingerprint([{"input_ids": torch.tensor([[1, 2, 3]])}])  # doctest: +SKIP
        '5d41...'
    """
    digest = hashlib.sha256()
    _feed(digest, list(batches))
    return digest.hexdigest()[:16]


def differences(recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[str]:
    """The names of the parts in which a recorded run differs from ``current`` (all of them if unknown)."""
    if not isinstance(recorded, Mapping):  # a run recorded by an older seqcal: nothing can be compared
        return list(PARTS.values())
    keys = [*PARTS, *sorted((set(recorded) | set(current)) - set(PARTS))]
    return [PARTS.get(key, key) for key in keys if recorded.get(key) != current.get(key)]
