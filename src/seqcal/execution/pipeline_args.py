"""How calibration runs: ``PipelineArgs``, the pipeline's typed arguments, checked when built.

Example:
    >>> PipelineArgs(offload="disk", one_pass=False).pipeline
    'sequential'
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from seqcal.distributed.shards import DEFAULT_SHARDS
from seqcal.execution.cache.store import STORE_DTYPES, tier_device
from seqcal.tracing.leaves import normalize_trace_into

PIPELINES = ("sequential", "datafree", "basic")


@dataclass
class PipelineArgs:
    """How calibration runs."""

    pipeline: str = "sequential"
    sequential_targets: list[str] | None = None
    tracing_ignore: list[str] = field(default_factory=list)
    targets_per_subgraph: int = 1
    offload: str = "cpu"  # activation cache tier: "cpu", "disk", "device" or an accelerator's name ("cuda:1")
    offload_dir: str | None = None
    compute_dtype: str | None = (
        None  # "bfloat16"/"float16": autocast forward passes; weights keep their dtype
    )
    # Cut subgraphs before the quantized modules when every modifier needs only their inputs (GPTQ, RTN):
    # each module calibrates on inputs computed with all earlier modules quantized, and every subgraph runs
    # once. False (or explicit sequential_targets): cut after each layer, a calibration and a propagation
    # pass per layer, as llm-compressor does.
    one_pass: bool = True
    # RAM budget (bytes) of the cpu activation cache; what does not fit goes to disk. Lossless, so it is left
    # out of repr(), which fingerprints a run: a resume after running out of memory may add or change it.
    cache_max_memory: int | None = field(default=None, repr=False)
    cache_dtype: str | None = None  # "bfloat16"/"float16": store fp32 activations narrower (lossy)
    # A model given in RAM on the cpu: stage its weights through the execution device one subgraph at a time,
    # as for a model read from disk. None: when CUDA is available (the model's weights stay in RAM, each
    # subgraph runs on the GPU). Same results either way, so it is left out of the run's fingerprint.
    stage_weights: bool | None = field(default=None, repr=False)
    # Modules to trace into ("all" or class names / re: patterns; see seqcal.tracing.trace). The same cuts and
    # results either way, so it is left out of the run's fingerprint.
    trace_into: str | list[str] | None = field(default=None, repr=False)
    # Check the partition against the model's own forward on a second, differently shaped batch before
    # calibrating (seqcal.execution.verify). A check, not a setting of the result: left out of the fingerprint.
    verify: bool = field(default=True, repr=False)
    # Device memory (bytes) the run may use; GPTQ sizes its stacked solves from it. The results do not depend
    # on it (solves are split by rows), so it is left out of the fingerprint.
    max_device_memory: int | None = field(default=None, repr=False)
    # GPTQ factors each Hessian in its own memory on the cpu (no second [in, in] matrix), as a host budget may
    # need (plan.host.fit_host). Equal to LAPACK's up to float32 rounding; not fingerprinted: the progress
    # record keeps it, and a resume keeps the interrupted run's (checkpoint.resume_files.recorded_choices).
    in_place_factor: bool = field(default=False, repr=False)
    # The checkpoint's files written on a worker thread (None: streaming.BACKGROUND) or, as a host budget may
    # need, before the next subgraph starts (False). The same files: not fingerprinted.
    background_save: bool | None = field(default=None, repr=False)
    # Virtual shards of the calibration batches (seqcal.distributed): statistics are accumulated per shard
    # and folded in shard order, the same with one process or many. Part of the result, so fingerprinted.
    num_shards: int = DEFAULT_SHARDS

    def __post_init__(self) -> None:
        normalize_trace_into(self.trace_into)  # a ValueError that lists what is valid
        for name in ("one_pass", "verify"):  # a string such as "false" would be truthy and silently mean True
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline={self.pipeline!r} is not one of {PIPELINES}")
        if self.compute_dtype not in (None, "bfloat16", "float16"):
            raise ValueError(
                f"compute_dtype={self.compute_dtype!r} is not one of (None, 'bfloat16', 'float16')"
            )
        if isinstance(self.offload, torch.device):  # llm-compressor's sequential_offload_device takes one
            self.offload = str(self.offload)
        tier_device(self.offload, "cpu")  # raises for a name that is no tier
        if self.cache_dtype not in (None, *STORE_DTYPES):
            raise ValueError(
                f"cache_dtype={self.cache_dtype!r} is not one of {(None, *STORE_DTYPES)}; it stores the "
                "cached activations in that dtype (lossy), None stores them exactly"
            )
        budget = self.cache_max_memory
        if budget is not None and (self.offload != "cpu" or not isinstance(budget, int) or budget < 0):
            raise ValueError(
                f"cache_max_memory={budget!r} needs offload='cpu' (got {self.offload!r}) and an int number "
                "of bytes >= 0 (oneshot also takes '4GB'); offload='disk' keeps no activation in RAM already"
            )
