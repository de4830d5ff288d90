"""A host-memory budget (``max_host_memory``) kept by choosing from the memory plan, before any weight is read.

The plan (``seqcal.plan``) predicts each subgraph's resident memory as the sum of the process baseline, the
weights held in RAM, the activation cache in RAM, the subgraph's own work (on the cpu: its weights, Hessians
and solve; on a GPU: the kept Hessian or its save) and the save the worker thread still writes. Of these the
run can move one without changing the result: the activation cache, which ``cache_max_memory`` spills to
disk beyond a RAM budget. The cut moves the rest: the one-pass cut (one subgraph per group of modules) or
the layer cut (one per layer, every Hessian of a layer at once, fewer cached values). ``fit_host`` picks:

1. the cut: the default one when its floor (the plan with the whole cache on disk) fits, else the other cut
   when its floor fits, else (a cpu run) either cut with GPTQ's Cholesky factor in the Hessian's own memory
   (``gptq_quantize``'s ``in_place_factor``: no second [in, in] matrix, equal to LAPACK's factor up to float32
   rounding; CPU Hessians of ``gptq_factor.IN_PLACE_FROM`` inputs or more are factored so anyway) and a module
   solved alone a chunk of rows at a time where its qparams allow it (``row_chunks``: no weight-sized float32
   copy, the same codes up to float32 rounding), then also with
   each subgraph's checkpoint files written before the next subgraph starts (no save held beside its work, the
   same files); else the budget is refused, naming the smallest that works and what dominates it;
2. the cache's RAM: all of it when the plan fits, else the most that keeps every subgraph under the budget.

The prediction is fitted under the budget less ``BUDGET_MARGIN`` of it, for what the plan cannot see.

Each decision is one log line (``HostFit.decisions``).

Example:
    >>> fit = fit_host(900 * 10**6, plan, one_pass=True, other_cut=None)  # doctest: +SKIP
    >>> fit.cache_max_memory, fit.plan.host_peak <= 900 * 10**6  # doctest: +SKIP
    (412000000, True)
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seqcal.checkpoint.resume_files import recorded_choices
from seqcal.errors import SeqcalError
from seqcal.plan import PROCESS_BASELINE, MemoryPlan, SubgraphPlan

logger = logging.getLogger("seqcal")

_GB = 1e9
# The share of a budget the plan leaves free for what it cannot see from the process it measures (library code
# first run later, the allocator's arenas, what a long run accumulates): at Llama-3.2-1B's widths under 900 MB its
# prediction fell short of the measured peak by 0.7% over 2 layers and 3.0% over 24; it was above it by 1-7%
# elsewhere (benchmarks/RESULTS.md).
BUDGET_MARGIN = 0.04


class HostBudgetError(SeqcalError, ValueError):
    """``max_host_memory`` is malformed, or the memory plan cannot keep the process under it."""


@dataclass
class HostFit:
    """What the run does to stay under ``budget`` bytes of resident memory."""

    budget: int
    plan: MemoryPlan  # the plan of the chosen cut, with the cache's RAM capped as the run will
    one_pass: bool  # the cut: before each module group (True) or after each layer
    cache_max_memory: int | None  # the activation cache's RAM budget for the run (None: no cap)
    decisions: list[str] = field(default_factory=list)


def check_budget(budget: int | None, total_ram: int | None) -> int | None:
    """A parsed ``max_host_memory``: refused when not positive, a warning when above the machine's RAM.

    Args:
        budget: bytes (``run_args.parse_bytes``), or None for no budget.
        total_ram: the machine's physical memory in bytes (None: unknown, not compared).

    Returns:
        ``budget``.

    Raises:
        HostBudgetError: ``budget`` is zero or negative.
    """
    if budget is None:
        return None
    if budget <= 0:
        raise HostBudgetError(
            f"max_host_memory={budget} bytes is not a budget: give a positive size such as '12GB'"
        )
    if total_ram is not None and budget > total_ram:
        logger.warning("seqcal: max_host_memory %.2f GB is more than this machine's RAM (%.2f GB): the budget "
                       "limits nothing the machine does not already limit", budget / _GB, total_ram / _GB)  # fmt: skip
    return budget


def floor_of(plan: MemoryPlan, movable: bool = True) -> tuple[int, SubgraphPlan | None]:
    """The smallest peak the plan can reach (its cache all on disk when ``movable``), and the subgraph that sets it."""
    worst = max(plan.rows, key=lambda r: r.host - (r.cache_ram if movable else 0), default=None)
    if worst is None:
        return plan.baseline, None
    return worst.host - (worst.cache_ram if movable else 0), worst


def dominant(row: SubgraphPlan) -> tuple[str, str]:
    """What weighs most in ``row``'s floor, in words with its size, and what lowers it ("" when only a larger
    budget does): ("subgraph 3's own work (mostly its GPTQ solve): 0.61 GB", "")."""
    device = {"its weights": row.weights, "its GPTQ Hessians": row.hessians,
              "its activations": row.activations, "its GPTQ solve": row.solve}  # fmt: skip
    # on the cpu its work is the device's share (else its save, or a Hessian kept on the host during the solve)
    own = max(device, key=device.get) if row.work == row.device_peak else "its save or kept Hessian"
    parts = {"the weights held in RAM": (row.resident, ", or pass output_dir with the model's directory (its "
                                                       "weights then read per subgraph)"),
             f"subgraph {row.index}'s own work (mostly {own})": (row.work, ", or lower max_seq_length / batch_size"
                                                                   if own == "its activations" else ""),
             "the process itself (Python, torch, the model's skeleton)": (row.host - row.resident - row.cache_ram
                                                                          - row.work - row.held, ""),
             "the previous subgraph's save, still being written": (row.held, "")}  # fmt: skip
    name = max(parts, key=lambda k: parts[k][0])
    return f"{name}: {parts[name][0] / _GB:.2f} GB", parts[name][1]


def cache_limit(plan: MemoryPlan, budget: int) -> int | None:
    """The most activation-cache bytes in RAM that keep every subgraph of ``plan`` under ``budget``.

    Returns:
        None when the whole cache fits; else the limit (never negative: check ``floor_of`` first).
    """
    over = [budget - (r.host - r.cache_ram) for r in plan.rows if r.host > budget]
    return max(min(over), 0) if over else None


def fit_host(
    budget: int,
    plan: MemoryPlan,
    *,
    one_pass: bool,
    other_cut: Callable[[], MemoryPlan] | None,
    cache_max_memory: int | None = None,
    cache_in_ram: bool = True,
    in_place: Callable[[bool], MemoryPlan] | None = None,
    synchronous: Callable[[bool], MemoryPlan] | None = None,
) -> HostFit:
    """Choose the cut and the cache's RAM so that the run's predicted resident memory stays under ``budget`` less
    ``BUDGET_MARGIN`` of it.

    Args:
        budget: max_host_memory in bytes.
        plan: the plan of the cut the run takes by default (``one_pass`` says which).
        one_pass: whether ``plan`` is the one-pass cut.
        other_cut: the plan of the other cut (made only when needed), None when the run cannot switch (explicit
            sequential_targets, modifiers that need the layer cut, ``one_pass=False`` given).
        cache_max_memory: the user's own cap of the cache's RAM (kept when lower than the one chosen).
        cache_in_ram: the cache's tier is "cpu", whose RAM cache_max_memory caps (the other tiers' share of RAM,
            "device" on a cpu run, cannot be moved to disk).
        in_place: the plan of a cut (its ``one_pass``) with GPTQ's factor in the Hessians' own memory, made only
            when neither cut fits otherwise; None: not offered.
        synchronous: the plan of a cut with the in-place factor and each subgraph's save written before the next
            subgraph starts (``PipelineArgs.background_save``), made only when ``in_place`` does not fit either.

    Returns:
        The HostFit; its ``decisions`` are logged by the caller, one line each.

    Raises:
        HostBudgetError: no cut fits, even with the whole cache on disk; names the smallest budget and its cause.
    """
    decisions, cut = [], _cut_name(one_pass)
    target = int(budget * (1 - BUDGET_MARGIN))  # what the plan's prediction may reach
    floor, worst = floor_of(plan, cache_in_ram)
    if floor > target and other_cut is not None:
        other = other_cut()
        other_floor, other_worst = floor_of(other, cache_in_ram)
        other_name = _cut_name(not one_pass)
        if other_floor <= target:
            decisions.append(f"max_host_memory {budget / _GB:.2f} GB: the {other_name} instead of the {cut}, whose "
                             f"floor is {floor / _GB:.2f} GB ({dominant(worst)[0]}); the {other_name} needs "
                             f"{other_floor / _GB:.2f} GB")  # fmt: skip
            plan, one_pass, cut, floor, worst = other, not one_pass, other_name, other_floor, other_worst
        elif other_floor < floor:
            floor, worst = other_floor, other_worst
    cuts = [one_pass] + ([not one_pass] if other_cut is not None else [])
    factor = (
        "GPTQ's Cholesky factors in the Hessians' own memory (blocked; equal to LAPACK's up to float32 rounding) "
        "and its modules' rows solved 16 MiB at a time where their qparams allow it"
    )
    saves = (
        "each subgraph's checkpoint files written before the next subgraph starts (none held beside its work)"
    )
    for make, what in ((in_place, factor), (synchronous, f"{factor}, and {saves}")):
        if floor <= target or make is None:
            continue
        found, floor, worst = _economy_fit(target, make, cuts, cache_in_ram, floor, worst)
        if found is not None:
            plan, one_pass, cut = found, found.one_pass, _cut_name(found.one_pass)
            decisions.append(
                f"max_host_memory {budget / _GB:.2f} GB: {what}, the {cut}'s floor {floor / _GB:.2f} GB"
            )
    if floor > target:
        cause, fix = dominant(worst) if worst is not None else ("the process itself", "")
        least = math.ceil(floor / (1 - BUDGET_MARGIN) / 1e7) * 1e7  # the floor and the margin, in 0.01 GB
        raise HostBudgetError(
            f"max_host_memory={budget / _GB:.2f} GB cannot be kept: the memory plan needs at least "
            f"{floor / _GB:.2f} GB even with the activation cache on disk, most of it {cause}, and "
            f"{BUDGET_MARGIN:.0%} of the budget beside it; raise max_host_memory to {least / _GB:.2f} GB{fix}"
        )
    if other_cut is not None and not decisions:
        decisions.append(f"max_host_memory {budget / _GB:.2f} GB: the {cut} (its floor, the cache on disk, is "
                         f"{floor / _GB:.2f} GB)")  # fmt: skip
    limit = cache_limit(plan, target) if cache_in_ram else None
    if cache_max_memory is not None and (limit is None or cache_max_memory < limit):
        limit = cache_max_memory  # the user's own cap is lower: kept
    whole = plan.host_peak
    if limit is not None:
        plan.limit_cache(limit)
    decisions.append(_cache_decision(budget, plan, limit, whole, cache_in_ram, cache_max_memory))
    return HostFit(budget, plan, one_pass, limit, decisions)


def _cut_name(one_pass: bool) -> str:
    """The cut's name in the decisions and errors."""
    return "one-pass cut" if one_pass else "layer cut"


