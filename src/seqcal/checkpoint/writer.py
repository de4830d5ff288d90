"""Write a calibrated model as a compressed-tensors checkpoint, module by module.

Each quantized Linear is stored in the format compressed-tensors' own ``infer_module_format`` picks for its
scheme (the same tensors its compressors write, so transformers and vLLM load it):

    pack-quantized   int weights without activation quant (W4A16, W8A16, any 1..8 bits):
                     weight_packed int32 [out, ceil(in * b / 32)], weight_scale, weight_shape int64 [2],
                     weight_zero_point (asymmetric; packed along dim 0 for channel/group)
    int-quantized    int weights with 8-bit activations (W8A8): weight int8 [out, in], weight_scale
    float-quantized  fp8 weights with fp8 activations (FP8_DYNAMIC, FP8): weight float8_e4m3fn, weight_scale
                     (either: static activations add input_scale [1] in the weight's dtype, and
                     input_zero_point when asymmetric)
    naive-quantized  anything else compressed-tensors would store unpacked (fp8 weight-only)

Everything else of ``model.state_dict()`` is written as it is; tied weights are written once, and keys
go through transformers' ``revert_weight_conversion`` (as ``save_pretrained`` does), one module at a time.
Shards are written as they fill; ``config.json`` is written last, so a crash never leaves a directory that
looks finished.

The key layout (``ModelLayout``) lives in ``seqcal.checkpoint.layout``, the config side
(``quantization_config``, ``checkpoint_config``) in ``seqcal.checkpoint.config`` and the per-module tensors in
``seqcal.checkpoint.tensors``; the layout's and the config's names are re-exported here.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from seqcal.checkpoint.config import WRITABLE_FORMATS, checkpoint_config, quantization_config
from seqcal.checkpoint.layout import ModelLayout, Revert
from seqcal.checkpoint.shard_file import _ShardFile
from seqcal.checkpoint.tensors import _module_tensors
from seqcal.modifiers.base import RunState
from seqcal.records import QuantizedWeight
from seqcal.sources.extras import ignore_modules, write_extra_tensors
from seqcal.sources.files import FileCopy

__all__ = [
    "CONFIG_NAME",
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX_NAME",
    "PROGRESS_NAME",
    "SINGLE_FILE",
    "WRITABLE_FORMATS",
    "CheckpointWriter",
    "ModelLayout",
    "Revert",
    "checkpoint_config",
    "quantization_config",
    "save_checkpoint",
    "write_extras",
]

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PROGRESS_NAME = "seqcal_progress.json"  # present while a run is unfinished: what `resume=True` continues
REPORT_FILENAME = "quantization_report.json"  # the per-module errors (seqcal.evaluation.errors writes it)
ERRORS_PNG = "quantization_errors.png"  # its plot (seqcal oneshot draws it there by default)
DEFAULT_MAX_SHARD_SIZE = 2 * 1024**3
COPY_BUFFER = 64 << 20  # bytes: a FileCopy's pieces (an embedding of a giant is gigabytes)


class CheckpointWriter:
    """Streams tensors into safetensors shards; ``close`` writes the index, then ``config.json``.

    Tensors go to disk as they are added (a shard's header is written when it is finished), so the writer
    holds no tensor in memory; a shard has at most ``max_shard_size`` bytes (or one larger tensor). Shards are named
    ``model-00001.safetensors.partial`` while writing and renamed on ``close`` to transformers' names
    (``model.safetensors`` or ``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json``).

    Args:
        output_dir: the checkpoint directory (created).
        max_shard_size: bytes per shard.
        overwrite: allow a non-empty ``output_dir`` (its config and weight files are removed first).
        layout: tied keys to skip and key conversions; ``ModelLayout()`` writes every key as given.

    Example:
        >>> layout = ModelLayout.from_model(model)  # doctest: +SKIP
        >>> writer = CheckpointWriter("out", layout=layout)  # doctest: +SKIP
        >>> for name, module in subgraph_modules:  # as each subgraph finishes, each module once  # doctest: +SKIP
        ...     writer.add_module(name, module, state.results.quantized.get(name))
        >>> writer.close(checkpoint_config(model, state, layout))  # doctest: +SKIP
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
        *,
        overwrite: bool = False,
        layout: ModelLayout | None = None,
    ) -> None:
        if not isinstance(max_shard_size, int) or max_shard_size <= 0:
            raise ValueError(
                f"CheckpointWriter: max_shard_size must be a positive int (bytes), got {max_shard_size!r}"
            )
        self.output_dir = Path(output_dir)
        self.max_shard_size = max_shard_size
        self.layout = layout or ModelLayout()
        self._pending: dict[str, None] = {}  # keys in the open shard, not yet recorded
        self._pending_bytes = 0
        self._open: _ShardFile | None = None
        self._shards: list[Path] = []  # partial files written so far
        self._weight_map: dict[str, int] = {}  # key -> shard index
        self._total_size = 0
        self._closed = False
        _prepare_dir(self.output_dir, overwrite)

    def add_module(self, name: str, module: torch.nn.Module, quantized: QuantizedWeight | None) -> None:
        """Add one module's own parameters and persistent buffers (not its children's).

        Args:
            name: qualified module name (``""`` for the root).
            module: the module; its tensors must not be on the meta device (onload it first).
            quantized: its compressed weight, or None to write the weight as it is.
        """
        self.add_tensors(self.module_tensors(name, module, quantized))

    def module_tensors(
        self, name: str, module: torch.nn.Module, quantized: QuantizedWeight | None
    ) -> dict[str, Tensor]:
        """What ``add_module`` writes for one module, under its checkpoint keys: the codes checked against the
        weight and packed, tied keys left out, keys converted. Touches no file, so it may run while another
        thread adds what an earlier call returned (``StreamingCheckpoint``'s writes in the background)."""
        if quantized is not None:
            self.layout.check_quantizable(name)
        tensors = _module_tensors(name, module, quantized)
        tensors = {k: v for k, v in tensors.items() if k not in self.layout.skip}
        if tensors and self.layout.revert is not None:
            tensors = self.layout.revert(tensors)
        return tensors

    def add_transforms(self, tensors: dict[str, Tensor]) -> None:
        """The online rotations' matrices (``RunState.transform_tensors``, keyed by in-memory module names)."""
        if not tensors:  # no online rotation: nothing to write
            return
        if self.layout.revert is not None:
            tensors = self.layout.revert(dict(tensors))
        self.add_tensors({k: v.detach().to("cpu") for k, v in tensors.items()})

    def add_tensors(self, tensors: dict[str, Tensor]) -> None:
        """``add_tensor`` for each, in key order (what ``module_tensors`` returned)."""
        for key in sorted(tensors):
            self.add_tensor(key, tensors[key])

    def add_tensor(self, name: str, tensor: torch.Tensor | FileCopy) -> None:
        """Write one tensor under the checkpoint key ``name`` to the open shard (its bytes go to disk now); a
        ``FileCopy`` is copied from its file through a buffer of ``COPY_BUFFER`` bytes."""
        if self._closed:
            raise RuntimeError(f"CheckpointWriter: add_tensor({name!r}) after close()")
        if name in self._weight_map or name in self._pending:
            raise ValueError(f"CheckpointWriter: {name!r} was already added; each key is written once")
        if isinstance(tensor, FileCopy):
            dtype, shape, pieces = tensor.pieces(COPY_BUFFER)
            dims, nbytes = len(shape), math.prod(shape) * tensor.dtype.itemsize
        elif tensor.device.type == "meta":
            raise ValueError(
                f"CheckpointWriter: {name!r} is on the meta device (offloaded); onload it before adding"
            )
        else:
            dims, nbytes = tensor.dim(), tensor.numel() * tensor.element_size()
        full = self._open is not None and not self._open.fits(name, dims)
        if self._pending and (full or self._pending_bytes + nbytes > self.max_shard_size):
            self._flush()
        self._open = self._open or self._new_shard()
        if not self._pending and not self._open.fits(name, dims):
            raise ValueError(
                f"CheckpointWriter: the header entry of {name!r} ({len(name)} characters, {dims} dims) "
                f"does not fit a shard header's {self._open.reserve} bytes; shorten the key"
            )
        if isinstance(tensor, FileCopy):
            self._open.add_pieces(name, dtype, shape, pieces)
        else:
            self._open.add(name, tensor)
        self._pending[name] = None
        self._pending_bytes += nbytes
        self._total_size += nbytes

    def _new_shard(self) -> _ShardFile:
        return _ShardFile(self.output_dir / f"model-{len(self._shards) + 1:05d}.safetensors.partial")

    def _flush(self) -> None:
        shard = self._open or self._new_shard()  # an empty model still gets one (empty) shard
        shard.finish({"format": "pt"})
        self._weight_map.update(dict.fromkeys(self._pending, len(self._shards)))
        self._shards.append(shard.path)
        self._open, self._pending, self._pending_bytes = None, {}, 0

    def checkpoint(self, progress: dict[str, Any]) -> None:
        """Flush everything added so far and record it, with ``progress``, for ``resume``.

        After this returns, a crash (even SIGKILL) loses nothing added before it: the manifest lists the
        shards on disk and is replaced atomically.
        """
        if self._pending:
            self._flush()
        manifest = {
            "progress": progress,
            "shards": [p.name for p in self._shards],
            "weight_map": self._weight_map,
            "total_size": self._total_size,
        }
        _write_json(self.output_dir / PROGRESS_NAME, manifest)

    @classmethod
    def resume(cls, output_dir: str | os.PathLike, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, *,
               layout: ModelLayout | None = None) -> tuple[CheckpointWriter, dict[str, Any]]:  # fmt: skip
        """Reopen an interrupted checkpoint at its last ``checkpoint()``; returns (writer, progress).

        Shards written after that point are removed (they would be written again).
        """
        path = Path(output_dir)
        manifest = json.loads((path / PROGRESS_NAME).read_text(encoding="utf-8"))
        writer = cls.__new__(cls)
        writer.output_dir, writer.max_shard_size = path, max_shard_size
        writer.layout = layout or ModelLayout()
        writer._pending, writer._pending_bytes, writer._closed, writer._open = {}, 0, False, None
        writer._shards = [path / name for name in manifest["shards"]]
        writer._weight_map = dict(manifest["weight_map"])
        writer._total_size = manifest["total_size"]
        for stray in path.glob("model-*.safetensors.partial"):
            if stray not in writer._shards:
                stray.unlink()
        return writer, manifest["progress"]

    @property
    def pending_bytes(self) -> int:
        """Bytes added since the last flush (on disk in the open shard, not yet recorded in the progress)."""
        return self._pending_bytes

    def written(self) -> set[str]:
        """Checkpoint keys already on disk or pending."""
        return set(self._weight_map) | set(self._pending)

    def read(self, key: str) -> Tensor:
        """A tensor already written to a shard (used when resuming)."""
        from safetensors import safe_open

        with safe_open(str(self._shards[self._weight_map[key]]), framework="pt") as f:
            return f.get_tensor(key)

    def close(self, config: dict) -> Path:
        """Write the last shard, give shards their final names, the index (if sharded), then ``config.json``.

        Args:
            config: the full ``config.json`` content (``quantization_config`` included).

        Returns:
            The output directory.
        """
        if self._closed:
            raise RuntimeError("CheckpointWriter: close() called twice")
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        progress = self.output_dir / PROGRESS_NAME
        if progress.is_file():  # a kill while renaming: the resumed run renames them back (streaming)
            manifest = json.loads(progress.read_text(encoding="utf-8"))
            manifest["closing"] = {p.name: final for p, final in zip(self._shards, names)}
            _write_json(progress, manifest)
        for path, final in zip(self._shards, names):
            os.replace(path, self.output_dir / final)
        if n > 1:
            index = {
                "metadata": {"total_size": self._total_size},
                "weight_map": {k: names[i] for k, i in sorted(self._weight_map.items())},
            }
            _write_json(self.output_dir / INDEX_NAME, index)
        _write_json(self.output_dir / CONFIG_NAME, config)  # last: its presence means "finished"
        (self.output_dir / PROGRESS_NAME).unlink(missing_ok=True)
        self._closed = True
        return self.output_dir

    def abort(self) -> None:
        """Remove the partial shards written so far (after an error); the directory stays unfinished."""
        for path in self._shards:
            path.unlink(missing_ok=True)
        if self._open is not None:
            self._open.discard()
        self._open, self._pending, self._closed = None, {}, True


