"""``oneshot``'s configuration: every keyword, typed and checked once, before any work.

``OneshotArgs`` holds the call's arguments with llm-compressor's keywords already translated into seqcal's
(``seqcal.recipe.llmc_compat``); ``ModelArgs``, ``OutputArgs`` (here), ``PipelineArgs`` and ``DataArgs`` are the views
each stage takes of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from seqcal.distributed import DEFAULT_SHARDS
from seqcal.recipe.llmc_compat import needs_translation, translate

OUTPUT_FORMATS = ("compressed-tensors", "gguf")
DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelArgs:
    """Which model, in which dtype. ``model`` is a directory, 'default', a Hub id or a loaded PreTrainedModel.

    ``tokenizer`` is a tokenizer/processor object, or a directory or Hub id to load it from (None: the model's).
    ``revision`` picks the branch, tag or commit of a Hub id.
    """

    model: Any
    tokenizer: Any = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    revision: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {sorted(DTYPES)}")
        if not isinstance(self.model, (str, Path, torch.nn.Module)):
            raise TypeError(
                f"model must be a directory, 'default', a Hub id or a PreTrainedModel, got {type(self.model)}"
            )


@dataclass
class OutputArgs:
    """Where the checkpoint goes, and in which format: "compressed-tensors" (safetensors) or "gguf" (llama.cpp)."""

    output_dir: str | None = None
    overwrite: bool = False
    resume: bool = False
    output_format: str = "compressed-tensors"

    def __post_init__(self) -> None:
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(
                f"output_format={self.output_format!r} is not one of {', '.join(OUTPUT_FORMATS)}"
            )
        if self.output_format == "gguf" and (self.output_dir is None or self.resume):
            raise ValueError("output_format='gguf' writes output_dir/model.gguf in one run: give output_dir, and "
                             "start an interrupted run again instead of resume=True")  # fmt: skip
        if self.resume and self.output_dir is None:
            raise ValueError("resume=True needs the output_dir of the interrupted run")
        if self.resume and self.overwrite:
            raise ValueError(
                "resume=True continues the run in output_dir; it cannot be combined with overwrite"
            )

    def stream_class(self) -> type:
        """The writer of this format that streams modules as subgraphs finish (``StreamingCheckpoint``'s arguments)."""
        if self.output_format == "gguf":
            from seqcal.gguf.stream import GGUFStream

            return GGUFStream
        from seqcal.checkpoint.streaming import StreamingCheckpoint

        return StreamingCheckpoint


@dataclass(frozen=True)
class OneshotArgs:
    """Every keyword of ``seqcal.oneshot``, by the same name and default (its docstring says what each does)."""

    model: Any
    dataset: Any = None
    recipe: Any = None
    output_dir: str | None = None
    num_calibration_samples: int = 512
    max_seq_length: int = 2048
    batch_size: int | str | None = None
    shuffle_calibration_samples: bool = True
    text_column: str = "text"
    splits: Any = None
    dataset_config_name: str | None = None
    seed: int = 42
    concatenate: bool = False
    sequential_targets: list[str] | None = None
    tracing_ignore: list[str] | None = None
    pipeline: str = "sequential"
    tokenizer: Any = None
    dtype: str = "auto"
    compute_dtype: str | None = None
    offload: str = "cpu"
    offload_dir: str | None = None
    overwrite: bool = False
    resume: bool = False
    dry_run: bool = False
    max_device_memory: int | str | None = None
    max_host_memory: int | str | None = None
    trust_remote_code: bool = False
    profile: str | None = None
    one_pass: bool = True
    cache_max_memory: int | str | None = None
    cache_dtype: str | None = None
    model_revision: str | None = None
    trace_into: str | list[str] | None = None
    verify: bool = True
    moe_calibrate_all_experts: bool = True
    num_shards: int = DEFAULT_SHARDS
    data_collator: Any = None
    preprocessing_func: Any = None
    requantize: bool = False
    keep_source_format: bool = False
    output_format: str = "compressed-tensors"

    @classmethod
    def from_call(cls, bound: dict[str, Any], unknown: dict[str, Any]) -> OneshotArgs:
        """The arguments of one ``oneshot`` call; llm-compressor's keywords and values become seqcal's here.

        Raises:
            TypeError: a keyword neither seqcal nor llm-compressor knows (the message names it).
        """
        defaults = {f.name: f.default for f in fields(cls) if f.default is not MISSING}
        call = {**defaults, **bound, "unknown": unknown}
        if needs_translation(call):
            return cls(**translate(cls, call))
        return cls(**{**defaults, **bound})

    def model_args(self) -> ModelArgs:
        return ModelArgs(self.model, self.tokenizer, self.dtype, self.trust_remote_code, self.model_revision)

    def planned_samples(self) -> int:
        """The calibration samples the plan sizes the run for: ``num_calibration_samples``, or fewer when the
        dataset is rows in memory (a list, a ``datasets.Dataset``) that has fewer; a file or a Hub name is counted
        when read, and no rows (``dataset=[]``, what ``seqcal plan`` passes) plans for ``num_calibration_samples``.
        A DatasetDict (a Mapping of splits) or a DataLoader (its length counts batches) is not counted here."""
        rows = self.dataset
        counted = isinstance(rows, (list, tuple)) or (
            hasattr(rows, "column_names") and not isinstance(rows, Mapping)
        )
        return (
            min(self.num_calibration_samples, len(rows))
            if counted and len(rows)
            else self.num_calibration_samples
        )

    def output_args(self) -> OutputArgs:
        return OutputArgs(self.output_dir, self.overwrite, self.resume, self.output_format)


def parse_bytes(value: int | str | None, name: str = "max_device_memory") -> int | None:
    """``8GB``, ``512MiB``, ``1e9`` or an int -> bytes; `name` is the argument named in the error."""
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip().upper().replace(" ", "")
    units = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1}
    unit = next((u for u in units if text.endswith(u)), "")
    try:
        return int(float(text[: len(text) - len(unit)]) * units.get(unit, 1))
    except ValueError:
        raise ValueError(f"{name}={value!r}: give bytes or a size such as '8GB' or '512MiB'") from None