def _economy_fit(budget: int, make: Callable[[bool], MemoryPlan], cuts: list[bool], movable: bool, floor: int,
                 worst: SubgraphPlan | None) -> tuple[MemoryPlan | None, int, SubgraphPlan | None]:  # fmt: skip
    """The first of ``cuts`` (``one_pass`` values) whose plan by ``make`` (the in-place factor, the synchronous
    save) fits ``budget``, its floor and the row that sets it; else None with the lowest floor of all (``floor``,
    ``worst``: the others')."""
    for one_pass in cuts:
        plan = make(one_pass)
        plan_floor, plan_worst = floor_of(plan, movable)
        if plan_floor <= budget:
            return plan, plan_floor, plan_worst
        if plan_floor < floor:
            floor, worst = plan_floor, plan_worst
    return None, floor, worst


def _cache_decision(budget: int, plan: MemoryPlan, limit: int | None, whole: int, in_ram: bool,
                    asked: int | None) -> str:  # fmt: skip
    """The log line of the cache's tier."""
    head = f"max_host_memory {budget / _GB:.2f} GB: "
    peak = f"predicted host peak {plan.host_peak / _GB:.2f} GB"
    if not in_ram:
        return head + f"the activation cache stays where offload puts it, {peak}"
    if limit is None:
        return head + f"the activation cache stays in RAM, {peak}"
    if asked is not None and limit == asked:
        return (
            head
            + f"the activation cache keeps cache_max_memory {asked / _GB:.2f} GB in RAM, the rest on disk, {peak}"
        )
    return head + (f"the activation cache holds at most {limit / _GB:.2f} GB in RAM and spills the rest to disk "
                   f"(all in RAM the peak would be {whole / _GB:.2f} GB), {peak}")  # fmt: skip


