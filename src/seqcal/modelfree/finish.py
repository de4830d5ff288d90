"""The files of a model-free checkpoint besides its weights: ``config.json`` (last), the index, and the source's
other files (tokenizer, generation config, chat template) copied as they are.

``config.json`` is ``oneshot``'s: ``checkpoint_config`` on transformers' model when it knows the architecture
(the config as ``save_pretrained`` writes it, ``quantization_config`` with every unquantized Linear and MoE router
in ``ignore``); for a tree built from names, the source's config.json with the same ``quantization_config`` block.

Example:
    >>> config = checkpoint_json(skeleton, source, plan.modules)  # doctest: +SKIP
    >>> finish("out", source, results, config)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationScheme

from seqcal.checkpoint.config import _checked_block, checkpoint_config
from seqcal.checkpoint.writer import CONFIG_NAME, INDEX_NAME, PROGRESS_NAME, _write_json
from seqcal.modelfree.skeleton import Skeleton
from seqcal.modelfree.source import SourceCheckpoint, TensorInfo, read_header
from seqcal.modifiers.state import RunState
from seqcal.records import QuantizedWeight

logger = logging.getLogger("seqcal")

# Files of the source that are not copied: its weights (written anew) and weights in formats model-free does not read
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5")


def checkpoint_json(
    skeleton: Skeleton,
    source: SourceCheckpoint,
    modules: dict[str, QuantizationScheme],
    report: dict[str, Any],
) -> dict:
    """``config.json``'s content for the quantized ``modules`` (name -> scheme, in the model's order); ``report``:
    what ``seqcal.sources.policy.check_source`` says of a quantized source (its ``source_format``), or {}."""
    state = RunState()
    state.results.report.update(report)
    for name, scheme in modules.items():  # only the schemes are read: the records hold no codes
        state.results.quantized[name] = QuantizedWeight(
            q=torch.empty(0, device="meta"), scale=torch.empty(0, device="meta"), zero_point=None, g_idx=None,
            scheme=scheme,
        )  # fmt: skip
    if skeleton.known:
        return checkpoint_config(skeleton.model, state, skeleton.layout)
    data = dict(source.config)
    data["quantization_config"] = _checked_block(skeleton.model, state, skeleton.layout)
    if "source_format" in report:  # as checkpoint_config records it
        data["quantization_config"]["source_format"] = report["source_format"]
    return data


def finish(
    output_dir: str | Path, source: SourceCheckpoint, files: Sequence[str], config: dict[str, Any]
) -> Path:
    """Write the index (several files), copy the source's other files, then ``config.json``; the progress
    record goes last.

    Args:
        output_dir: the output directory, every one of ``files`` written (by this run or a killed one).
        source: the source checkpoint.
        files: the output files.
        config: ``config.json``'s content.

    Returns:
        The output directory.
    """
    out = Path(output_dir)
    if len(files) > 1:  # the keys and sizes from the headers: a resumed run did not write every file itself
        weight_map, total = {}, 0
        for file in files:
            header = read_header(out / file)
            weight_map.update(dict.fromkeys(header, file))
            total += sum(TensorInfo(file, dtype, shape).nbytes for dtype, shape in header.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out / INDEX_NAME, index)
    for path in sorted(source.path.iterdir()):
        if path.name in (CONFIG_NAME, INDEX_NAME) or path.name.endswith(_WEIGHT_SUFFIXES):
            continue
        if path.is_file():
            shutil.copyfile(path, out / path.name)
        else:
            logger.info("seqcal: model-free: %s is a folder, not copied", path)
    _write_json(out / CONFIG_NAME, config)  # last: its presence means finished
    (out / PROGRESS_NAME).unlink(missing_ok=True)
    return out
