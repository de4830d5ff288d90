"""``batch_size="auto"``: samples grouped by length into batches as large as the memory budget allows.

A subgraph runs once per batch, so fewer, larger batches pay the per-run overhead (Python, kernel launches,
one cache entry per value) fewer times. Three rules keep the statistics those batches give exact:

1. Samples are stacked longest first; a sample joins a batch only if padding it to the batch's longest adds at
   most ``pad_fraction`` (1/8) of its own tokens, so equal lengths stack with no padding at all.
2. Padding goes on the right, whatever the tokenizer's ``padding_side``: a real token then keeps the position
   and the causal (or sliding-window) context it has alone, while left padding would shift its positions.
   Modifiers see only real tokens (``RunState.token_mask``: GPTQ drops the padded rows from its Hessians).
3. A batch never straddles a length at which the model's code decides differently (``length_boundaries``:
   the sliding window, a chunked-attention size, the original context of long-context RoPE scaling), so every
   sample runs the branch it would run alone.

How many samples: ``auto_batch_limits`` divides an activation budget by the bytes one token of the largest
subgraph needs (from the memory plan when ``oneshot`` made one, else from the config), capped at
``MAX_SAMPLES`` samples and ``MAX_TOKENS`` padded tokens per batch, and, with a cache RAM budget, at an eighth
of it per batch so that the spill to disk stays fine-grained. The result depends only on the model, the
arguments and the device type, never on momentary free memory, so a resumed run forms the same batches.

Example:
    >>> group_by_length([512, 512, 300, 290, 512], BatchLimits(max_tokens=1024))
    [[0, 1], [4], [2, 3]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

AUTO = "auto"
MAX_SAMPLES = 64  # samples per batch at most: beyond this the per-run overhead is already amortized
MAX_TOKENS = 16384  # padded tokens per batch at most (8 x 2048, the batch that paid off on a GPU)
PAD_FRACTION = 1 / 8  # padding a sample may get, as a share of its own tokens
# One batch's activations on the cpu, where the host RAM is the device. 1 GiB (24 SmolLM2 samples of 512
# tokens) raised the peak RSS by ~2 GB (benchmarks/RESULTS.md): half of it, 8 such samples.
HOST_ACTIVATION_BUDGET = 1 << 29
DEVICE_SHARE = 8  # on an accelerator without max_device_memory: this fraction of its memory, 1/8
CACHE_SHARE = 8  # one batch's cached values at most 1/8 of cache_max_memory
# Config fields holding a sequence length at which modeling code switches behaviour (mask or RoPE branch).
BOUNDARY_FIELDS = ("sliding_window", "attention_chunk_size", "original_max_position_embeddings")


def default_batch_size(device: torch.device) -> int | str:
    """What ``batch_size=None`` (the default) means on ``device``: ``"auto"`` on an accelerator, 1 on the CPU.

    On a GPU the per-sample Python and kernel-launch overheads dominate a calibration run: GPTQ of a 1B Llama
    on an H100 took 0.61-0.68x llm-compressor's wall time with batches sized by the memory plan against
    0.93-0.97x one sample at a time (benchmarks/RESULTS.md). On the CPU the forward passes dominate and
    larger batches mostly raise the peak RSS (0.78 -> 1.49 GB for SmolLM2), so it stays one sample per batch.

    Example:
        >>> default_batch_size(torch.device("cpu")), default_batch_size(torch.device("cuda"))
        (1, 'auto')
    """
    return 1 if device.type == "cpu" else AUTO


@dataclasses.dataclass(frozen=True)
class BatchLimits:
    """How ``batch_size="auto"`` may stack samples (see the module docstring).

    Args:
        max_tokens: padded tokens (samples x longest) per batch at most; a longer sample still gets a batch.
        max_samples: samples per batch at most.
        pad_fraction: padding a sample may receive, as a share of its own length (0: equal lengths only).
        boundaries: sequence lengths a batch must not straddle (a sample of length L is never padded to
            T with L <= b < T).

    Example:
        >>> BatchLimits(max_tokens=8192, boundaries=(4096,))
    """

    max_tokens: int = MAX_TOKENS
    max_samples: int = MAX_SAMPLES
    pad_fraction: float = PAD_FRACTION
    boundaries: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BatchLimits.{name} must be a positive int, got {value!r}")
        if not 0 <= self.pad_fraction <= 1:
            raise ValueError(f"BatchLimits.pad_fraction must be in [0, 1], got {self.pad_fraction!r}")


def group_by_length(lengths: Sequence[int], limits: BatchLimits) -> list[list[int]]:
    """Sample indices per batch: longest first, each batch within ``limits`` (module docstring, rules 1, 3).

    Args:
        lengths: tokens of each sample.
        limits: caps, padding allowance and boundaries.

    Returns:
        Lists of indices into ``lengths``, every index exactly once; a batch's first index is its longest
        sample, equal lengths keep their order.

    Example:
        >>> group_by_length([40, 64, 64, 60], BatchLimits(max_tokens=256))
        [[1, 2, 3], [0]]
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group is not None and _joins(lengths[group[0]], lengths[i], len(group), limits):
            group.append(i)
        else:
            groups.append([i])
    return groups


