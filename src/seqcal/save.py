"""Write a calibrated model as a compressed-tensors checkpoint, module by module.

Each quantized Linear is stored in the format compressed-tensors' own ``infer_module_format`` picks for its
scheme (the same tensors its compressors write, so transformers and vLLM load it):

    pack-quantized   int weights without activation quant (W4A16, W8A16, any 1..8 bits):
                     weight_packed int32 [out, ceil(in * b / 32)], weight_scale, weight_shape int64 [2],
                     weight_zero_point (asymmetric; packed along dim 0 for channel/group)
    int-quantized    int weights with dynamic activations (W8A8): weight int8 [out, in], weight_scale
    float-quantized  fp8 weights with dynamic activations (FP8_DYNAMIC): weight float8_e4m3fn, weight_scale
    naive-quantized  anything else compressed-tensors would store unpacked (fp8 weight-only)

Everything else of ``model.state_dict()`` is written as it is; tied weights are written once, and keys
go through transformers' ``revert_weight_conversion`` (as ``save_pretrained`` does), one module at a time.
Shards are written as they fill; ``config.json`` is written last, so a crash never leaves a directory that
looks finished.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import compressed_tensors
import torch
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, QuantizationStatus
from compressed_tensors.utils.match import is_match, match_named_modules, match_targets
from safetensors.torch import save_file
from torch import Tensor

from seqcal.algorithms import code_dtype, dequantize, pack_int32, quant_range
from seqcal.modifiers.base import QuantizedWeight, RunState
from seqcal.modifiers.schemes import strategy_of

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PROGRESS_NAME = "seqcal_progress.json"  # present while a run is unfinished: what `resume=True` continues
DEFAULT_MAX_SHARD_SIZE = 2 * 1024**3
WRITABLE_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
Revert = Callable[[dict[str, Tensor]], dict[str, Tensor]]


def _format(scheme: QuantizationScheme) -> str:
    """The compressed-tensors format of a Linear quantized with ``scheme`` (its own choice unless set)."""
    fmt = scheme.format or infer_module_format(torch.nn.Linear, scheme)
    fmt = str(getattr(fmt, "value", fmt))
    if fmt not in WRITABLE_FORMATS:
        raise ValueError(
            f"save: format {fmt!r} is not supported; seqcal writes {', '.join(WRITABLE_FORMATS)}"
        )
    return fmt


def _check_quantized(name: str, qw: QuantizedWeight, shape: tuple[int, ...]) -> None:
    """Reject what would load as a different model than the one in memory."""
    scheme, w = qw.scheme, qw.scheme.weights
    where = f"save: module {name!r}"
    inputs = scheme.input_activations
    if scheme.output_activations is not None or (inputs is not None and not inputs.dynamic):
        raise ValueError(
            f"{where}: static or output activation quantization needs calibrated activation scales, which "
            "seqcal does not produce; use a dynamic scheme (W8A8, FP8_DYNAMIC) or a weight-only one (W4A16)"
        )
    if tuple(qw.q.shape) != shape or qw.q.dtype != code_dtype(w.type):
        raise ValueError(
            f"{where}: codes are {qw.q.dtype} {list(qw.q.shape)}, expected {code_dtype(w.type)} {list(shape)} "
            "(the module's weight shape); the quantized state does not belong to this model"
        )
    if (qw.zero_point is None) != w.symmetric:
        raise ValueError(f"{where}: zero_point must be None exactly when the scheme is symmetric")
    if qw.g_idx is not None and not torch.equal(
        qw.g_idx.cpu().long(), torch.arange(shape[1]) // (w.group_size or shape[1])
    ):
        raise ValueError(
            f"{where}: activation-ordered groups (GPTQ actorder='group', a g_idx) cannot be saved: "
            "compressed-tensors >= 0.20 and vLLM removed g_idx support (a checkpoint with it would load "
            "wrong or not at all); quantize with actorder='weight' (alias 'static'), same format, no g_idx"
        )
    if w.type == "int":
        qmin, qmax = quant_range(w.num_bits)
        if qw.q.min() < qmin or qw.q.max() > qmax:
            raise ValueError(f"{where}: codes leave the {w.num_bits}-bit range [{qmin:g}, {qmax:g}]")


def _compressed(name: str, qw: QuantizedWeight, shape: tuple[int, ...]) -> dict[str, Tensor]:
    """The tensors compressed-tensors stores for one quantized weight (local names, module docstring)."""
    _check_quantized(name, qw, shape)
    w = qw.scheme.weights
    out = {"weight_scale": qw.scale}
    zp = qw.zero_point
    if _format(qw.scheme) == "pack-quantized":
        out["weight_packed"] = pack_int32(qw.q, w.num_bits, dim=-1)  # [out, ceil(in * b / 32)]
        out["weight_shape"] = torch.tensor(shape)  # int64, as compressed-tensors' compressor writes it
        if zp is not None:  # channel/group zero points are packed across output rows, [ceil(out * b / 32), G]
            packed = strategy_of(w) in ("channel", "group")
            out["weight_zero_point"] = pack_int32(zp, w.num_bits, dim=0) if packed else zp
    else:
        out["weight"] = qw.q
        if zp is not None:
            out["weight_zero_point"] = zp
    return out


def _check_fake_quantized(name: str, weight: Tensor, qw: QuantizedWeight) -> None:
    """The weight in memory must be exactly what the checkpoint dequantizes to."""
    w = qw.scheme.weights
    group_size = w.group_size if strategy_of(w) == "group" else None
    expected = dequantize(qw.q, qw.scale, qw.zero_point, group_size=group_size, dtype=weight.dtype)
    if not torch.equal(expected, weight.to(expected.device)):
        diff = (expected.float() - weight.to(expected.device).float()).abs().max().item()
        raise ValueError(
            f"save: module {name!r}: its weight differs from the dequantized codes in state.quantized "
            f"(max |diff| {diff:.3g}); something changed the weight after it was quantized, so the checkpoint "
            "would not be the model in memory. Quantize after every weight-changing modifier"
        )


@dataclass(frozen=True)
class ModelLayout:
    """How in-memory state-dict keys become checkpoint keys (transformers' save_pretrained conventions).

    Attributes:
        skip: keys not written: tied copies (``lm_head.weight`` when tied to the embeddings) and
            ``_keys_to_ignore_on_save``.
        tied_modules: modules owning a tied weight (quantizing one would also change the other).
        revert: transformers' ``revert_weight_conversion`` bound to the model (fused MoE experts back to
            per-expert tensors, renamed prefixes back to the original names), or None.
    """

    skip: frozenset[str] = frozenset()
    tied_modules: frozenset[str] = frozenset()
    revert: Revert | None = None

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelLayout:
        """Read tied weights and weight conversions from a (transformers) model.

        Args:
            model: the model; tied weights must share their tensor, as ``tie_weights`` leaves them.

        Returns:
            The layout.

        Example:
            >>> CheckpointWriter("out", layout=ModelLayout.from_model(model))  # doctest: +SKIP
        """
        skip = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
        tied_modules = set()
        for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
            t, s = _tensor_or_none(model, target), _tensor_or_none(model, source)
            if t is None or s is None:
                continue
            # offloaded (meta) tensors cannot be compared: trust the config, as save_pretrained does
            if (
                t is not s
                and not (t.is_meta or s.is_meta)
                and (t.data_ptr(), t.shape) != (s.data_ptr(), s.shape)
            ):
                raise ValueError(
                    f"save: the config ties {target} to {source} but they are different tensors, so a reload "
                    "would overwrite one with the other; set model.config.tie_word_embeddings = False"
                )
            skip.add(target)
            tied_modules.update((target.rpartition(".")[0], source.rpartition(".")[0]))
        revert = None
        if hasattr(model, "config") and hasattr(model, "all_tied_weights_keys"):  # a PreTrainedModel
            from transformers.core_model_loading import revert_weight_conversion

            revert = partial(revert_weight_conversion, model)
        return cls(frozenset(skip), frozenset(tied_modules), revert)

    def check_quantizable(self, name: str) -> None:
        """Raise if module ``name`` owns a tied weight: quantizing it changed the tied weight too."""
        if name in self.tied_modules:
            raise ValueError(
                f"save: {name!r} was quantized but its weight is tied to another module's (e.g. lm_head to the "
                "embeddings), which quantizing changed too; add it to `ignore`, or untie before quantizing"
            )

    def checkpoint_names(self, module_name: str) -> list[str]:
        """Names a module has in the checkpoint: its in-memory name, and the reverted one if different."""
        if self.revert is None:
            return [module_name]
        keys = self.revert({f"{module_name}.weight": torch.empty(0, device="meta")})
        return list(dict.fromkeys([module_name, *(k.removesuffix(".weight") for k in keys)]))


def _tensor_or_none(model: torch.nn.Module, key: str) -> Tensor | None:
    module_name, _, attr = key.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    return module._parameters.get(attr, module._buffers.get(attr))


def _module_tensors(
    name: str, module: torch.nn.Module, quantized: QuantizedWeight | None
) -> dict[str, Tensor]:
    """The module's own state-dict entries (no children), its weight replaced by the compressed tensors."""
    local: dict[str, Any] = {}
    module._save_to_state_dict(local, "", keep_vars=True)  # honours persistent buffers and overrides
    if quantized is not None:
        weight = local.pop("weight", None)
        if not isinstance(weight, Tensor):
            raise ValueError(f"save: module {name!r} is in state.quantized but has no weight")
        local.update(_compressed(name, quantized, tuple(weight.shape)))  # checks the codes first
        if weight.device.type != "meta":
            _check_fake_quantized(name, weight, quantized)
    prefix = f"{name}." if name else ""
    return {prefix + k: v for k, v in local.items()}


