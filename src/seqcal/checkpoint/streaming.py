"""Streaming save and resume: each finished subgraph's modules go to the checkpoint at once.

Saving then needs no whole-model pass and no whole-model memory. After every subgraph the checkpoint
writer flushes and records progress (``seqcal_progress.json``) together with the compressed weights of
that subgraph (``seqcal_resume/``), so an interrupted run (crash, SIGKILL, out of memory) continues with
``resume=True``: the finished subgraphs are replayed with their saved quantized weights (one propagation
pass, no calibration) and the run goes on from the next one, producing the same tensors as a run that was
never interrupted. ``config.json`` is written last; its presence means the checkpoint is finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from seqcal.algorithms import dequantize
from seqcal.checkpoint.writer import (
    CONFIG_NAME,
    PROGRESS_NAME,
    CheckpointWriter,
    ModelLayout,
    checkpoint_config,
    write_extras,
)
from seqcal.errors import SeqcalError
from seqcal.modifiers.base import QuantizedWeight, RunState
from seqcal.modifiers.schemes import strategy_of
from seqcal.tracing.partition import Subgraph

RESUME_DIR = "seqcal_resume"
# Progress is recorded (and a shard written) once this much is waiting: every subgraph would give one small
# shard per module group (hundreds for a 30-layer model cut before each module); a crash loses at most this
# much finished work, which the resumed run recomputes.
CHECKPOINT_BYTES = 64 * 1024**2


class ResumeError(SeqcalError, RuntimeError):
    """The output directory cannot be resumed (finished, or made by a different run)."""


def fingerprint(*parts: Any) -> str:
    """A short hash of what must not change between an interrupted run and its resumption."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class StreamingCheckpoint:
    """Writes modules as their last subgraph finishes; records progress; replays it on resume.

    Args:
        model: the model being calibrated.
        state: the run state (``state.quantized`` fills as subgraphs finish).
        output_dir: the checkpoint directory.
        subgraphs: the run's subgraphs (a module is written after the last one that uses it).
        run_id: fingerprint of recipe, data and model; a resume must match it.
        overwrite: replace a non-empty directory (never needed to resume).
        resume: continue an interrupted run in ``output_dir`` if there is one.
        checkpoint_bytes: record progress once this many bytes of finished modules wait to be written
            (default ``CHECKPOINT_BYTES``).
    """

    def __init__(self, model: torch.nn.Module, state: RunState, output_dir: str | Path,
                 subgraphs: Sequence[Subgraph], run_id: str, *, overwrite: bool = False,
                 resume: bool = False, weights: Any = None, checkpoint_bytes: int | None = None) -> None:  # fmt: skip
        self.model, self.state, self.run_id = model, state, run_id
        self.weights = weights  # offload.SubgraphWeights when parameters live off-device, else None
        self.path = Path(output_dir)
        self.layout = ModelLayout.from_model(model)
        self.finished = -1
        self.checkpoint_bytes = CHECKPOINT_BYTES if checkpoint_bytes is None else checkpoint_bytes
        if resume and (self.path / PROGRESS_NAME).is_file():
            self.writer, progress = CheckpointWriter.resume(self.path, layout=self.layout)
            if progress.get("run_id") != run_id:
                raise ResumeError(
                    f"{self.path} holds an interrupted run of another recipe/dataset/model; resume it with the "
                    "same arguments, or pass overwrite=True (and resume=False) to start again"
                )
            self.finished = int(progress["finished"])
        elif resume and (self.path / CONFIG_NAME).is_file():
            raise ResumeError(f"{self.path} holds a finished checkpoint: nothing to resume")
        else:
            self.writer = CheckpointWriter(self.path, overwrite=overwrite, layout=self.layout)
        self.owner = self._owners(subgraphs)

    def _owners(self, subgraphs: Sequence[Subgraph]) -> dict[str, int]:
        """Module name -> index of the last subgraph that uses it (-1: none; written at the end)."""
        owner: dict[str, int] = {}
        for name, module in self.model.named_modules():
            if not any(True for _ in module.parameters(recurse=False)) and not module._buffers:
                continue
            owner[name] = -1
            for sg in subgraphs:
                if any(name == m or name.startswith(m + ".") or not m for m in sg.modules):
                    owner[name] = sg.index
        return owner

    def done(self, sg: Subgraph) -> None:
        """``sg`` finished: write the modules it used last, save its quantized weights, record progress."""
        names = [n for n, i in self.owner.items() if i == sg.index]
        for name in names:
            self.writer.add_module(name, self.model.get_submodule(name), self.state.quantized.get(name))
        mine = {n: q for n, q in self.state.quantized.items() if self._in(n, sg)}
        tensors = {}
        for name, qw in mine.items():
            tensors.update({f"{name}:q": qw.q, f"{name}:scale": qw.scale})
            if qw.zero_point is not None:
                tensors[f"{name}:zero_point"] = qw.zero_point
        folder = self.path / RESUME_DIR
        folder.mkdir(exist_ok=True)
        if tensors:
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(folder / f"{sg.index}.st")
            )
        if self.writer.pending_bytes >= self.checkpoint_bytes:
            self.writer.checkpoint({"finished": sg.index, "run_id": self.run_id})
            self.finished = sg.index
        self._trim(mine)

    def _trim(self, names: Any) -> None:
        """Drop the codes of modules already on disk: only their scheme is needed (for config.json).

        Keeping them would hold the whole quantized model in RAM by the end of the run.
        """
        empty = torch.empty(0)
        for name in names:
            qw = self.state.quantized[name]
            self.state.quantized[name] = QuantizedWeight(empty, empty, None, None, qw.scheme, qw.loss)

    def _in(self, name: str, sg: Subgraph) -> bool:
        return any(name == m or name.startswith(m + ".") or not m for m in sg.modules)

    def restore(self, sg: Subgraph, schemes: dict[str, Any]) -> None:
        """Put ``sg``'s saved quantized weights back into the model (replaying a finished subgraph).

        Args:
            sg: a subgraph finished by the interrupted run.
            schemes: module name -> QuantizationScheme (from the recipe's modifiers).
        """
        file = self.path / RESUME_DIR / f"{sg.index}.st"
        if not file.is_file():
            return
        tensors = load_file(str(file))
        for name in sorted({k.split(":")[0] for k in tensors}):
            scheme = schemes[name]
            group_size = scheme.weights.group_size if strategy_of(scheme.weights) == "group" else None
            qw = QuantizedWeight(q=tensors[f"{name}:q"], scale=tensors[f"{name}:scale"],
                                 zero_point=tensors.get(f"{name}:zero_point"), g_idx=None, scheme=scheme)  # fmt: skip
            weight = self.model.get_submodule(name).weight
            weight.data = dequantize(
                qw.q, qw.scale, qw.zero_point, group_size=group_size, dtype=weight.dtype
            ).to(weight.device)
            self.state.quantized[name] = qw
        self._trim({k.split(":")[0] for k in tensors})

    def finish(self, tokenizer: Any = None, recipe_yaml: str | None = None) -> Path:
        """Write the modules no subgraph used, the extras and, last, config.json."""
        rest = [name for name, index in self.owner.items() if index == -1]
        with self.weights.modules_onloaded(rest) if self.weights else contextlib.nullcontext():
            for name in rest:
                self.writer.add_module(name, self.model.get_submodule(name), self.state.quantized.get(name))
        write_extras(self.path, self.model, tokenizer=tokenizer, recipe_yaml=recipe_yaml)
        out = self.writer.close(checkpoint_config(self.model, self.state, self.layout))
        shutil.rmtree(self.path / RESUME_DIR, ignore_errors=True)
        return out
