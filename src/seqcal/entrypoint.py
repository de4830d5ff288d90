"""``oneshot``: load -> trace -> partition -> calibrate -> save, as one readable pipeline."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from seqcal.backend.host import onednn_cache_limited
from seqcal.backend.threads import hint_threads
from seqcal.checkpoint.identity import run_identity
from seqcal.checkpoint.preflight import check_environment, check_output_dir
from seqcal.data.autobatch import default_batch_size, with_auto_limits
from seqcal.data.batches import DataArgs, load_calibration_batches
from seqcal.data.checks import check_data_for_model
from seqcal.distributed import DEFAULT_SHARDS, launched, process_group, rank_path
from seqcal.distributed.group import merge_rank_profiles
from seqcal.execution.pipeline import OutputPlan, PipelineArgs, run_pipeline
from seqcal.experts import linearize_experts
from seqcal.gguf.preflight import check_gguf_output
from seqcal.loading import load_model
from seqcal.modifiers.keep_source import KeepSourceFormatModifier
from seqcal.modifiers.state import RunState
from seqcal.multimodal.inputs import MediaArgs
from seqcal.multimodal.processor import processor_source, split_processor
from seqcal.multimodal.run import finish_media, prepare_media
from seqcal.plan import make_plan
from seqcal.plan.host import (
    HostFit,
    check_budget,
    fit_host,
    host_report,
    keep_recorded_choices,
    total_ram,
)
from seqcal.recipe.parse import parse_recipe
from seqcal.report.profile import Profiler
from seqcal.run_args import ModelArgs, OneshotArgs, parse_bytes
from seqcal.sources.policy import check_source

__all__ = ["load_model", "oneshot", "run_oneshot"]  # load_model lives in seqcal.loading

logger = logging.getLogger("seqcal")


# oneDNN's caches capped before the run's first bf16 matmul, os.environ as it was on return (backend.host)
@onednn_cache_limited()
def oneshot(
    model: Any,
    dataset: Any = None,
    recipe: Any = None,
    output_dir: str | None = None,
    num_calibration_samples: int = 512,
    max_seq_length: int = 2048,
    batch_size: int | str | None = None,
    shuffle_calibration_samples: bool = True,
    text_column: str = "text",
    splits: Any = None,
    dataset_config_name: str | None = None,
    seed: int = 42,
    concatenate: bool = False,
    sequential_targets: list[str] | None = None,
    tracing_ignore: list[str] | None = None,
    pipeline: str = "sequential",
    tokenizer: Any = None,
    dtype: str = "auto",
    compute_dtype: str | None = None,
    offload: str = "cpu",
    offload_dir: str | None = None,
    overwrite: bool = False,
    resume: bool = False,
    dry_run: bool = False,
    max_device_memory: int | str | None = None,
    max_host_memory: int | str | None = None,
    trust_remote_code: bool = False,
    profile: str | None = None,
    one_pass: bool = True,
    cache_max_memory: int | str | None = None,
    cache_dtype: str | None = None,
    model_revision: str | None = None,
    trace_into: str | list[str] | None = None,
    verify: bool = True,
    moe_calibrate_all_experts: bool = True,
    num_shards: int = DEFAULT_SHARDS,
    data_collator: Any = None,
    preprocessing_func: Any = None,
    requantize: bool = False,
    keep_source_format: bool = False,
    output_format: str = "compressed-tensors",
    **unknown: Any,
) -> torch.nn.Module:
    """Quantize ``model`` with ``recipe`` on ``dataset`` and save a compressed-tensors checkpoint.

    Keyword names follow llm-compressor's ``oneshot``; its other keywords are translated by
    ``seqcal.recipe.llmc_compat`` (aliases such as ``concatenate_data``, no-ops logged with the reason, or an error
    that names the keyword and what to use instead).

    Args:
        model: a model directory, 'default' (SmolLM2-135M-Instruct, offline), a Hugging Face Hub id
            (downloaded as transformers does; read from the Hub cache with HF_HUB_OFFLINE=1) or a PreTrainedModel.
        dataset: calibration data (text/jsonl/json/csv/parquet file, list of strings, Dataset, ...).
        recipe: a YAML file or string, a Modifier, or a list of them.
        output_dir: where to write the checkpoint. With it, a model given as a directory is calibrated with
            its weights read from disk per subgraph (memory bound) and the returned model's parameters stay
            on meta: the result is the checkpoint. None: the model is loaded whole into RAM (logged) and
            the returned model holds the quantized weights; nothing is written.
        num_calibration_samples: samples (with ``concatenate``: windows) to use, taken after shuffling.
        max_seq_length: tokens per sample at most (with ``concatenate``: exactly).
        batch_size: samples per batch, each batch padded to its longest sample; ``"auto"`` groups samples of
            about equal length, as many per batch as the memory budget allows (``seqcal.data.autobatch``).
            None (the default) is ``"auto"`` when CUDA is present and 1 on the CPU
            (``seqcal.data.autobatch.default_batch_size``).
        shuffle_calibration_samples: shuffle the rows with ``seed`` before selecting them.
        text_column: the column holding the text in row-shaped data (JSON, CSV, Parquet, datasets).
        splits: the dataset split to use: ``"train"``, ``"train[:512]"``, ``"validation[:10%]"`` or
            ``{"calibration": "train"}``; None picks "calibration", then "train", then the only split.
        dataset_config_name: the dataset's configuration, e.g. ``"wikitext-2-raw-v1"``.
        seed: the shuffling seed.
        concatenate: join the texts and cut full windows of ``max_seq_length`` tokens (short texts such as
            paragraphs then fill whole samples) instead of one sample per text.
        sequential_targets: layer classes calibrated one at a time (default: inferred).
        tracing_ignore: functions/methods always run opaquely while tracing.
        pipeline: "sequential" (default), "datafree" (no data, round-to-nearest only) or "basic".
        dtype: weight dtype when loading from a directory ("auto" keeps the checkpoint's).
        compute_dtype: "bfloat16" runs the forward passes under autocast (matmuls in bf16, weights,
            norms and Hessians in fp32), the CPU/GPU fast path; None computes in the weights' dtype.
        offload: activation cache tier: "cpu" (RAM), "disk" (files), "device" (the execution device's memory:
            nothing crosses PCIe; for a GPU with room for every cached value, see the memory plan) or an
            accelerator's name such as "cuda:1" (llm-compressor's ``sequential_offload_device``).
        overwrite: replace a non-empty output_dir.
        resume: continue an interrupted run in output_dir (same arguments); finished subgraphs are
            replayed from their saved weights, and the checkpoint equals an uninterrupted run's.
        dry_run: read no weight and calibrate nothing: return the MemoryPlan (device/host/disk per subgraph).
        max_device_memory: bytes or "8GB": picks the cut from the memory plan and sizes GPTQ's stacked solves
            (modules sharing a Hessian, such as a layer's experts, solved in chunks that fit; same result).
            A layer whose subgraph would not fit is cut at its children (attention, MLP; logged); the
            one-pass cut is already per module group, so there a subgraph that would not fit is only
            reported in a warning with the fix (smaller batch_size or max_seq_length).
        max_host_memory: bytes or "12GB": the process's resident memory to stay under. The memory plan picks
            the activation cache's RAM (the rest spilled to disk, as cache_max_memory) and, when the one-pass cut
            cannot fit, the layer cut; each choice is logged. A budget no choice keeps is refused before any
            weight is read, naming the smallest that works. quantization_report.json holds the predicted and
            the measured peak ("host_memory").
        one_pass: when every modifier needs only its modules' inputs (GPTQ, round to nearest), cut the
            graph before each group of modules that read one input and run every subgraph once: each module
            is calibrated on inputs computed with all earlier modules already quantized. False (and an
            explicit ``sequential_targets``) cuts after each layer with a calibration and a propagation
            pass per layer, as llm-compressor does.
        profile: write a Chrome trace (chrome://tracing, ui.perfetto.dev) of where time and memory went
            to this JSON file; ``seqcal.report.Profiler.load(profile).summary(report)`` tabulates it.
        cache_max_memory: bytes or "4GB": RAM budget of the activation cache (offload="cpu"); what does
            not fit is written to safetensors files in a temporary folder (under offload_dir if given).
        cache_dtype: "bfloat16" or "float16" stores float32 activations in that dtype (half the cache,
            lossy); None stores them exactly.
        model_revision: branch, tag or commit of a Hub model id (None: "main").
        trace_into: "all" or class names / ``re:`` patterns of modules to trace into (the full graph:
            attention and MLP operations as nodes, torch.nn modules such as Linear stay nodes); the same
            subgraph cuts and checkpoint as without it.
        verify: before calibrating, run the partition and the model's own forward on a second batch shaped
            unlike the calibration batch (another size and length, left padding) and compare their outputs.
            A one-pass cut that differs falls back to the layer cut, a layer cut that differs to layer-by-layer
            capture when the layers form a chain, else the run stops with where they differ. False skips it.
        moe_calibrate_all_experts: mixture-of-experts models: during calibration every routed expert sees
            every token of its layer (its Hessian is not starved by the router), while the layer's output
            keeps the real routing. False: each expert sees only the tokens routed to it; one that gets none
            is quantized round-to-nearest (the log and report list it).
        data_collator: for rows mapped through a processor (images, audio): a function of a list of rows
            giving one batch (llm-compressor's route; ``seqcal.multimodal.inputs``). Every input a batch holds
            reaches the model's forward.
        preprocessing_func: a function applied to each row first (llm-compressor's route).
        requantize: quantize a quantized checkpoint (``seqcal.sources``: FP8, MXFP4, compressed-tensors, AWQ,
            GPTQ) to as many bits as it has or more; refused without it, since the two roundings' errors compound.
        keep_source_format: an FP8 checkpoint's Linears the recipe leaves alone are written in their FP8 form
            (weights and scales byte for byte) instead of dequantized (``KeepSourceFormatModifier``).
        output_format: "compressed-tensors" (default) or "gguf": ``output_dir/model.gguf`` for llama.cpp, from GGUF
            schemes (``scheme: Q4_K_M``, ``Q4_0``, ...; ``seqcal.gguf``), each tensor checked against seqcal's weights.
        num_shards: virtual shards of the calibration batches. Statistics are accumulated per shard and
            folded in shard order, so the checkpoint is the same for one process and for any number of
            processes (``torchrun``, or a ``torch.distributed`` group the caller started; seqcal.distributed).

    Returns:
        The quantized model (fake-quantized weights, no hooks left); for a directory with ``output_dir``,
        its skeleton with parameters on meta (load the checkpoint instead). With ``dry_run``, the MemoryPlan.

    Example:
        >>> oneshot(model="default", dataset="default", recipe="recipes/gptq_w4a16_g64.yaml",
        ...         output_dir="out", num_calibration_samples=64, max_seq_length=512)  # doctest: +SKIP
    """
    args = OneshotArgs.from_call({k: v for k, v in locals().items() if k != "unknown"}, unknown)
    with launched():  # under torchrun: the process group for this call (none otherwise)
        return run_oneshot(args)


def run_oneshot(args: OneshotArgs) -> Any:
    """``oneshot``'s stages on its typed arguments: load, plan, data, calibrate, save."""
    group = process_group()
    hint_threads()  # torch's threads against the cores other processes leave free: how to set them
    host_budget = check_budget(parse_bytes(args.max_host_memory, "max_host_memory"), total_ram())
    pipe_args, out_args = _pipeline_args(args), args.output_args()
    parsed = parse_recipe(args.recipe)
    if args.keep_source_format and not any(isinstance(m, KeepSourceFormatModifier) for m in parsed.modifiers):
        parsed.modifiers.append(KeepSourceFormatModifier())
    KeepSourceFormatModifier.check_last(parsed.modifiers)
    group.agree(  # only its writer reads it
        "checking the output directory",
        lambda: check_output_dir(out_args.output_dir, overwrite=out_args.overwrite, resume=out_args.resume)
        if group.writes else None,
    )  # fmt: skip
    model_args = args.model_args()
    source = check_source(model_args, parsed.modifiers, args.requantize)  # a quantized checkpoint's format
    offload = _offload_weights(model_args, pipe_args, args.output_dir, args.dry_run)
    loaded, tok, store = load_model(model_args, offload_weights=offload, host_budget=host_budget)
    tok, processor = split_processor(tok)  # a processor given as tokenizer: its tokenizer batches text
    # Fused MoE experts become per-expert Linears for the run (recipes reach them by their checkpoint names);
    # the returned model has its fused experts back. After an error it keeps the Linears (same outputs).
    experts = linearize_experts(loaded, calibrate_all=args.moe_calibrate_all_experts)
    parsed.validate(loaded)
    # GGUF schemes <-> GGUF output, before calibrating
    check_gguf_output(loaded, parsed.modifiers, out_args, tok)
    plan, fit = _memory_plan(args, loaded, parsed, pipe_args, host_budget)
    if out_args.resume:
        keep_recorded_choices(out_args.output_dir, pipe_args, fit)
    if args.dry_run:
        experts.restore()
        return plan
    check_environment(loaded, parsed.modifiers, out_args.output_dir, pipe_args.offload, pipe_args.offload_dir)
    data_args, media = _calibration_data(args, loaded, plan, pipe_args, processor)
    check_data_for_model(loaded, tok, data_args, model_args.model)
    recipe_yaml = parsed.to_yaml()
    # By content, never repr(data_args) (a DataLoader's repr is its address): the stream adds the batches' hash.
    run = run_identity(recipe=recipe_yaml, model=loaded, pipeline=repr(pipe_args), dtype=str(args.dtype))
    output = OutputPlan(out_args, recipe_yaml, run)
    batches, tok, reload_from = _batches_then_release(data_args, tok, owned=args.tokenizer is None)
    # writes the trace on the way out, also when a stage fails; one per process under torchrun, merged below
    with Profiler(rank_path(args.profile)) as profiler:
        state = run_pipeline(
            loaded, tok, parsed.modifiers, data_args, pipe_args, output, store, profiler, batches
        )
        state.results.log.extend(media.notes)
        if out_args.output_dir is not None and group.writes:
            tok = _reload_tokenizer(reload_from, args.trust_remote_code) if reload_from else tok
            state.results.report["host_memory"] = host_report(host_budget, plan, fit)
            state.results.report.update(source)  # the source's format, also in the quantization_config
            _save(loaded, state, output, tok, recipe_yaml, profiler)
            finish_media(media, out_args.output_dir)
    merge_rank_profiles(args.profile, group)  # one trace, a process per rank
    experts.restore()
    return loaded


def _pipeline_args(args: OneshotArgs) -> PipelineArgs:
    return PipelineArgs(
        pipeline=args.pipeline, sequential_targets=args.sequential_targets,
        tracing_ignore=list(args.tracing_ignore or []), offload=args.offload, offload_dir=args.offload_dir,
        compute_dtype=args.compute_dtype, one_pass=args.one_pass,
        cache_max_memory=parse_bytes(args.cache_max_memory, "cache_max_memory"), cache_dtype=args.cache_dtype,
        trace_into=args.trace_into, verify=args.verify, max_device_memory=parse_bytes(args.max_device_memory),
        num_shards=args.num_shards,
    )  # fmt: skip


def _batch_size(args: OneshotArgs) -> int | str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return default_batch_size(device) if args.batch_size is None else args.batch_size


def _memory_plan(args: OneshotArgs, model: torch.nn.Module, parsed: Any, pipe_args: PipelineArgs,
                 host_budget: int | None) -> tuple[Any, HostFit | None]:  # fmt: skip
    """The memory plan when the run asks for one (dry_run, max_device_memory, max_host_memory); it may choose the
    cut, and with a host budget the cache's RAM (``plan_host.fit_host``, logged), or refuse the budget."""
    if not args.dry_run and args.max_device_memory is None and host_budget is None:
        return None, None

    def plan_cut(one_pass: bool, in_place: bool = False, background: bool | None = None) -> Any:
        return make_plan(
            model, parsed.modifiers, num_samples=args.planned_samples(), seq_len=args.max_seq_length,
            batch_size=_batch_size(args), sequential_targets=pipe_args.sequential_targets,
            tracing_ignore=pipe_args.tracing_ignore, cache_tier=pipe_args.offload,
            max_device_memory=parse_bytes(args.max_device_memory), one_pass=one_pass,
            cache_max_memory=pipe_args.cache_max_memory, in_place_factor=in_place, background_save=background,
        )  # fmt: skip

    plan, fit = plan_cut(pipe_args.one_pass), None
    if host_budget is not None:  # the cut and the cache's RAM that keep the budget, or a refusal now
        fit = fit_host(host_budget, plan, one_pass=plan.one_pass, other_cut=(lambda: plan_cut(False))
                       if plan.one_pass else None, cache_max_memory=pipe_args.cache_max_memory,
                       cache_in_ram=pipe_args.offload == "cpu",
                       in_place=lambda one_pass: plan_cut(one_pass, in_place=True),
                       synchronous=lambda one_pass: plan_cut(one_pass, in_place=True, background=False))  # fmt: skip
        plan, pipe_args.one_pass, pipe_args.cache_max_memory = fit.plan, fit.one_pass, fit.cache_max_memory
        pipe_args.in_place_factor = fit.plan.in_place_factor
        if not fit.plan.background_save:
            pipe_args.background_save = False
        for line in fit.decisions:
            logger.info("seqcal: %s", line)
    if not args.dry_run:
        for note in plan.notes:
            logger.warning("seqcal: %s", note)
        pipe_args.sequential_targets = plan.targets
    return plan, fit


def _calibration_data(args: OneshotArgs, model: torch.nn.Module, plan: Any, pipe_args: PipelineArgs,
                      processor: Any) -> tuple[DataArgs | None, Any]:  # fmt: skip
    """How the calibration batches are drawn (their size from the plan or config), images and audio included."""
    data_args = None
    if pipe_args.pipeline != "datafree":
        data_args = DataArgs(
            args.dataset if args.dataset is not None else "default", args.num_calibration_samples,
            args.max_seq_length, _batch_size(args), args.shuffle_calibration_samples, args.text_column,
            args.splits, args.seed, args.concatenate, args.dataset_config_name,
        )  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data_args = with_auto_limits(
        data_args, model, plan=plan, device=device,
        max_device_memory=parse_bytes(args.max_device_memory), cache_max_memory=pipe_args.cache_max_memory,
        equal_lengths=not args.moe_calibrate_all_experts,  # experts fed only their tokens would see padding
    )  # fmt: skip
    model_args = args.model_args()
    media = prepare_media(data_args, model, MediaArgs(args.data_collator, args.preprocessing_func), processor,
                          processor_source(model_args.model, model_args.tokenizer))  # fmt: skip
    return media.data_args, media


def _save(model: torch.nn.Module, state: RunState, output: OutputPlan, tok: Any, recipe_yaml: str,
          profiler: Profiler) -> None:  # fmt: skip
    """The checkpoint's last files (the streamed one), or the whole of it; then the error report."""
    from seqcal.checkpoint.writer import save_checkpoint
    from seqcal.evaluation.perplexity import write_error_report

    out = output.args
    with profiler.span("save", "checkpoint"):
        if output.stream is None and out.output_format == "gguf":  # a pipeline that streamed nothing: all now
            output.stream = out.stream_class()(model, state, out.output_dir, [])
        if output.stream is not None:
            output.stream.finish(tok, recipe_yaml)
        else:
            save_checkpoint(model, state, out.output_dir, tokenizer=tok, recipe_yaml=recipe_yaml,
                            overwrite=out.overwrite)  # fmt: skip
    write_error_report(state.results.report, out.output_dir)
    for name, text in state.results.files.items():  # e.g. a mixed-precision allocation's replay recipe
        (Path(out.output_dir) / name).write_text(text, encoding="utf-8")


def _offload_weights(
    model_args: ModelArgs, pipe_args: PipelineArgs, output_dir: str | None, dry_run: bool
) -> bool:
    """Keep a directory's weights on disk (memory bound) unless the quantized model must come back in RAM.

    Offloaded weights end on meta: the quantized values then live only in the checkpoint, so without
    ``output_dir`` the model is loaded in RAM instead, and the returned model holds them.
    """
    if pipe_args.pipeline != "sequential" or isinstance(model_args.model, torch.nn.Module):
        return False
    if output_dir is None and not dry_run:
        logger.info("no output_dir: loading %s into RAM so that the returned model holds the quantized "
                    "weights; pass output_dir to keep weights on disk and write a checkpoint", model_args.model)  # fmt: skip
        return False
    return True


def _batches_then_release(
    data_args: DataArgs | None, tok: Any, owned: bool
) -> tuple[list | None, Any, str | None]:
    """The calibration batches, built before calibration so that a tokenizer oneshot loaded can go meanwhile.

    Why: a tokenizer stays in RAM through the whole run only to be saved at the end; SmolLM2's (49k vocabulary)
    holds 53 MB of RSS, 39 MB of which is freed when it goes (benchmarks/RESULTS.md, memory bound of the
    command line). One the caller passed is kept (the caller holds it anyway).

    Returns:
        (the batches, None, the folder to read the tokenizer again from) when it is released, else
        (None, the tokenizer, None).
    """
    path = getattr(tok, "name_or_path", None)
    if data_args is None or not owned or tok is None or not path or not Path(path).is_dir():
        return None, tok, None  # nothing to release: the pipeline builds the batches
    return load_calibration_batches(data_args, tok), None, str(path)


def _reload_tokenizer(path: str, trust_remote_code: bool) -> Any:
    """The tokenizer released during calibration, read again from its folder to be saved with the checkpoint."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