def _prepare_dir(path: Path, overwrite: bool) -> None:
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"save: output_dir {path} is a file; give a directory path")
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"save: output_dir {path} exists and is not empty; choose another directory or pass overwrite=True"
            )
        (path / CONFIG_NAME).unlink(missing_ok=True)  # first, so the directory no longer looks finished
        for stale in [
            *path.glob("model*.safetensors*"),
            path / "generation_config.json",
            path / "recipe.yaml",
            path / REPORT_FILENAME,
            path / ERRORS_PNG,  # a report or plot of an earlier run must not pass for this one's
        ]:
            stale.unlink(missing_ok=True)  # files of an earlier save that this one may not replace
    path.mkdir(parents=True, exist_ok=True)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: readers see the old file or the whole new one


def write_extras(
    output_dir: str | os.PathLike,
    model: torch.nn.Module,
    *,
    tokenizer: Any = None,
    recipe_yaml: str | None = None,
) -> None:
    """Write the tokenizer, ``recipe.yaml`` and ``generation_config.json`` (when given / present).

    Args:
        output_dir: the checkpoint directory.
        model: its ``generation_config`` is saved when the model can generate.
        tokenizer: saved with ``tokenizer.save_pretrained``.
        recipe_yaml: the recipe text.

    Example:
        >>> write_extras("out", model, tokenizer=tok, recipe_yaml=recipe.to_yaml())  # doctest: +SKIP
    """
    if tokenizer is not None:
        tokenizer.save_pretrained(str(output_dir))
    if recipe_yaml is not None:
        (Path(output_dir) / "recipe.yaml").write_text(recipe_yaml, encoding="utf-8")
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and getattr(model, "can_generate", lambda: False)():
        generation_config.save_pretrained(str(output_dir))


