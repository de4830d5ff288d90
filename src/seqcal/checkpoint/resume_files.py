"""What a resumable run saves of a finished subgraph and reads back: its quantized weights with the scheme each
follows, the producers whose folds a replay divides again, and a save interrupted while it was closing
(``StreamingCheckpoint``'s resume).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationScheme

from seqcal.algorithms import dequantize, formats
from seqcal.checkpoint.writer import CONFIG_NAME, INDEX_NAME, PROGRESS_NAME
from seqcal.modifiers.formats import weight_format
from seqcal.modifiers.schemes import strategy_of
from seqcal.modifiers.state import RunState
from seqcal.records import QuantizedWeight, scheme_from_record, scheme_record

# The tensors of a QuantizedWeight a resume file holds (``name:<field>``) besides its codes and scale; static
# activations' among them, since a replay fake-quantizes the module's inputs with them.
_OPTIONAL = ("zero_point", "global_scale", "input_scale", "input_zero_point", "input_global_scale")


def resume_tensors(
    quantized: Mapping[str, QuantizedWeight], errors: Mapping[str, Mapping[str, Any]] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What a subgraph's resume file keeps of its quantized modules: their tensors (``name:q``, ``name:scale``,
    ...) and, as metadata, the scheme each was quantized with (``schemes``), so that a replay rebuilds the module
    the interrupted run had, whichever scheme its modifier chose for it, and each one's report entry (``errors``:
    ``state.results.module_errors``), so that the resumed run reports it, and a modifier whose later choices
    depend on it (mixed precision's error curves) finds it there."""
    tensors: dict[str, torch.Tensor] = {}
    for name, qw in quantized.items():
        tensors.update({f"{name}:q": qw.q, f"{name}:scale": qw.scale})
        tensors.update({f"{name}:{k}": getattr(qw, k) for k in _OPTIONAL if getattr(qw, k) is not None})
    schemes = {name: scheme_record(qw.scheme, name) for name, qw in quantized.items()}
    entries = {name: dict(errors[name]) for name in quantized if errors is not None and name in errors}
    # json keeps a float's every bit (its shortest repr) and writes inf as Infinity, which it reads back
    return tensors, {
        "schemes": json.dumps(schemes, sort_keys=True),
        "errors": json.dumps(entries, default=_plain),
    }


def _plain(value: Any) -> Any:
    """A report value json has no type for (a tensor, a numpy number) as the report writes it: a number or list."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def saved_schemes(metadata: Mapping[str, str]) -> dict[str, QuantizationScheme]:
    """Module name -> the scheme its saved codes follow, from a resume file's metadata (``resume_tensors``);
    {} for a file written before files recorded them."""
    return {name: scheme_from_record(r) for name, r in json.loads(metadata.get("schemes", "{}")).items()}


def saved_weight(tensors: Mapping[str, torch.Tensor], name: str, scheme: Any) -> QuantizedWeight:
    """Module ``name``'s quantized weight from a subgraph's resume file (``tensors``: its ``name:q``,
    ``name:scale``, ... entries), following ``scheme`` (its ``saved_schemes`` entry)."""
    return QuantizedWeight(q=tensors[f"{name}:q"], scale=tensors[f"{name}:scale"],
                           zero_point=tensors.get(f"{name}:zero_point"), g_idx=None, scheme=scheme,
                           global_scale=tensors.get(f"{name}:global_scale"),
                           input_scale=tensors.get(f"{name}:input_scale"),
                           input_zero_point=tensors.get(f"{name}:input_zero_point"),
                           input_global_scale=tensors.get(f"{name}:input_global_scale"))  # fmt: skip


def dequantize_into(weight: torch.Tensor, qw: QuantizedWeight) -> None:
    """Set ``weight`` (a module's parameter) to ``qw``'s dequantized values, in its dtype and on its device."""
    scheme = qw.scheme
    fmt = weight_format(scheme)  # block fp8, NVFP4, MX
    if fmt is not None:
        values = formats.dequantize(qw.q, qw.scale, qw.zero_point, fmt, qw.global_scale, dtype=weight.dtype)
    else:
        group_size = scheme.weights.group_size if strategy_of(scheme.weights) == "group" else None
        values = dequantize(qw.q, qw.scale, qw.zero_point, group_size=group_size, dtype=weight.dtype)
    weight.data = values.to(weight.device)


def _deferred(metadata: Mapping[str, str]) -> set[str]:
    """The producers of the folds a subgraph's file records (``divided``)."""
    return {producer for producer, _, _ in json.loads(metadata.get("divided", "[]"))}


def _undo_close(path: Path, closing: Mapping[str, str]) -> None:
    """Put an interrupted save back as it was recorded: shards under their partial names, no config or index.

    ``CheckpointWriter.close`` notes the renames it is about to make in the progress file; a kill during them
    (or after ``config.json``, before the progress file is removed) leaves some shards renamed. The resumed
    run finishes the save again, so each is renamed back, and ``config.json`` goes first: the directory must
    not look finished while it is not.
    """
    if not closing:
        return
    (path / CONFIG_NAME).unlink(missing_ok=True)
    (path / INDEX_NAME).unlink(missing_ok=True)
    for partial, final in closing.items():
        if not (path / partial).exists() and (path / final).is_file():
            os.replace(path / final, path / partial)


def restore_records(state: RunState, metadata: Mapping[str, str]) -> None:
    """The run state's records of the modules a resumed run put back, from a resume file's ``metadata``: folded
    producers, pruned modules and their sparsity (``config.json``'s sparsity_config lists them), the quantized
    modules' report entries."""
    state.ledger.edited.update(json.loads(metadata.get("edited", "[]")))
    for name, entry in json.loads(metadata.get("errors", "{}")).items():
        state.results.module_errors.setdefault(name, {}).update(entry)
    for name, (structure, sparsity) in json.loads(metadata.get("sparsity", "{}")).items():
        state.results.sparsity[name] = structure
        if sparsity is not None:
            state.results.module_errors.setdefault(name, {})["sparsity"] = sparsity


def recorded_choices(output_dir: str | Path | None) -> dict[str, Any]:
    """The choices an interrupted run in ``output_dir`` recorded with its progress (``{"in_place_factor": ...}``:
    GPTQ's cpu factor, which a host budget chose and which changes float32 roundings, not the run's identity), so
    that its resume finishes with the same ones; {} when there is none."""
    path = Path(output_dir) / PROGRESS_NAME if output_dir is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        choices = json.loads(path.read_text(encoding="utf-8")).get("progress", {}).get("choices", {})
    except (OSError, ValueError, AttributeError):
        return {}  # an unreadable record: StreamingCheckpoint's resume says what is wrong with it
    return dict(choices) if isinstance(choices, Mapping) else {}