def _joins(longest: int, length: int, size: int, limits: BatchLimits) -> bool:
    """Whether a sample of ``length`` may join a batch of ``size`` samples padded to ``longest``."""
    if size + 1 > limits.max_samples or (size + 1) * longest > limits.max_tokens:
        return False
    if longest - length > limits.pad_fraction * length:
        return False
    return not any(length <= b < longest for b in limits.boundaries)


def length_boundaries(config: Any) -> tuple[int, ...]:
    """Sequence lengths at which the model's code takes another branch (rule 3 of the module docstring).

    Args:
        config: a transformers config (its text config is used for multimodal ones), or None.

    Returns:
        Sorted positive lengths: sliding window, attention chunk, long-context RoPE's original context (for
        "dynamic" RoPE, where the scaling starts past max_position_embeddings, that too).

    Example:
        >>> length_boundaries(MistralConfig(sliding_window=4096))
        (4096,)
    """
    if config is None:
        return ()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = {getattr(text, name, None) for name in BOUNDARY_FIELDS}
    for rope in (getattr(text, "rope_parameters", None), getattr(text, "rope_scaling", None)):
        if isinstance(rope, Mapping):
            found.add(rope.get("original_max_position_embeddings"))
            if rope.get("rope_type", rope.get("type")) == "dynamic":
                found.add(getattr(text, "max_position_embeddings", None))
    return tuple(sorted(v for v in found if isinstance(v, int) and not isinstance(v, bool) and v > 0))