def save_checkpoint(
    model: torch.nn.Module,
    state: RunState,
    output_dir: str | os.PathLike,
    *,
    tokenizer: Any = None,
    recipe_yaml: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
) -> Path:
    """Save ``model`` with the compressed weights of ``state`` as a compressed-tensors checkpoint.

    Modules are written one at a time (shards flushed as they fill); the model's quantized Linear weights
    must be the fake-quantized values of ``state.results.quantized`` (checked exactly). ``config.json`` comes last.

    Args:
        model: the calibrated transformers model (weights onloaded: not on the meta device).
        state: the run's state; ``state.results.quantized`` maps module names to compressed weights.
        output_dir: checkpoint directory; must be empty or absent unless ``overwrite``.
        tokenizer: saved with ``tokenizer.save_pretrained`` when given.
        recipe_yaml: written to ``recipe.yaml`` when given.
        max_shard_size: bytes per safetensors shard.
        overwrite: allow a non-empty ``output_dir`` (its earlier config and weights are removed first).

    Returns:
        The output directory.

    Example:
        >>> save_checkpoint(model, state, "llama-w4a16", tokenizer=tok)  # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained("llama-w4a16")  # doctest: +SKIP
    """
    layout = ModelLayout.from_model(model)
    config = checkpoint_config(model, state, layout)  # before writing: bad state fails with nothing written
    writer = CheckpointWriter(output_dir, max_shard_size, overwrite=overwrite, layout=layout)
    try:
        for name, module in model.named_modules():
            writer.add_module(name, module, state.results.quantized.get(name))
        writer.add_transforms(state.results.transform_tensors)
        kept = write_extra_tensors(writer, model)  # the source's MTP layers, as it has them
        write_extras(writer.output_dir, model, tokenizer=tokenizer, recipe_yaml=recipe_yaml)
        return writer.close(ignore_modules(config, kept))
    except BaseException:
        writer.abort()
        raise
