"""AWQ's search for one mapping's scales: every candidate scale placed on the balance weights (``Q(W s) / s``) and
scored by the output error of the mapping's span on its recorded calls, summed over every process's shards in shard
order, so every process picks the same scales; the whole grid first on a screened subset of the calls when the
modifier asks (``screen_every``, ``screen_keep``); for a span that is one Linear, scored from the Gram matrix of its
inputs instead of runs once it saw enough tokens.

The modifier (``seqcal.modifiers.awq``) records the activations and the span's calls; the math of the grid is in
``seqcal.algorithms.awq``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from seqcal.algorithms.awq import (
    add_gram,
    grid_points,
    linear_error,
    masked_mse,
    search_all_scales,
    shortlist,
    weight_mean,
)
from seqcal.modifiers._awq_mappings import AWQMapping
from seqcal.modifiers.base import RunState, Statistic
from seqcal.modifiers.round_to_nearest import fake_quantized, quant_kwargs
from seqcal.modifiers.spans import SpanCache
from seqcal.modifiers.state import real_tokens

# A span that is one Linear is scored from the Gram matrix of its inputs once it saw more tokens than this many per
# input: a candidate then costs ``out * in^2`` instead of ``tokens * out * in`` (and the matrix one pass).
GRAM_TOKENS_PER_INPUT = 1.0


def search_mapping(awq: Any, m: AWQMapping, model: torch.nn.Module, x_mean: torch.Tensor, state: RunState
                   ) -> Any:  # fmt: skip
    """The scales of mapping ``m`` (``search_all_scales``) for ``awq``, the AWQModifier (its settings, its recorded
    spans; typed Any, as this module sits below it), each candidate scored on the span's recorded calls of
    every process (or from the Gram matrix of its inputs); the balance weights are put back before it returns.
    Sets ``awq._calls`` and ``awq._screened`` (and ``awq._tokens`` on the Gram path), which the report records."""
    parent, span = model.get_submodule(m.parent), awq._spans[m.parent]
    quantized = {n: model.get_submodule(n).weight for n in m.balance if n in awq.modules}
    originals = {n: w.data.clone() for n, w in quantized.items()}
    local = (
        len(state.config.sharding.plan.shards_of(state.config.sharding.group.rank))
        if state.config.sharding is not None
        else 1
    )
    gram = _gram(awq, m, parent, quantized, span, local, state)  # X^T X of every shard, or None
    references = (
        [] if gram is not None else span.outputs(parent, state.config.device)
    )  # the float span's output
    awq._screened = 0

    def place(s: torch.Tensor) -> None:
        """Q(W s) / s in place of each quantized balance weight."""
        for n, w in quantized.items():
            view = s.to(w.device, torch.float32).view(1, -1)
            w.data = (fake_quantized(originals[n].float() * view, awq.modules[n]) / view).to(w.dtype)

    def run(c: int, calls: list[int]) -> None:
        """Candidate ``c`` (placed) on the recorded ``calls``: squared errors into ``per_call[call, c]``."""
        for i in calls:
            output = span.run(parent, state.config.device, i)
            per_call[i, c], elements[i] = masked_mse(references[i], output, span.calls[i][2])

    def reduced(calls: list[int], kept: list[int]) -> tuple[list[float], bool]:
        """The mean squared error of the ``kept`` candidates over ``calls`` of every process's shards (per
        local shard summed in call order, folded in shard order: ``RunState.reduce_shards``), inf for the
        other candidates; and whether ``calls`` were every recorded call of every process."""
        errors = torch.zeros(local, len(kept), dtype=torch.float64)
        counts = torch.zeros(local, dtype=torch.int64)
        used = torch.zeros(local, dtype=torch.int64)
        for i in calls:
            errors[span.shards[i]] += per_call[i, kept]
            counts[span.shards[i]] += elements[i]
            used[span.shards[i]] += 1
        per_shard = [{"awq_loss": {"errors": Statistic(errors[k]), "elements": Statistic(counts[k : k + 1]),
                                   "calls": Statistic(torch.tensor([span.shards.count(k)])),
                                   "used": Statistic(used[k : k + 1])}}
                     for k in range(local)]  # fmt: skip
        total = state.reduce_shards(per_shard)["awq_loss"]
        awq._calls = int(total["calls"].item())
        values = [float("inf")] * per_call.shape[1]
        for c, value in zip(kept, (total["errors"] / max(int(total["elements"].item()), 1)).tolist()):
            values[c] = value
        return values, int(total["used"].item()) == awq._calls

    points = len(grid_points(awq.n_grid, awq.duo_scaling))
    # [call, candidate]: each squared error on each recorded call, NaN where not run
    per_call = torch.full((len(span.calls), points), float("nan"), dtype=torch.float64)
    elements = [0] * len(span.calls)

    def losses(candidates: list[torch.Tensor]) -> list[float]:
        """Every candidate's output MSE over every process's shards; screened out: inf."""
        if gram is not None:  # every process holds the same reduced Gram matrix: no reduction
            values = []
            for s in candidates:
                place(s)
                error = linear_error(originals[m.parent].float() - quantized[m.parent].float(), gram)
                values.append(error / max(awq._tokens * parent.out_features, 1))
            return values
        every, kept = list(range(len(span.calls))), list(range(len(candidates)))
        rest = every
        # decided from the arguments alone, so that every process takes the same rounds of reduction
        if awq.screen_keep is not None and awq.screen_keep + 1 < len(kept):
            screen = screened_calls(span.shards, awq.screen_every)
            for c, s in enumerate(candidates):  # the whole grid on the screening calls
                place(s)
                run(c, screen)
            values, covered = reduced(screen, kept)
            screened = set(screen)
            rest = [i for i in every if i not in screened]
            if not covered:  # (every call of every process screened: the whole grid is scored already)
                kept = shortlist(values, awq.screen_keep)
                awq._screened = len(candidates) - len(kept)
        for c in kept:
            place(candidates[c])
            run(c, rest)
        return reduced(every, kept)[0]

    scheme = awq.modules[next(iter(quantized))]
    group = (
        scheme.weights.group_size if quant_kwargs(scheme)["strategy"] in ("group", "tensor_group") else None
    )
    weights = [model.get_submodule(n).weight for n in m.balance]
    w_mean = weight_mean(weights, group) if awq.duo_scaling is not False else None
    try:
        return search_all_scales(losses, x_mean.to(state.config.device), w_mean, awq.n_grid, awq.duo_scaling)
    finally:
        for n, w in quantized.items():
            w.data = originals[n]


def _gram(awq: Any, m: AWQMapping, parent: torch.nn.Module, quantized: dict[str, torch.Tensor], span: SpanCache,
          local: int, state: RunState) -> torch.Tensor | None:  # fmt: skip
    """For a span that is the one balance Linear (o_proj, down_proj): ``X^T X`` of its recorded inputs over
    every shard of every process (folded in shard order), from which ``linear_error`` gives each candidate's
    loss without running the span; None when the span is anything else, or when running it costs less (its
    tokens fewer than its inputs: the Gram matrix costs ``out * in^2`` per candidate, a run ``tokens * out *
    in``)."""
    if not (list(quantized) == [m.parent] == list(m.balance) and state.config.compute_dtype is None):
        return None
    width = parent.in_features
    per_shard = [{"awq_gram": {"gram": Statistic(torch.zeros(width, width, device=state.config.device)),
                               "tokens": Statistic(torch.zeros(1, dtype=torch.int64)),
                               "calls": Statistic(torch.tensor([span.shards.count(k)]))}}
                 for k in range(local)]  # fmt: skip
    for (args, _, mask), shard in zip(span.calls, span.shards):
        X = real_tokens(
            args[0].to(state.config.device), None if mask is None else mask.to(state.config.device)
        )
        stats = per_shard[shard]["awq_gram"]
        add_gram(stats["gram"].tensor, X)
        stats["tokens"].tensor += X.shape[0]
    total = state.reduce_shards(per_shard)["awq_gram"]
    awq._tokens, awq._calls = int(total["tokens"].item()), int(total["calls"].item())
    return total["gram"] if awq._tokens > GRAM_TOKENS_PER_INPUT * width else None


def screened_calls(shards: list[int], every: int) -> list[int]:
    """The recorded calls that score the whole grid: every ``every``-th call of each virtual shard (its first
    included), so the choice is the same whichever processes hold the shards.

    Example:
        >>> screened_calls([0, 0, 0, 0, 0, 1, 1], 2)
        [0, 2, 4, 5]
    """
    seen: dict[int, int] = {}
    picked = []
    for i, shard in enumerate(shards):
        if seen.get(shard, 0) % every == 0:
            picked.append(i)
        seen[shard] = seen.get(shard, 0) + 1
    return picked


def search_autocast(state: RunState) -> contextlib.AbstractContextManager:
    """The forward passes' autocast (``compute_dtype``), so the search sees the spans as calibration ran them."""
    dtype = state.config.compute_dtype
    return torch.autocast(state.config.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