def host_report(budget: int | None, plan: MemoryPlan | None, fit: HostFit | None) -> dict[str, Any]:
    """The ``host_memory`` entry of quantization_report.json: the budget, the predicted and the measured peak.

    The measured peak is the process's (``measured_peak``: since it started, the whole command on the command line);
    the predicted one the plan's, None when no plan was made.
    """
    return {
        "max_host_memory": budget,
        "predicted_peak": plan.host_peak if plan is not None else None,
        "measured_peak": measured_peak(),
        "one_pass": fit.one_pass if fit is not None else None,
        "cache_max_memory": fit.cache_max_memory if fit is not None else None,
        "decisions": fit.decisions if fit is not None else [],
    }


def measured_peak() -> int | None:
    """The process's peak resident memory in bytes so far (None where neither source exists: Windows).

    On Linux, ``VmHWM`` of ``/proc/self/status``: ``ru_maxrss`` keeps the parent's resident size across
    fork and exec, so a run started from a large process (a test runner, a notebook) would report the
    parent's memory as its own.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def total_ram() -> int | None:
    """The machine's physical memory in bytes, None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_whole_load(source: str | os.PathLike[str], budget: int | None) -> None:
    """Refuse, before reading a weight, a model loaded whole into RAM whose weights alone exceed ``budget``.

    Raises:
        HostBudgetError: the safetensors files in ``source`` and the process take more than ``budget``.
    """
    if budget is None:
        return
    size = sum(f.stat().st_size for f in Path(source).glob("*.safetensors"))
    if size + PROCESS_BASELINE > budget:
        raise HostBudgetError(
            f"max_host_memory={budget / _GB:.2f} GB cannot be kept: the model is loaded whole into RAM (no "
            f"output_dir) and its weights alone take {size / _GB:.2f} GB beside the process's "
            f"{PROCESS_BASELINE / _GB:.2f} GB; pass output_dir to read them per subgraph, or raise max_host_memory"
        )


def keep_recorded_choices(output_dir: str | None, pipe_args: Any, fit: HostFit | None) -> None:
    """A resume finishes with GPTQ's factor as the interrupted run chose it (``resume_files.recorded_choices``): the
    plan's process baseline moves by a few MB between processes, so the same budget may choose the other factor,
    which changes float32 roundings in the subgraphs still to come.

    Raises:
        HostBudgetError: the interrupted run used LAPACK's factor and this run's budget needs the in-place one.
    """
    recorded = recorded_choices(output_dir).get("in_place_factor")
    if recorded is None or bool(recorded) == pipe_args.in_place_factor:
        return
    if not recorded and fit is not None:
        raise HostBudgetError(
            f"max_host_memory={fit.budget / 1e9:.2f} GB needs GPTQ's factor in the Hessians' own memory, but the "
            f"interrupted run in {output_dir} used LAPACK's; resume it with the max_host_memory it was started with"
        )
    logger.info("seqcal: resume: GPTQ's factor %s, as the interrupted run chose it",
                "in the Hessians' own memory" if recorded else "by LAPACK")  # fmt: skip
    pipe_args.in_place_factor = bool(recorded)
