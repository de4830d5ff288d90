"""Streaming save and resume: each finished subgraph's modules go to the checkpoint at once.

Saving then needs no whole-model pass and no whole-model memory. After every subgraph the checkpoint
writer flushes and records progress (``seqcal_progress.json``) together with the compressed weights of
that subgraph (``seqcal_resume/``), so an interrupted run (crash, SIGKILL, out of memory) continues with
``resume=True``: the finished subgraphs are replayed with their saved quantized weights (one propagation
pass, no calibration) and the run goes on from the next one, producing the same tensors as a run that was
never interrupted. ``config.json`` is written last; its presence means the checkpoint is finished.

The first progress record (the run's identity, nothing finished) is written before anything else goes into
the directory, so a killed run's directory is always recognisable: ``resume=True`` on it continues (or,
with nothing finished, starts over inside it), and a resume with other arguments is refused with the parts
that differ (``seqcal.checkpoint.identity``). The final save records progress before it starts, and notes
the shard renames it is about to make, so a kill during the save resumes and finishes it.

The files of a finished subgraph are written by a worker thread while the next subgraph computes
(``BACKGROUND``). The calling thread prepares them first (codes checked and packed, host copies, copies of what a
later subgraph may still change in place), so the worker only writes bytes and records progress, in the order a
synchronous save would: shard bytes, the subgraph's resume file, then the record. A kill at any moment therefore
leaves what a synchronous save leaves at some earlier moment. At most one subgraph's writes are pending: the next
``done`` waits for them, ``drain`` and ``finish`` too, and each re-raises the worker's error.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from seqcal.checkpoint.host_tensors import module_tensors_for_write
from seqcal.checkpoint.identity import data_fingerprint, differences
from seqcal.checkpoint.resume_files import (
    _deferred,
    _undo_close,
    dequantize_into,
    restore_records,
    resume_tensors,
    saved_schemes,
    saved_weight,
)
from seqcal.checkpoint.writer import (
    CONFIG_NAME,
    PROGRESS_NAME,
    CheckpointWriter,
    ModelLayout,
    checkpoint_config,
    write_extras,
)
from seqcal.errors import SeqcalError
from seqcal.modifiers.base import RunState
from seqcal.owners import module_owners
from seqcal.records import Fold, fold_records, folds_from
from seqcal.report.profile import NullProfiler
from seqcal.sources.extras import ignore_modules, write_extra_tensors
from seqcal.tracing.partition import Subgraph

logger = logging.getLogger("seqcal")

RESUME_DIR = "seqcal_resume"
# Progress is recorded (and a shard written) once this much is waiting: every subgraph would give one small
# shard per module group (hundreds for a 30-layer model cut before each module); a crash loses at most this
# much finished work, which the resumed run recomputes.
CHECKPOINT_BYTES = 64 * 1024**2
# A finished subgraph's files are written on a worker thread while the next subgraph computes (module docstring);
# False writes them before ``done`` returns.
BACKGROUND = True


class ResumeError(SeqcalError, RuntimeError):
    """The output directory cannot be resumed (finished, or made by a different run)."""


__all__ = ["BACKGROUND", "CHECKPOINT_BYTES", "RESUME_DIR", "ResumeError", "StreamingCheckpoint"]


class StreamingCheckpoint:
    """Writes modules as their last subgraph finishes; records progress; replays it on resume.

    Args:
        model: the model being calibrated.
        state: the run state (``state.results.quantized`` fills as subgraphs finish).
        output_dir: the checkpoint directory.
        subgraphs: the run's subgraphs (a module is written after the last one that uses it).
        run_id: the run's identity (``identity.run_identity``); a resume must match it.
        overwrite: replace a non-empty directory (never needed to resume).
        resume: continue an interrupted run in ``output_dir`` if there is one.
        checkpoint_bytes: record progress once this many bytes of finished modules wait to be written
            (default ``CHECKPOINT_BYTES``).
        batches: the calibration batches; their content hash is the run's ``data`` part.
        background: write each subgraph's files on a worker thread (default ``BACKGROUND``).
        profiler: the run's profiler; the worker's writes are its "write" spans.
    """

    def __init__(self, model: torch.nn.Module, state: RunState, output_dir: str | Path,
                 subgraphs: Sequence[Subgraph], run_id: Mapping[str, str], *, overwrite: bool = False,
                 resume: bool = False, weights: Any = None, checkpoint_bytes: int | None = None,
                 batches: Sequence[Mapping[str, Any]] | None = None, background: bool | None = None,
                 profiler: Any = None) -> None:  # fmt: skip
        self.model, self.state = model, state
        self.profiler = profiler if profiler is not None else NullProfiler()
        background = BACKGROUND if background is None else background
        # concurrent.futures' single worker: the thread is started once, jobs run in submission order
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="seqcal-write") if background else None
        self._job: Future[None] | None = None
        self.run_id = {**run_id, "data": data_fingerprint(batches) if batches is not None else None}
        self.weights = weights  # offload.SubgraphWeights when parameters live off-device, else None
        self.path = Path(output_dir)
        self.layout = ModelLayout.from_model(model)
        self.finished = -1
        self._edited_restored = False
        self.checkpoint_bytes = CHECKPOINT_BYTES if checkpoint_bytes is None else checkpoint_bytes
        # a resumed directory whose interrupted run recorded no finished subgraph (it starts over)
        self.resumed_empty = False
        if resume and (self.path / PROGRESS_NAME).is_file():
            self.writer, self.finished = self._resume()
            self.resumed_empty = self.finished < 0
        elif resume and (self.path / CONFIG_NAME).is_file():
            shutil.rmtree(self.path / RESUME_DIR, ignore_errors=True)  # left if killed after the save's end
            raise ResumeError(f"{self.path} holds a finished checkpoint: nothing to resume")
        else:
            self.writer = CheckpointWriter(self.path, overwrite=overwrite, layout=self.layout)
            shutil.rmtree(self.path / RESUME_DIR, ignore_errors=True)  # an overwritten run's saved subgraphs
            self._record(-1)  # first, before any work: the directory is a resumable run of these arguments
        self.last = self.finished  # the last subgraph whose modules and weights are on disk
        self.owner = module_owners(model, subgraphs, buffers=True)

    def _record(self, finished: int) -> None:
        choices = {"in_place_factor": bool(self.state.config.in_place_factor)}  # what a resume keeps
        self.writer.checkpoint({"finished": finished, "run": self.run_id, "choices": choices})
        self.finished = finished

    def _resume(self) -> tuple[CheckpointWriter, int]:
        """Check that the interrupted run is this one, then reopen its writer at its last record."""
        manifest = json.loads((self.path / PROGRESS_NAME).read_text(encoding="utf-8"))
        progress = manifest.get("progress", {})
        if not isinstance(progress.get("run"), Mapping):
            raise ResumeError(
                f"output_dir {self.path} holds an interrupted run recorded by an older seqcal, whose arguments "
                "cannot be compared; start it again with overwrite=True (--overwrite) or choose another output_dir"
            )
        differ = differences(progress["run"], self.run_id)
        if differ:  # checked before anything in the directory is touched
            raise ResumeError(
                f"output_dir {self.path} holds an interrupted run whose {', '.join(differ)} differ from this "
                f"run's; resume it with the same {', '.join(differ)}, or choose another output_dir "
                "(overwrite=True / --overwrite discards that run)"
            )
        _undo_close(self.path, manifest.get("closing", {}))
        writer, progress = CheckpointWriter.resume(self.path, layout=self.layout)
        finished = int(progress["finished"])
        for file in (self.path / RESUME_DIR).glob("*.st"):
            if not file.stem.isdigit() or int(file.stem) > finished:
                file.unlink()  # written after the last record: recomputed
        return writer, finished

    def done(self, sg: Subgraph) -> float:
        """``sg`` finished: write the modules it used last, save its quantized weights, record progress.

        The tensors are prepared here (checked, packed, copied to the host); the files are written by the worker
        thread when there is one (``background``). Returns the seconds spent waiting for the previous subgraph's
        writes.
        """
        names = [n for n, i in self.owner.items() if i == sg.index]
        # a module the subgraph holds but did not onload (an embedding read by rows, the lm_head after the last
        # down_proj) is copied from its file, or read for its write
        modules = module_tensors_for_write(
            self.writer, self.weights, self.model, names, self.state.results.quantized
        )
        mine = {n: q for n, q in self.state.results.quantized.items() if sg.holds(n)}
        tensors, schemes = resume_tensors(mine, self.state.results.module_errors)  # codes, schemes, entries
        edited, metadata = self._edited(sg)
        tensors.update(edited)
        metadata.update(schemes)
        # As they are now: a module a later subgraph still holds may be changed in place before the worker writes
        # (a fold dividing a producer's rows); the others' tensors are done changing.
        later = {k for k in tensors if self.owner.get(k.split(":")[0], -1) > sg.index}
        tensors = {k: v.detach().to("cpu", copy=k in later).contiguous() for k, v in tensors.items()}
        folder = self.path / RESUME_DIR
        folder.mkdir(exist_ok=True)

        def write() -> None:  # in the order of a synchronous save: the record comes after the files it covers
            with self.profiler.span(
                "write", f"subgraph {sg.index}", of=sg.index, worker=self._worker is not None
            ):
                for module in modules:
                    self.writer.add_tensors(module)
                if tensors:
                    save_file(tensors, str(folder / f"{sg.index}.st"), metadata=metadata)
                if self.writer.pending_bytes >= self.checkpoint_bytes:
                    self._record(sg.index)

        waited = self._submit(write)
        self.last = sg.index
        self._trim(mine, sg)
        return waited

    def _submit(self, job: Callable[[], None]) -> float:
        """Run ``job`` on the worker after the one before it (whose error is raised here); without a worker, now.
        Returns the seconds spent waiting for the one before."""
        if self._worker is None:
            job()
            return 0.0
        waited = self.drain()
        self._job = self._worker.submit(job)
        return waited

    def drain(self, raise_errors: bool = True) -> float:
        """Wait for the pending writes; their error is raised (``raise_errors``) or logged. Returns the seconds
        waited.

        After a failure elsewhere the pending writes still finish, so the directory resumes from as far as they
        got; their own error is then only logged (``raise_errors=False``), the first error being the one to
        report.
        """
        job, self._job = self._job, None
        if job is None:
            return 0.0
        start = time.perf_counter()
        try:
            job.result()
        except Exception as err:
            if raise_errors:
                raise
            logger.warning("seqcal: writing the checkpoint in the background failed too: %s", err)
        return time.perf_counter() - start

    def close(self) -> None:
        """Stop the worker thread (after its pending writes, whose error is logged). Idempotent."""
        self.drain(raise_errors=False)
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    def _restore_edited(self) -> None:
        """Put back every module a modifier changed in the finished subgraphs (besides the quantized ones), before
        the first replay: a folded producer runs in an earlier subgraph than the consumers whose file holds it.
        Files are read in subgraph order, so a module saved by several subgraphs gets its last value."""
        if self._edited_restored:
            return
        self._edited_restored = True
        files = sorted(
            (self.path / RESUME_DIR).glob("*.st"), key=lambda f: int(f.stem) if f.stem.isdigit() else -1
        )
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                deferred = _deferred(f.metadata() or {})
                for key in [k for k in f.keys() if ":param:" in k]:
                    name, _, param = key.partition(":param:")
                    if name not in deferred:  # put back when its subgraph is replayed (``restore``)
                        self._put_back(name, param, f.get_tensor(key))
                restore_records(self.state, f.metadata() or {})

    def _put_back(self, name: str, param: str, value: torch.Tensor) -> None:
        """One saved parameter or buffer of module ``name`` back into the model (or its offloaded store)."""
        module = self.model.get_submodule(name)
        target = getattr(module, param)
        if param in module._buffers:
            module._buffers[param] = value.to(target.device)
        elif target.device.type == "meta" and self.weights is not None:  # offloaded: onloaded from here
            self.weights.store.overrides[f"{name}.{param}"] = value
        else:
            target.data = value.to(target.device)
        self.state.ledger.changed.add(name)

    def _edited(self, sg: Subgraph) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The parameters and buffers of every module of ``sg`` a modifier changed in place (``RunState.
        changed_modules``: folded smoothing scales, pruned weights, calibrated buffers) that ``state.results.quantized``
        does not hold, and the records a replay needs about them; a replay puts them back with the quantized
        weights, so downstream subgraphs see what the interrupted run gave them."""
        out = {}
        names = sorted(
            n for n in self.state.changed_modules() if sg.holds(n) and n not in self.state.results.quantized
        )
        for name in names:
            module = self.model.get_submodule(name)
            for param, value in [
                *module.named_parameters(recurse=False),
                *module.named_buffers(recurse=False),
            ]:
                out[f"{name}:param:{param}"] = value.detach()
        mine = [n for n in self.state.changed_modules() if sg.holds(n)]
        sparsity = {
            n: [self.state.results.sparsity[n], self.state.results.module_errors.get(n, {}).get("sparsity")]
            for n in mine if n in self.state.results.sparsity
        }  # fmt: skip
        metadata = {"edited": json.dumps(sorted(n for n in mine if n in self.state.ledger.edited)),
                    "sparsity": json.dumps(sparsity)}  # fmt: skip
        # folds that divided this subgraph's cached inputs: a replay divides them again, and runs the producers
        # (in earlier subgraphs) with their weights from before the fold until then (``_deferred``)
        folds = self.state.ledger.divided.get(sg.index, [])
        for i, fold in enumerate(folds):
            out[f"{i}:fold:scales"] = fold.scales
        metadata["divided"] = fold_records(folds)
        return out, metadata

    def _trim(self, names: Any, sg: Subgraph) -> None:
        """Drop the codes of modules ``sg`` wrote to the checkpoint: only their scheme is needed (for config.json).

        Keeping them would hold the whole quantized model in RAM by the end of the run. A module a later subgraph
        still holds keeps them (a quantized producer that subgraph folds smoothing scales into, written after it).
        """
        empty = torch.empty(0)
        for name in [n for n in names if self.owner.get(n) == sg.index]:
            qw = self.state.results.quantized[name]
            # the input qparams stay (a few bytes): a replayed pass still fake-quantizes the module's inputs
            self.state.results.quantized[name] = replace(
                qw, q=empty, scale=empty, zero_point=None, g_idx=None
            )

    def restore(self, sg: Subgraph, schemes: dict[str, Any]) -> list[Fold]:
        """Put ``sg``'s saved quantized weights back into the model (replaying a finished subgraph).

        Args:
            sg: a subgraph finished by the interrupted run.
            schemes: module name -> QuantizationScheme of the recipe's modifiers: the modules a finished subgraph
                must have saved. The saved modules are rebuilt with the scheme their file records (a modifier's
                own choice per module); the recipe's only for a file written before files recorded it.

        Returns:
            The folds whose scales divided ``sg``'s cached inputs in the interrupted run (its file records
            them): the replay divides the inputs again.
        """
        self._restore_edited()  # before the first replay: a producer runs before the consumers that folded it
        file = self.path / RESUME_DIR / f"{sg.index}.st"
        if not file.is_file():
            if any(sg.holds(name) for name in schemes):
                raise ResumeError(  # replaying without them would save unquantized weights as quantized
                    f"{self.path}: the saved weights of finished subgraph {sg.index} ({file}) are missing; "
                    "the run cannot be resumed: start it again with overwrite=True"
                )
            return []
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        deferred = _deferred(metadata)
        # already put back by _restore_edited, except the producers of this subgraph's divisions: folded from now
        for key in [k for k in tensors if ":param:" in k]:
            name, _, param = key.partition(":param:")
            value = tensors.pop(key)
            if name in deferred:
                self._put_back(name, param, value)
        records = metadata.get("divided", "[]")
        scales = [tensors.pop(f"{i}:fold:scales") for i in range(len(json.loads(records)))]
        folds = folds_from(records, scales)
        saved = saved_schemes(metadata)
        for name in sorted({k.split(":")[0] for k in tensors}):
            qw = saved_weight(tensors, name, saved[name] if name in saved else schemes[name])
            dequantize_into(self.model.get_submodule(name).weight, qw)
            self.state.results.quantized[name] = qw
        self._trim({k.split(":")[0] for k in tensors}, sg)
        return folds

    def finish(self, tokenizer: Any = None, recipe_yaml: str | None = None) -> Path:
        """Write the modules no subgraph used, the extras and, last, config.json.

        Progress is recorded first (every subgraph is on disk), so a kill from here on resumes by replaying the
        subgraphs and finishing the save again.
        """
        self.drain()  # the last subgraph's files, and any error writing them
        self.close()
        if self.last > self.finished:
            self._record(self.last)
        # the modules no subgraph holds, one's weights at a time: they may be a vision tower run in opaque code
        for name in [name for name, index in self.owner.items() if index == -1]:
            quantized = self.state.results.quantized
            self.writer.add_tensors(
                module_tensors_for_write(self.writer, self.weights, self.model, [name], quantized)[0]
            )
        self.writer.add_transforms(self.state.results.transform_tensors)
        kept = write_extra_tensors(self.writer, self.model)  # the source's MTP layers, as it has them
        write_extras(self.path, self.model, tokenizer=tokenizer, recipe_yaml=recipe_yaml)
        out = self.writer.close(ignore_modules(checkpoint_config(self.model, self.state, self.layout), kept))
        shutil.rmtree(self.path / RESUME_DIR, ignore_errors=True)
        return out