class CheckpointWriter:
    """Streams tensors into safetensors shards; ``close`` writes the index, then ``config.json``.

    At most one shard (``max_shard_size`` bytes, or one larger tensor) is held in memory. Shards are named
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
        ...     writer.add_module(name, module, state.quantized.get(name))
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
        self._pending: dict[str, Tensor] = {}
        self._pending_bytes = 0
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
        if quantized is not None:
            self.layout.check_quantizable(name)
        tensors = _module_tensors(name, module, quantized)
        tensors = {k: v for k, v in tensors.items() if k not in self.layout.skip}
        if tensors and self.layout.revert is not None:
            tensors = self.layout.revert(tensors)
        for key in sorted(tensors):
            self.add_tensor(key, tensors[key])

    def add_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Add one tensor under the checkpoint key ``name`` (a copy is taken; it is written when its shard fills)."""
        if self._closed:
            raise RuntimeError(f"CheckpointWriter: add_tensor({name!r}) after close()")
        if name in self._weight_map or name in self._pending:
            raise ValueError(f"CheckpointWriter: {name!r} was already added; each key is written once")
        if tensor.device.type == "meta":
            raise ValueError(
                f"CheckpointWriter: {name!r} is on the meta device (offloaded); onload it before adding"
            )
        t = tensor.detach().to("cpu", copy=True).contiguous()
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_size:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += nbytes
        self._total_size += nbytes

    def _flush(self) -> None:
        path = self.output_dir / f"model-{len(self._shards) + 1:05d}.safetensors.partial"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._weight_map.update(dict.fromkeys(self._pending, len(self._shards)))
        self._shards.append(path)
        self._pending, self._pending_bytes = {}, 0

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
        writer._pending, writer._pending_bytes, writer._closed = {}, 0, False
        writer._shards = [path / name for name in manifest["shards"]]
        writer._weight_map = dict(manifest["weight_map"])
        writer._total_size = manifest["total_size"]
        for stray in path.glob("model-*.safetensors.partial"):
            if stray not in writer._shards:
                stray.unlink()
        return writer, manifest["progress"]

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
        self._pending, self._closed = {}, True


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
        ]:
            stale.unlink(missing_ok=True)  # files of an earlier save that this one may not replace
    path.mkdir(parents=True, exist_ok=True)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: readers see the old file or the whole new one


