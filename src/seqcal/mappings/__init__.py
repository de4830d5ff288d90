"""Smoothing mappings from the traced graph: which module produces the input of each group of Linears.

A *mapping* pairs a producer with the consumers that read its output directly: a norm (RMSNorm, LayerNorm)
before q/k/v or gate/up (kind ``"norm"``: scales fold into its weight and bias), or a Linear whose output
rows reach the next Linear through operations that act on each channel linearly (kind ``"linear"``:
v_proj -> attention -> o_proj, through transformers' KV-cache write (``seqcal.mappings.kv_writes``), and
up_proj -> act(gate) * up -> down_proj). Folding ``s`` into a mapping
(:func:`fold_scales`) divides the producer's output by ``s`` and multiplies the consumers' input columns by
``s``: the float model computes the same function, and the consumers now read ``X / s``.

Candidates that would change the model are skipped with a reason (logged, and returned by
:func:`derive_mappings`): a norm whose output does not scale with its weight (Gemma's ``x * (1 + w)``),
attention with grouped kv heads (v_proj narrower than o_proj's input), rotary embeddings, an activation
function or a residual add in between, or a producer output read by something other than the consumers.

Explicit mappings (a recipe's ``mappings``) override the graph: SmoothQuant's ``[[balance regexes],
smooth regex]`` pairs or AWQ's ``{smooth_layer, balance_layers}`` dicts (:func:`resolve_mappings`).

Example:
    >>> maps = resolve_mappings(model, subgraphs.traced.graph)  # doctest: +SKIP
    >>> maps[0]  # doctest: +SKIP
    Mapping(producer='model.layers.0.input_layernorm', consumers=('...q_proj', '...k_proj', '...v_proj'), kind='norm')
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from seqcal.algorithms.smoothing import divide_producer, multiply_consumer
from seqcal.mappings.explicit import common_depth, explicit_mappings, matches
from seqcal.mappings.graph import KINDS, Skipped, derive_mappings, norm_fold_reason
from seqcal.records import Mapping

__all__ = [
    "KINDS",
    "Mapping",
    "Skipped",
    "common_depth",
    "derive_mappings",
    "explicit_mappings",
    "fold_scales",
    "matches",
    "norm_fold_reason",
    "resolve_mappings",
]

logger = logging.getLogger("seqcal")


# --- explicit mappings ------------------------------------------------------------------------------------


def resolve_mappings(
    model: torch.nn.Module,
    graph: fx.Graph | None,
    explicit: Sequence[Any] | None = None,
    who: str = "mappings",
) -> list[Mapping]:
    """The mappings to smooth: ``explicit`` ones when given, else those derived from ``graph`` (skips logged).

    Args:
        model: the model.
        graph: a traced graph with the Linears as call_module nodes (ignored when ``explicit`` is given).
        explicit: a recipe's mappings (SmoothQuant or AWQ format), or None.
        who: the modifier, for messages.

    Returns:
        The mappings, in graph (or recipe) order.

    Example:
        >>> resolve_mappings(model, None, [[["re:.*q_proj", "re:.*k_proj"], "re:.*input_layernorm"]])  # doctest: +SKIP
    """
    if explicit:
        return explicit_mappings(model, explicit, who)
    if graph is None:
        raise ValueError(f"{who}: without explicit mappings a traced graph is needed to derive them")
    mappings, skipped = derive_mappings(model, graph)
    for skip in skipped:
        logger.info("seqcal: %s: not smoothing %s: %s", who, ", ".join(skip.consumers), skip.reason)
    return mappings


# --- the fold ---------------------------------------------------------------------------------------------


def fold_scales(model: torch.nn.Module, mapping: Mapping, scales: torch.Tensor) -> None:
    """Divide the producer's output by ``scales`` and multiply the consumers' input columns by them.

    The float model's function is unchanged; the consumers now read ``X / scales``. Callers inside the
    pipeline use ``RunState.fold`` (which also records the fold so cached inputs and statistics follow).

    Args:
        model: the model (parameters on a real device).
        mapping: from :func:`resolve_mappings`.
        scales: ``s [in]`` positive, in the consumers' input width.

    Example:
        >>> fold_scales(model, Mapping("norm", ("fc1", "fc2"), "norm"), torch.full((64,), 2.0))  # doctest: +SKIP
    """
    producer = model.get_submodule(mapping.producer)
    bias = getattr(producer, "bias", None)
    # A fused Linear producer wider than the scales (qkv_proj -> o_proj) feeds the consumers from its last
    # rows (the v part): only those are divided.
    rows = (
        slice(producer.weight.shape[0] - scales.shape[0], None) if mapping.kind == "linear" else slice(None)
    )
    with torch.no_grad():
        weight, new_bias = divide_producer(
            producer.weight.data[rows], None if bias is None else bias.data[rows], scales
        )
        producer.weight.data[rows] = weight
        if new_bias is not None:
            producer.bias.data[rows] = new_bias
        for name in mapping.consumers:
            consumer = model.get_submodule(name)
            consumer.weight.data = multiply_consumer(consumer.weight.data, scales)
