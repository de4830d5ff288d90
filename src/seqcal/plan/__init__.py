"""Memory plan: before any weight is read, predict each subgraph's device peak, host RAM and disk.

The model is built on the meta device and traced (no weights needed), then per subgraph:

    device  = its weights (an embedding read by rows: a row per token of a batch, execution.embedding_rows) + GPTQ
              Hessians of its Linear layers (fp32, one per shared input) + the larger of: one
              batch's activations (the values it reads and writes, its widest intermediate twice, the fp32 copy of
              a target's input the Hessian update makes, one virtual shard's Hessians beside the fold of those
              before (seqcal.distributed; on the cpu those of 32 MiB or more on disk meanwhile); on a GPU the next
              batch's inputs and the last batch's outputs, copied beside the compute) and the GPTQ solve's
              temporaries (algorithms.gptq: the Cholesky factor beside the Hessian, whose memory takes the working
              copy and the inverse factor, or an fp32 copy of the stacked weight, its codes and the modifier's
              stacked copy; the Hessian's values kept meanwhile, in RAM on a GPU run; modules sharing a Hessian,
              such as a layer's experts, are stacked in chunks sized from ``max_device_memory``: column
              ``chunks``, see modifiers.solve_chunks)
    host    = process baseline (+ HEAP_SLACK) + activation cache (values alive during the subgraph, for every batch)
              + the save after it (the modules it finished, as written, and a copy of their int8 codes for resuming;
              the writer streams tensors to disk and holds none), and the save before it, which a worker thread
              writes while it runs (``checkpoint.streaming.BACKGROUND``) + the device's share when the device is
              the host (cpu runs), or every weight when the model sits in RAM
    disk    = the checkpoint (quantized widths) and, with the disk cache tier, the activation cache

The size of every value crossing a subgraph boundary is measured, not guessed (``seqcal.plan.values``: the
subgraphs run on tiny batches with stand-in weights); if that run fails, sizes come from the config, said so.

Given ``max_device_memory``, a subgraph that would not fit makes the plan retry with finer targets (the
children of the layer class: attention, MLP) and report the switch. What a plan holds and prints (``MemoryPlan``,
``SubgraphPlan``) is in ``seqcal.plan.memory_plan``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from seqcal.algorithms.kept_hessian import SPILL_BYTES, kept_bytes
from seqcal.checkpoint import streaming
from seqcal.data.autobatch import AUTO, auto_batch_limits, samples_per_batch
from seqcal.execution.cache import store as cache_store
from seqcal.execution.cache.tiers import OFFLOAD_TIERS, same_device, tier_device
from seqcal.execution.cuts import onloaded_modules
from seqcal.execution.embedding_rows import mark_by_rows
from seqcal.execution.pipeline import PipelineArgs, one_pass_subgraphs
from seqcal.execution.subgraphs import trace_subgraphs
from seqcal.execution.weights import params_under
from seqcal.modifiers.contract import ModifierSet
from seqcal.modifiers.solve_chunks import (
    chunk_bytes,
    dense_solve_bytes,
    hessian_bytes,
    solve_bytes,
    solve_groups,
)
from seqcal.plan.cuts import finer_targets, over_budget_note
from seqcal.plan.memory_plan import MemoryPlan, SubgraphPlan
from seqcal.plan.values import (
    GEMM_BUFFERS,
    HEAP_SLACK,
    PROCESS_BASELINE,
    measure_values,
    owned_bytes,
    process_baseline,
)
from seqcal.tracing.partition import Subgraph


def plan_memory(
    model: torch.nn.Module,
    subgraphs: list[Subgraph],
    quantized: set[str],
    *,
    num_samples: int,
    seq_len: int,
    batch_size: int,
    dtype_bytes: int,
    quant_bits: int = 4,
    cache_tier: str = "cpu",
    value_bytes: Mapping[str, int] | None = None,
    widest: Mapping[int, int] | None = None,
    device_on_host: bool = True,
    resident_weights: int = 0,
    device_budget: int | None = None,
    solved: set[str] | None = None,
    overlap: bool | None = None,
    background: bool | None = None,
    baseline: int = PROCESS_BASELINE,
    in_place_factor: bool = False,
    row_chunks: bool = False,
) -> MemoryPlan:
    """Predict the run's memory (see the module docstring). ``model`` may be on meta.

    Args:
        cache_tier: the activation cache's ``offload``: "cpu" (RAM), "disk", "device" (the execution device's
            memory; RAM when that is the cpu) or another accelerator's name (neither RAM nor the device
            planned; ``make_plan`` turns the execution device's own name into "device").
        value_bytes / widest: from ``measure_values``; None sizes values from the config instead.
        device_on_host: the execution device is the cpu, so the device's share is resident memory too.
        resident_weights: bytes of weights that stay in RAM all along (a model loaded in RAM, not offloaded).
        device_budget: max_device_memory; GPTQ's stacked solves are sized from it (``solve_chunks``).
        solved: the modules whose solves set the owners of a run over several processes (``solve_cost``): the
            quantized ones and the pruned ones (None: ``quantized``).
        overlap: the cache copies beside the compute on an accelerator (None: the cache's default,
            ``seqcal.execution.cache.store.OVERLAP``).
        background: the checkpoint's files written on a worker thread (None: ``streaming.BACKGROUND``).
        baseline: the process's resident memory besides the run's (``values.process_baseline``).
        in_place_factor, row_chunks: GPTQ's lean cpu solve (``gptq_quantize``'s: factor in place, rows in chunks).
    """
    overlap = cache_store.OVERLAP if overlap is None else overlap
    background = streaming.BACKGROUND if background is None else background
    in_ram = cache_tier == "cpu" or (cache_tier == "device" and device_on_host)  # the cache's bytes in RAM
    on_device = cache_tier == "device" and not device_on_host  # ... or on the execution device
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", 0) or 0
    inter = getattr(text, "intermediate_size", 0) or 4 * hidden
    tokens = batch_size * seq_len
    batches = -(-num_samples // batch_size)
    measured = value_bytes is not None
    size = (
        (lambda name: value_bytes.get(name, 0)) if measured else (lambda name: tokens * hidden * dtype_bytes)
    )
    written = owned_bytes(model, subgraphs, quantized, dtype_bytes, quant_bits)
    inputs = {n for sg in subgraphs for n in sg.inputs} - {n for sg in subgraphs for n in sg.outputs}
    rows, alive = [], sum(size(n) for n in inputs)  # model inputs are cached from the start
    dense = dense_solve_bytes(model, quantized)
    cache_peak = 0  # bytes of cached activations at most, wherever the cache keeps them
    held = 0  # the previous subgraph's save, held by the writer thread while this subgraph runs
    for sg in subgraphs:
        # the modules it reads: not the lm_head after the last down_proj, whose subgraph runs no forward pass
        weights = sum(
            model.get_parameter(n).numel() * dtype_bytes for n in params_under(model, onloaded_modules(sg))
        )  # and an embedding read by rows: at most a row per token of the batch
        weights += sum(tokens * model.get_submodule(m).embedding_dim * dtype_bytes for m in sg.by_rows)
        read, made = sum(size(n) for n in sg.inputs), sum(size(n) for n in sg.outputs)
        wide = widest.get(sg.index, 0) if widest is not None else 3 * tokens * inter * dtype_bytes
        groups = solve_groups(model, sg, quantized)
        solves = groups if solved is None else solve_groups(model, sg, solved)
        widest_in = max((n_in for _, n_in in groups), default=0)
        copies = overlap and in_ram and not device_on_host  # the cache's copies beside the compute (CUDA)
        if not sg.outputs and not solves:  # nothing reads it, nothing to solve: the executor skips it
            activations = 0
        elif sg.outputs or sg.kv_updates or not sg.target_inputs:
            # one batch's inputs and outputs, the widest intermediate and its operand, the fp32 Hessian input;
            # copies beside the compute add the next batch's inputs and the outputs of the one before
            # (seqcal.execution.cache.transfers)
            activations = read + made + 2 * wide + tokens * widest_in * 4 + (read + made if copies else 0)
        else:  # calibrated from its targets' cached inputs, no forward pass after the solve (executor.
            # _run_from_inputs: the one-pass cut's last subgraph, whose head runs for nothing)
            fetched = sum(size(n) for n in sg.target_inputs)
            activations = fetched * (2 if copies else 1) + tokens * widest_in * 4
        hessians = hessian_bytes(groups)
        # the solve's Cholesky factor beside the Hessians, as the GPTQ modifier sizes its chunks (_chunk_limit)
        inverse = max((n_in**2 * 4 for _, n_in in groups), default=0)
        limit = chunk_bytes(dense, device_budget, weights + hessians + inverse)
        solve, chunks = solve_bytes(groups, dtype_bytes, limit, device_on_host, in_place_factor, row_chunks)
        freed = sum(size(n) for n in sg.frees)
        after = alive + made - freed
        if sg.target_inputs or groups:  # the pass that stores the outputs (the one pass of a cut before its
            # modules, the propagation pass after a solve) drops each batch's inputs after it (passes.run_pass)
            during = max(alive * batches + made, after * batches + freed)
        else:  # nothing to solve: its one pass stores every batch's outputs before the inputs are dropped
            during = (alive + made) * batches
        alive = after
        cache_peak = max(cache_peak, alive * batches)
        row = SubgraphPlan(sg.index, sg.targets, weights, hessians, activations,
                           alive * batches if in_ram else 0, solve, chunks=chunks, chunk_bytes=limit)  # fmt: skip
        # the shards' fold beside the next shard's Hessians (on the cpu, the large ones on disk meanwhile: distributed.reduce)
        folds = [n_in**2 * 4 for _, n_in in groups if not (device_on_host and n_in**2 * 4 >= SPILL_BYTES)]
        shards = sum(folds) if batches > 1 else 0
        row.accumulators = shards + (GEMM_BUFFERS if groups and device_on_host else 0)  # and MKL's buffers
        if on_device:
            row.device_cache = during  # every batch's cached values, on the device beside the subgraph's work
        during = during if in_ram else 0
        codes = sum(n_in * sum(outs) for (_, n_in), outs in groups.items())
        # the tensors as written (streamed from their own memory) + the resume file's int8 codes and their bytes
        save = written.get(sg.index, 0) + 2 * codes
        row.quantized_numel = codes
        row.solve_cost = sum(
            float(o) * n_in**2 + float(n_in) ** 3 for (_, n_in), outs in solves.items() for o in outs
        )
        if device_on_host:
            work = max(row.device_peak, save)
        else:  # on a GPU the solve's kept Hessian is in host memory, freed before the save
            work = max(max((kept_bytes(n_in) for _, n_in in groups), default=0), save)
        row.host = baseline + HEAP_SLACK + resident_weights + during + work + held
        row.resident, row.cache_ram, row.work, row.held = resident_weights, during, work, held
        # what the worker still holds of it: the packed tensors and the resume file's int8 codes (streaming.done)
        held = written.get(sg.index, 0) + codes if background else 0
        rows.append(row)
    params = sum(p.numel() for p in model.parameters())
    q_params = sum(model.get_submodule(n).weight.numel() for n in quantized)
    disk = (params - q_params) * dtype_bytes + q_params * quant_bits // 8 + q_params * dtype_bytes // 32
    host_peak = max((r.host for r in rows), default=baseline)
    notes = []
    if cache_tier == "disk":  # rows hold no host cache then: the same bytes are on disk
        disk += cache_peak
    elif cache_tier not in ("cpu", "device"):
        notes.append(
            f"the activation cache, up to {cache_peak / 1024**3:.3f} GB, is on {cache_tier} (not planned)"
        )
    return MemoryPlan(rows, host_peak, disk, notes, baseline=baseline, in_place_factor=in_place_factor,
                      background_save=background)  # fmt: skip


def _plan_auto_batch(model: torch.nn.Module, plan: MemoryPlan, subgraphs: list[Subgraph], quantized: set[str],
                     values: Mapping[str, int] | None, widest: Mapping[int, int] | None, kwargs: dict[str, Any],
                     max_device_memory: int | None) -> MemoryPlan:  # fmt: skip
    """The plan at the batch size ``batch_size="auto"`` picks from the one-sample ``plan``.

    Batch-sized values scale with the samples per batch (masks and position tables that do not are
    overcounted: the plan errs high), so the one-sample measurement is scaled, not measured again.
    """

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    limits = auto_batch_limits(model, kwargs["seq_len"], plan=plan, device=device,
                               max_device_memory=max_device_memory)  # fmt: skip
    size = samples_per_batch(limits, kwargs["seq_len"])
    scaled = {n: b * size for n, b in values.items()} if values is not None else None
    wide = {i: b * size for i, b in widest.items()} if widest is not None else None
    out = plan_memory(model, subgraphs, quantized, batch_size=size, value_bytes=scaled, widest=wide, **kwargs)
    out.batch_size = size
    out.notes.append(f"batch_size auto: {size} samples of {kwargs['seq_len']} tokens per batch (at most "
                     f"{limits.max_tokens} tokens, {limits.max_samples} samples; samples grouped by length)")  # fmt: skip
    return out


def make_plan(
    model: torch.nn.Module,
    modifiers: list[Any],
    *,
    num_samples: int,
    seq_len: int,
    batch_size: int | str,
    sequential_targets: list[str] | None,
    tracing_ignore: list[str],
    cache_tier: str = "cpu",
    max_device_memory: int | None = None,
    one_pass: bool = True,
    cache_max_memory: int | None = None,
    in_place_factor: bool = False,
    background_save: bool | None = None,
) -> MemoryPlan:
    """Trace on a synthetic batch (no weights read) and plan; with ``max_device_memory``, refine targets.

    The subgraphs are cut as the run will cut them: before each group of target modules (``one_pass``, when
    the modifiers allow it and no targets are given), else after each sequential target.

    ``max_device_memory`` picks the cut, it limits nothing at run time: when a layer's subgraph would not
    fit, the plan cuts at the layer's children (attention, MLP: ``plan.targets``) and says so in
    ``plan.notes``. The one-pass cut is already per module group: there a subgraph that does not fit is
    only reported (a note naming it and the fix), as is a layer cut with no finer children.
    ``cache_max_memory`` caps the activation cache's RAM as the run does (the rest spilled to disk);
    ``in_place_factor`` and ``background_save=False``: a host budget's last resorts (``plan.host.fit_host``).

    Example:
        >>> print(make_plan(model, [GPTQModifier(scheme="W4A16")], num_samples=16, seq_len=256, batch_size=1,
        ...                 sequential_targets=None, tracing_ignore=[]).table())  # doctest: +SKIP
    """

    auto = batch_size == AUTO
    batch_size = 1 if auto else int(batch_size)  # auto: planned per sample, then sized (_plan_auto_batch)
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    mods = ModifierSet.of(modifiers)
    quantized = set(mods.quantized())
    row_chunks = all(getattr(m, "solves_rows_in_chunks", bool)() for m in mods if m.quantizes())  # GPTQ's
    bits = max((s.weights.num_bits for s in mods.quantized().values()), default=16)
    dtype_bytes = next((p.element_size() for p in model.parameters()), 4)
    # as the pipeline: offloaded weights, and a model in RAM on the cpu (staged), run on cuda when present
    on_cpu = all(p.device.type in ("cpu", "meta") for p in model.parameters())
    on_host = on_cpu and not torch.cuda.is_available()
    first = next((p.device for p in model.parameters()), torch.device("cpu"))
    execution = torch.device("cpu") if on_host else torch.device("cuda") if on_cpu else first
    if cache_tier not in OFFLOAD_TIERS and same_device(tier_device(cache_tier, execution), execution):
        cache_tier = "device"  # "cuda:0" running on cuda:0: the execution device's memory
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu")
    targets, notes = sequential_targets, []
    for attempt in range(2):
        args = PipelineArgs(
            sequential_targets=targets, tracing_ignore=list(tracing_ignore), one_pass=one_pass
        )
        one_pass_cut = one_pass_subgraphs(model, sample, modifiers, args) if targets is None else None
        # a plan runs no forward pass (a dry run reads no weight): the run checks its partition itself
        subgraphs = one_pass_cut or trace_subgraphs(model, sample, targets, tracing_ignore, verify=False)
        mark_by_rows(model, list(subgraphs), modifiers)  # as the run: embeddings read by rows
        try:
            values, widest = measure_values(subgraphs, batch_size, seq_len)
        except Exception as err:  # noqa: BLE001 - a failed stand-in run only costs precision, and says so
            values, widest = None, None
            notes.append(f"activation sizes come from the config: the stand-in run failed ({type(err).__name__}: "
                         f"{str(err)[:200]})")  # fmt: skip
        # measured once, after the first trace: the run traces as the plan does and keeps its subgraphs
        baseline = process_baseline(resident, PROCESS_BASELINE)
        kwargs = dict(num_samples=num_samples, seq_len=seq_len, dtype_bytes=dtype_bytes, quant_bits=bits,
                      cache_tier=cache_tier, device_on_host=on_host, resident_weights=resident,
                      device_budget=max_device_memory, baseline=baseline, in_place_factor=in_place_factor,
                      background=background_save, row_chunks=row_chunks,
                      solved=quantized | set(mods.pruned()))  # fmt: skip
        plan = plan_memory(model, list(subgraphs), quantized, batch_size=batch_size, value_bytes=values,
                           widest=widest, **kwargs)  # fmt: skip
        if auto:
            plan = _plan_auto_batch(model, plan, list(subgraphs), quantized, values, widest, kwargs,
                                    max_device_memory)  # fmt: skip
        plan.targets, plan.dtype_bytes, plan.one_pass = targets, dtype_bytes, one_pass_cut is not None
        if max_device_memory is None or plan.device_peak <= max_device_memory:
            break
        finer = None if one_pass_cut is not None or attempt else finer_targets(model, list(subgraphs))
        if finer is None or finer == targets:
            why = ("the one-pass cut already gives each group of quantized modules its own subgraph"
                   if one_pass_cut is not None else "these are already the finer targets" if attempt
                   else "its targets have no finer children to cut at")  # fmt: skip
            worst = max(plan.rows, key=lambda r: r.device_peak)
            notes.append(
                over_budget_note(worst.index, worst.targets, worst.device_peak, max_device_memory, why)
            )
            break
        notes.append(f"subgraphs of {targets or 'the inferred layers'} need {plan.device_peak / 1024**3:.2f} GB "
                     f"> max_device_memory: using finer targets {finer}")  # fmt: skip
        targets = finer
    plan.notes = notes + plan.notes
    if cache_max_memory is not None:
        plan.limit_cache(cache_max_memory)
    return plan