def bytes_per_token(model: torch.nn.Module, seq_len: int, plan: Any = None) -> list[tuple[int, int]]:
    """(device bytes besides activations, activation bytes per token) of each subgraph, or one config guess.

    With a ``MemoryPlan`` (``plan.batch_size`` rows of ``seq_len``) the rows are the plan's: weights and
    Hessians, and the measured activations divided by the tokens they were planned for. Without one, a
    conservative guess from the config: the values a decoder layer reads and writes, its widest
    intermediate twice (as the plan's fallback), the fp32 copy of a Hessian input, and attention scores
    materialized in fp32 ([heads, T] per token, four times: scores, masked, softmax and its output, as the
    cpu's math kernel does).
    """
    if plan is not None and plan.rows:
        tokens = max(plan.batch_size, 1) * seq_len
        return [(r.weights + r.hessians, -(-r.activations // tokens)) for r in plan.rows]
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", 0) or 1024
    inter = getattr(text, "intermediate_size", 0) or 4 * hidden
    heads = getattr(text, "num_attention_heads", 0) or 16
    dtype_bytes = next((p.element_size() for p in model.parameters()), 4)
    per_token = (
        2 * hidden * dtype_bytes + 6 * inter * dtype_bytes + max(hidden, inter) * 4 + 4 * heads * seq_len * 4
    )
    return [(0, per_token)]


def auto_batch_limits(
    model: torch.nn.Module,
    seq_len: int,
    *,
    plan: Any = None,
    device: torch.device | None = None,
    max_device_memory: int | None = None,
    cache_max_memory: int | None = None,
    equal_lengths: bool = False,
) -> BatchLimits:
    """The limits ``batch_size="auto"`` batches are formed with for this model and run.

    Args:
        model: the model (parameters may be on meta); its config gives the per-token guess and boundaries.
        seq_len: max_seq_length.
        plan: a ``MemoryPlan`` of this run, if one was made (more precise than the config guess).
        device: where subgraphs run; an accelerator without ``max_device_memory`` budgets 1/8 of its memory,
            the cpu ``HOST_ACTIVATION_BUDGET``.
        max_device_memory: the device budget in bytes; activations get what weights and Hessians leave.
        cache_max_memory: the activation cache's RAM budget; one batch's cached values stay within 1/8 of it.
        equal_lengths: stack only samples of equal length (no padding at all).

    Returns:
        ``BatchLimits`` with ``max_tokens`` from the budget (at least one sample's worth is always allowed).

    Example:
        >>> auto_batch_limits(model, 512).max_tokens  # doctest: +SKIP
        12800
    """
    rows = bytes_per_token(model, seq_len, plan)
    if max_device_memory is not None:
        budgets = [
            max_device_memory - fixed if plan is not None else max_device_memory // 4 for fixed, _ in rows
        ]
    elif device is not None and device.type == "cuda":
        budgets = [torch.cuda.get_device_properties(device).total_memory // DEVICE_SHARE] * len(rows)
    else:
        budgets = [HOST_ACTIVATION_BUDGET] * len(rows)
    tokens = min(max(budget, 0) // max(per_token, 1) for budget, (_, per_token) in zip(budgets, rows))
    if cache_max_memory is not None:
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        width = max(getattr(text, "hidden_size", 0) or 1024, getattr(text, "intermediate_size", 0) or 0)
        dtype_bytes = next((p.element_size() for p in model.parameters()), 4)
        tokens = min(tokens, cache_max_memory // (CACHE_SHARE * 4 * width * dtype_bytes))
    return BatchLimits(
        max_tokens=max(1, min(int(tokens), MAX_TOKENS)),
        pad_fraction=0.0 if equal_lengths else PAD_FRACTION,
        boundaries=length_boundaries(getattr(model, "config", None)),
    )


def samples_per_batch(limits: BatchLimits, seq_len: int) -> int:
    """Samples of ``seq_len`` tokens one batch holds under ``limits`` (the plan assumes full-length samples)."""
    return max(1, min(limits.max_samples, limits.max_tokens // seq_len))


def batch_summary(batches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What the run's batches were: for the report and the log.

    Returns:
        ``{"count", "samples": [per batch], "tokens": [padded tokens per batch], "padding": share of padded
        positions}``.

    Example:
        >>> batch_summary([{"input_ids": torch.zeros(2, 8), "attention_mask": torch.ones(2, 8)}])["samples"]
        [2]
    """
    samples, tokens, real = [], [], 0
    for batch in batches:
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            continue
        samples.append(int(ids.shape[0]))
        tokens.append(int(ids.numel()))
        mask = batch.get("attention_mask")
        real += int(mask.sum()) if isinstance(mask, torch.Tensor) and mask.shape == ids.shape else ids.numel()
    padding = 1 - real / sum(tokens) if tokens else 0.0
    return {"count": len(samples), "samples": samples, "tokens": tokens, "padding": round(padding, 4)}


def with_auto_limits(args: Any, model: torch.nn.Module, **budget: Any) -> Any:
    """``args`` (a DataArgs) with ``batch_limits`` for this model when ``batch_size="auto"`` and none is set.

    Args:
        args: the run's DataArgs (returned as is for an int batch size or given limits).
        model: the model to calibrate.
        budget: ``auto_batch_limits``' keywords (plan, device, max_device_memory, cache_max_memory,
            equal_lengths).

    Example:
        >>> with_auto_limits(DataArgs("default", batch_size="auto"), model).batch_limits  # doctest: +SKIP
    """
    if args is None or args.batch_size != AUTO or args.batch_limits is not None:
        return args
    return dataclasses.replace(args, batch_limits=auto_batch_limits(model, args.max_seq_length, **budget))


def describe_batches(summary: Mapping[str, Any]) -> str:
    """``batch_summary`` in words, for the log and the report table.

    Example:
        >>> describe_batches({"count": 3, "samples": [64, 64, 40], "padding": 0.01})
        '3 batches of 64, 64, 40 samples (1.0% padding)'
    """
    samples = list(summary.get("samples") or [])
    if not samples:
        return "none"
    sizes = str(samples[0]) if len(set(samples)) == 1 else ", ".join(map(str, samples[:6]))
    more = ", ..." if len(set(samples)) > 1 and len(samples) > 6 else ""
    return f"{len(samples)} batches of {sizes}{more} samples ({100 * float(summary.get('padding', 0)):.1f}% padding)"


def parse_batch_size(text: str) -> int | str:
    """The command line's ``--batch-size``: a positive int or "auto".

    Example:
        >>> parse_batch_size("auto"), parse_batch_size("8")
        ('auto', 8)
    """
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        import argparse

        raise argparse.ArgumentTypeError(f"{text!r} is not a batch size; give a positive int or {AUTO!r}")
    return value