def _groups(state: RunState) -> tuple[list[QuantizationScheme], dict[str, int]]:
    """Distinct schemes in order of first use, and module name -> index of its scheme."""
    schemes: list[QuantizationScheme] = []
    index: dict[str, int] = {}
    for name, qw in state.quantized.items():
        if qw.scheme not in schemes:
            schemes.append(qw.scheme)
        index[name] = schemes.index(qw.scheme)
    return schemes, index


def quantization_config(state: RunState, ignore: list[str], *, exact_targets: bool = False) -> dict:
    """The ``quantization_config`` block of ``config.json``, as compressed-tensors' ModelCompressor writes it.

    Args:
        state: the run's state; one config group per distinct scheme in ``state.quantized``.
        ignore: names of the modules the group targets match but that stay unquantized (e.g. ``lm_head``).
        exact_targets: target the quantized modules by exact name instead of the schemes' own targets.

    Returns:
        A JSON-ready dict: config_groups (each with its format), format (one format or "mixed-precision"),
        ignore, quant_method "compressed-tensors", quantization_status "compressed", version, ...

    Example:
        >>> quantization_config(state, ignore=["lm_head"])["format"]  # doctest: +SKIP
        'pack-quantized'
    """
    if not state.quantized:
        raise ValueError(
            "quantization_config: state.quantized is empty; save an unquantized model with save_pretrained"
        )
    schemes, index = _groups(state)
    groups = {}
    for i, scheme in enumerate(schemes):
        group = scheme.model_copy(deep=True)
        group.format = _format(scheme)
        if exact_targets:
            group.targets = sorted(n for n, j in index.items() if j == i)
        groups[f"group_{i}"] = group
    formats = {g.format for g in groups.values()}
    config = QuantizationConfig(
        config_groups=groups,
        format=formats.pop() if len(formats) == 1 else "mixed-precision",
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=list(ignore),
    )
    block = {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **config.model_dump(exclude={"quant_method"}),
    }
    return json.loads(json.dumps(block))  # enums and dtypes as the strings config.json holds


