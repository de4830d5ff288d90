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
import warnings
from collections.abc import Callable, Iterable
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
DEFAULT_MAX_SHARD_SIZE = 2 * 1024**3
WRITABLE_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
Revert = Callable[[dict[str, Tensor]], dict[str, Tensor]]


def weight_format(scheme: QuantizationScheme) -> str:
    """The compressed-tensors format of a Linear quantized with ``scheme`` (its own choice unless set)."""
    fmt = scheme.format or infer_module_format(torch.nn.Linear, scheme)
    fmt = str(getattr(fmt, "value", fmt))
    if fmt not in WRITABLE_FORMATS:
        raise ValueError(f"save: format {fmt!r} is not supported; seqcal writes {', '.join(WRITABLE_FORMATS)}")
    return fmt


def _check_quantized(name: str, qw: QuantizedWeight, shape: tuple[int, ...]) -> None:
    """Reject what would load as a different model than the one in memory."""
    scheme, w = qw.scheme, qw.scheme.weights
    where = f"save: module {name!r}"
    acts = [scheme.input_activations, scheme.output_activations]
    if any(a is not None and not a.dynamic for a in acts) or scheme.output_activations is not None:
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


def compressed_tensors_for(name: str, qw: QuantizedWeight, shape: tuple[int, ...]) -> dict[str, Tensor]:
    """The tensors compressed-tensors stores for one quantized weight, keyed by local name.

    Args:
        name: the module's name (for errors).
        qw: its compressed form (codes in original column order).
        shape: the module's weight shape ``(out, in)``.

    Returns:
        ``{"weight_packed" | "weight": ..., "weight_scale": ..., ...}`` as listed in the module docstring.

    Example:
        >>> tensors = compressed_tensors_for("fc", state.quantized["fc"], (64, 128))  # doctest: +SKIP
    """
    _check_quantized(name, qw, shape)
    w = qw.scheme.weights
    out = {"weight_scale": qw.scale}
    zp = qw.zero_point
    if weight_format(qw.scheme) == "pack-quantized":
        out["weight_packed"] = pack_int32(qw.q, w.num_bits, dim=-1)  # [out, ceil(in * b / 32)]
        out["weight_shape"] = torch.tensor(shape)  # int64, as compressed-tensors' compressor writes it
        if zp is not None:  # per-channel/group zero points are packed across output rows
            out["weight_zero_point"] = pack_int32(zp, w.num_bits, dim=0) if zp.ndim == 2 else zp
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
    """How in-memory state-dict keys become checkpoint keys.

    Attributes:
        skip: keys not written: tied copies (``lm_head.weight`` tied to the embeddings) and
            ``_keys_to_ignore_on_save``.
        revert: transformers' ``revert_weight_conversion`` bound to the model (fused MoE experts back to
            per-expert tensors, renamed prefixes back to the original names), or None.
    """

    skip: frozenset[str] = frozenset()
    revert: Revert | None = None

    @classmethod
    def from_model(cls, model: torch.nn.Module, quantized: Iterable[str] = ()) -> ModelLayout:
        """Read tied weights and weight conversions from a transformers model.

        Args:
            model: the model (any ``nn.Module``; transformers conventions apply to ``PreTrainedModel``).
            quantized: names of the quantized modules (a tied quantized weight is an error).

        Returns:
            The layout.

        Example:
            >>> layout = ModelLayout.from_model(model, state.quantized)  # doctest: +SKIP
        """
        skip = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
        quantized = set(quantized)
        for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
            t, s = _tensor_or_none(model, target), _tensor_or_none(model, source)
            if t is None or s is None:
                continue
            if not _same_tensor(t, s):
                raise ValueError(
                    f"save: the config ties {target} to {source} but they are different tensors, so a reload "
                    "would overwrite one with the other; set model.config.tie_word_embeddings = False"
                )
            if target.rpartition(".")[0] in quantized or source.rpartition(".")[0] in quantized:
                raise ValueError(
                    f"save: {target} is tied to {source} and was quantized, which also changed the tied "
                    "weight; add the module to `ignore`, or untie the weights before quantizing"
                )
            skip.add(target)
        revert = None
        if hasattr(model, "config") and hasattr(model, "all_tied_weights_keys"):  # a PreTrainedModel
            from transformers.core_model_loading import revert_weight_conversion

            revert = partial(revert_weight_conversion, model)
        return cls(frozenset(skip), revert)

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


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    if a is b:
        return True
    on_meta = a.device.type == "meta" or b.device.type == "meta"
    return not on_meta and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def module_tensors(name: str, module: torch.nn.Module, quantized: QuantizedWeight | None) -> dict[str, Tensor]:
    """The module's own state-dict entries (no children), its weight replaced by the compressed tensors."""
    local: dict[str, Any] = {}
    module._save_to_state_dict(local, "", keep_vars=True)  # honours persistent buffers and overrides
    if quantized is not None:
        weight = local.pop("weight", None)
        if not isinstance(weight, Tensor):
            raise ValueError(f"save: module {name!r} is in state.quantized but has no weight")
        if weight.device.type != "meta":
            _check_fake_quantized(name, weight, quantized)
        local.update(compressed_tensors_for(name, quantized, tuple(weight.shape)))
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
        >>> writer = CheckpointWriter("out", layout=ModelLayout.from_model(model))  # doctest: +SKIP
        >>> for name, module in model.named_modules():  # e.g. as each subgraph finishes
        ...     writer.add_module(name, module, state.quantized.get(name))
        >>> writer.close(config_dict)
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
            raise ValueError(f"CheckpointWriter: max_shard_size must be a positive int (bytes), got {max_shard_size!r}")
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
        tensors = {k: v for k, v in module_tensors(name, module, quantized).items() if k not in self.layout.skip}
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
            raise ValueError(f"CheckpointWriter: {name!r} is on the meta device (offloaded); onload it before adding")
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
        for stale in path.glob("model*.safetensors*"):  # old shards, index and partial files
            stale.unlink()
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
        raise ValueError("quantization_config: state.quantized is empty; save an unquantized model with save_pretrained")
    schemes, index = _groups(state)
    groups = {}
    for i, scheme in enumerate(schemes):
        group = scheme.model_copy(deep=True)
        group.format = weight_format(scheme)
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


