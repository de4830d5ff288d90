"""Model-free quantization: data-free schemes from safetensors shards straight to a compressed-tensors checkpoint.

For checkpoints too large to load (100 GB to 1.6 TB) and architectures transformers does not have yet: no model is
built, no forward runs. Each source file becomes the output file of the same name, in its own worker process,
weights quantized one at a time (round to nearest: W4A16, W8A16, FP8_DYNAMIC, FP8_BLOCK, NVFP4A16, MXFP4A16).
``model_free_ptq`` reads as the stages:

    ModelFreeArgs(...)                the keywords, checked; .modifier(): the recipe's QuantizationModifier
    SourceCheckpoint.open(model)      index and headers: missing shards refused before anything is written; an
                                      FP8 source seen as the full-precision checkpoint its weights make
    build_skeleton(source)            the modules on meta (transformers' model, else from the tensor names)
    plan_jobs(source, skeleton, mod)  targets / ignore resolved as a recipe's; one job per source file
    checkpoint_json(...)              config.json's content, computed before any weight is read
    workers_for(...)                  processes that fit max_host_memory, or a refusal naming the budget that does
    prepare_output(...)               a non-empty output refused; resume: the files a killed run finished are kept
    run_jobs(...)                     quantize and write each remaining file
    finish(...)                       the index, the source's other files, config.json last

On a model transformers has, the checkpoint is byte for byte the one ``oneshot(..., pipeline="datafree")`` writes
with the same scheme (a one-file model: the same file; several: the same tensors, in the source's files).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from seqcal.modelfree.args import ModelFreeArgs
from seqcal.modelfree.finish import checkpoint_json, finish
from seqcal.modelfree.keep import keep_source_form
from seqcal.modelfree.memory import job_peak, workers_for, working_factor
from seqcal.modelfree.plan import Plan, plan_jobs
from seqcal.modelfree.progress import prepare_output, run_identity
from seqcal.modelfree.rows import rows_per_chunk
from seqcal.modelfree.run import run_jobs
from seqcal.modelfree.skeleton import build_skeleton
from seqcal.modelfree.source import SourceCheckpoint
from seqcal.modelfree.worker import peak_rss
from seqcal.run_args import ModelArgs
from seqcal.sources.policy import check_source

logger = logging.getLogger("seqcal")

__all__ = ["ModelFreeArgs", "model_free_ptq"]


def model_free_ptq(
    model_stub: str | os.PathLike,
    save_directory: str | os.PathLike,
    scheme: Any = None,
    config: Any = None,
    ignore: Sequence[str] = (),
    max_workers: int = 1,
    device: str | None = None,
    converter: Any = None,
    *,
    targets: Sequence[str] = ("Linear",),
    max_host_memory: int | str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    requantize: bool = False,
    keep_source_format: bool = False,
) -> Path:
    """Quantize a safetensors checkpoint without loading the model (llm-compressor 0.14's keywords).

    Args:
        model_stub: the source checkpoint directory (or a Hub id already downloaded).
        save_directory: where the compressed-tensors checkpoint goes (absent or empty).
        scheme: a preset ("W4A16", "W8A16", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16") or a
            QuantizationScheme.
        config: a QuantizationConfig (several groups) instead of ``scheme``.
        ignore: modules left in full precision, e.g. ["lm_head", "re:.*mlp.gate$"].
        max_workers: worker processes (one source file each at a time).
        device: where weights are quantized (default the cpu).
        converter: llm-compressor's dequantizing converter: not supported (refused).
        targets: what ``scheme`` applies to (class names or ``re:`` patterns), as in a recipe.
        max_host_memory: resident memory of all processes to stay under ("64GB").
        resume: continue a killed run in ``save_directory``.
        overwrite: replace what ``save_directory`` holds.
        trust_remote_code: let transformers build the checkpoint's own class (only to read its modules).
        requantize: quantize an FP8 source (DeepSeek's blocks) to 8 bits again; lower widths (NVFP4, W4A16)
            need no flag.
        keep_source_format: an FP8 source's Linears the scheme leaves alone (ignored or not targeted) are written
            in their stored FP8 form (float8 weight, float32 scales), as ``oneshot`` writes them with the same
            flag, instead of dequantized.

    Returns:
        ``save_directory``.

    Example:
        >>> model_free_ptq("Qwen3-235B-A22B", "qwen3-w4a16", scheme="W4A16", ignore=["lm_head"],
        ...                max_workers=8, max_host_memory="64GB")  # doctest: +SKIP
    """
    if converter is not None:
        raise ValueError(
            "model_free_ptq: converter= is llm-compressor's; seqcal runs no converters, pass converter=None"
        )
    args = ModelFreeArgs(
        model_stub, save_directory, scheme, config, targets, ignore, max_workers, max_host_memory, device,
        resume, overwrite, trust_remote_code, requantize, keep_source_format,
    )  # fmt: skip
    modifier = args.modifier()
    source = SourceCheckpoint.open(_local(args.model_stub))
    # a quantized source: refused at or below the scheme's bits without requantize, and recorded in config.json
    report = check_source(ModelArgs(str(source.path)), [modifier], args.requantize)
    skeleton = build_skeleton(source, args.trust_remote_code)
    plan = plan_jobs(source, skeleton, modifier)
    if args.keep_source_format:
        plan = keep_source_form(plan, source, skeleton)
    config_json = checkpoint_json(skeleton, source, plan.modules, report)
    workers = workers_for(args.host_budget, args.max_workers, _peaks(plan, source), peak_rss())
    done = prepare_output(args.save_directory, run_identity(source, config_json["quantization_config"]),
                          overwrite=args.overwrite, resume=args.resume)  # fmt: skip
    todo = [job for job in plan.jobs if job.file not in done]
    logger.info("seqcal: model-free: %d of %d files to write, %d module(s) quantized, %d worker(s)%s", len(todo),
                len(plan.jobs), len(plan.modules), workers, "" if skeleton.known else " (modules from tensor names)")  # fmt: skip
    results = run_jobs(
        todo, str(source.path), str(args.save_directory), workers=workers, device=args.device or "cpu"
    )
    if results:
        logger.info("seqcal: model-free: peak resident memory: %.2f GiB here, %.2f GiB in the largest worker",
                    peak_rss() / 2**30, max(r.peak_rss for r in results) / 2**30)  # fmt: skip
    return finish(args.save_directory, source, [job.file for job in plan.jobs], config_json)


def _local(model: str | os.PathLike) -> Path:
    """A directory as it is; a Hub id as its local snapshot (no download when offline)."""
    if Path(model).is_dir():
        return Path(model)
    from seqcal.models import resolve_model

    return Path(resolve_model(str(model)))


def _peaks(plan: Plan, source: SourceCheckpoint) -> list[int]:
    """Each job's peak resident memory in a worker (``memory.job_peak``)."""
    peaks = []
    for job in plan.jobs:
        weights = []
        for unit in job.units:
            if unit.quantize is not None and unit.quantize.keep:  # its fp8 bytes and scales, no rounding
                info = source.info[unit.quantize.key]
                weights.append((0, info.shape[0] * info.shape[1], 0.0, 0))
            elif unit.quantize is not None:
                info = source.info[unit.quantize.key]
                numel = info.shape[0] * info.shape[1]
                scheme = unit.quantize.scheme
                chunk = rows_per_chunk(info.shape, scheme) * info.shape[1]
                weights.append((info.nbytes, numel, working_factor(scheme), chunk))
        peaks.append(job_peak(weights))
    return peaks