def _assignment(model: torch.nn.Module, block: dict) -> dict[str, str]:
    """Module name -> config group, as compressed-tensors' apply_quantization_config resolves it on load."""
    target_to_group = {t: g for g, scheme in block["config_groups"].items() for t in scheme["targets"]}
    return {
        name: target_to_group[match_targets(name, module, target_to_group)[0]]
        for name, module in match_named_modules(model, target_to_group, block["ignore"])
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
    }


def _checked_block(model: torch.nn.Module, state: RunState, layout: ModelLayout) -> dict:
    """The quantization_config whose targets and ignore give exactly ``state.quantized`` on load."""
    modules = dict(model.named_modules())
    for name in state.quantized:
        if not isinstance(modules.get(name), torch.nn.Linear):
            raise ValueError(f"save: state.quantized names {name!r}, which is not a Linear of this model")
        layout.check_quantizable(name)
    targets = [t for qw in state.quantized.values() for t in qw.scheme.targets]
    unquantized = [
        name
        for name, module in modules.items()
        if name not in state.quantized
        and (
            isinstance(module, torch.nn.Linear)
            or (isinstance(module, torch.nn.Embedding) and is_match(name, module, targets))
        )
    ]
    ignore = [alias for name in unquantized for alias in layout.checkpoint_names(name)]
    block = quantization_config(state, ignore)
    expected = {name: f"group_{i}" for name, i in _groups(state)[1].items()}
    if _assignment(model, block) != expected:  # overlapping targets resolve differently in compressed-tensors
        block = quantization_config(state, ignore, exact_targets=True)
        for group in block["config_groups"].values():
            group["targets"] = [a for n in group["targets"] for a in layout.checkpoint_names(n)]
    return block


def checkpoint_config(model: torch.nn.Module, state: RunState, layout: ModelLayout | None = None) -> dict:
    """``config.json`` content: the model's config as save_pretrained writes it, plus ``quantization_config``.

    The ignore list holds every unquantized Linear; when the schemes' own targets would resolve to other
    schemes than ``state.quantized`` in compressed-tensors (overlapping targets), the groups target the
    quantized modules by name instead.

    Args:
        model: the transformers model (only names, classes and its config are read).
        state: the run's state.
        layout: the layout the weights were written with (default: ``ModelLayout.from_model(model)``).

    Returns:
        A JSON-ready dict.

    Example:
        >>> writer.close(checkpoint_config(model, state, layout))  # doctest: +SKIP
    """
    layout = layout or ModelLayout.from_model(model)
    config = copy.deepcopy(model.config)  # the model's own config stays untouched
    config.dtype = str(getattr(model, "dtype", torch.float32)).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    data = json.loads(config.to_json_string(use_diff=True))
    data["quantization_config"] = _checked_block(model, state, layout)
    return data


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
    must be the fake-quantized values of ``state.quantized`` (checked exactly). ``config.json`` comes last.

    Args:
        model: the calibrated transformers model (weights onloaded: not on the meta device).
        state: the run's state; ``state.quantized`` maps module names to compressed weights.
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
            writer.add_module(name, module, state.quantized.get(name))
        write_extras(writer.output_dir, model, tokenizer=tokenizer, recipe_yaml=recipe_yaml)
        return writer.close(config)
    except BaseException:
        writer.abort()
        raise