def _checked_config(model: torch.nn.Module, state: RunState, layout: ModelLayout) -> dict:
    """The quantization_config whose targets and ignore give exactly ``state.quantized`` on load."""
    for name in state.quantized:
        if not isinstance(model.get_submodule(name), torch.nn.Linear):
            raise ValueError(f"save: state.quantized names {name!r}, which is not a Linear of this model")
    targets = [t for qw in state.quantized.values() for t in qw.scheme.targets]
    ignore = [
        alias
        for name, module in model.named_modules()
        if name not in state.quantized
        and (isinstance(module, torch.nn.Linear) or (isinstance(module, torch.nn.Embedding) and is_match(name, module, targets)))
        for alias in layout.checkpoint_names(name)
    ]
    _, index = _groups(state)
    expected = {name: f"group_{i}" for name, i in index.items()}
    block = quantization_config(state, ignore)
    if _assignment(model, block) != expected:  # overlapping targets resolve differently in compressed-tensors
        block = quantization_config(state, ignore, exact_targets=True)
        for group in block["config_groups"].values():
            group["targets"] = [a for n in group["targets"] for a in layout.checkpoint_names(n)]
    return block


def _config_dict(model: torch.nn.Module, block: dict) -> dict:
    """``config.json`` as save_pretrained writes it (diff against defaults), plus the quantization block."""
    config = copy.deepcopy(model.config)  # the model's own config stays untouched
    config.dtype = str(getattr(model, "dtype", torch.float32)).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    data = json.loads(config.to_json_string(use_diff=True))
    data["quantization_config"] = block
    return data


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

    Modules are written one at a time (shards flushed as they fill); the model's Linear weights must be
    the fake-quantized values of ``state.quantized`` (checked exactly). Also writes the tokenizer,
    ``recipe.yaml`` and ``generation_config.json`` when given/present, and ``config.json`` last.

    Args:
        model: the calibrated transformers model (weights onloaded: not on the meta device).
        state: the run's state; ``state.quantized`` maps module names to compressed weights.
        output_dir: checkpoint directory; must be empty or absent unless ``overwrite``.
        tokenizer: saved with ``tokenizer.save_pretrained`` when given.
        recipe_yaml: written to ``recipe.yaml`` when given.
        max_shard_size: bytes per safetensors shard.
        overwrite: allow a non-empty ``output_dir``.

    Returns:
        The output directory.

    Example:
        >>> save_checkpoint(model, state, "llama-w4a16", tokenizer=tok)  # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained("llama-w4a16")  # doctest: +SKIP
    """
    layout = ModelLayout.from_model(model, state.quantized)
    config = _config_dict(model, _checked_config(model, state, layout))
    writer = CheckpointWriter(output_dir, max_shard_size, overwrite=overwrite, layout=layout)
    try:
        for name, module in model.named_modules():
            writer.add_module(name, module, state.quantized.get(name))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(writer.output_dir))
        if recipe_yaml is not None:
            (writer.output_dir / "recipe.yaml").write_text(recipe_yaml, encoding="utf-8")
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None and getattr(model, "can_generate", lambda: False)():
            with warnings.catch_warnings():  # transformers warns about unusual but valid generation settings
                warnings.simplefilter("ignore")
                generation_config.save_pretrained(str(writer.output_dir))
        return writer.close(config)
    except BaseException:
        writer.abort()
        raise


__all__ = [
    "CheckpointWriter",
    "ModelLayout",
    "compressed_tensors_for",
    "module_tensors",
    "quantization_config",
    "save_checkpoint",
    "weight_format",
]
