"""Which cut a run uses: before each module group (one pass), after each layer, or layer-by-layer capture.

``one_pass_subgraphs`` tries the cut before each group of modules that read one input; ``run_pipeline``
checks each candidate against the model's own forward (``verify_run``) and falls back to the layer cut, then
to capturing layer by layer when tracing fails (``layerwise_fallback``); ``log_cut`` says which and why.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import torch

from seqcal.execution.store import WeightStore
from seqcal.execution.subgraphs import SubgraphList, trace_subgraphs
from seqcal.execution.verify import Divergence, verify_partition
from seqcal.execution.weights import SubgraphWeights, buffers_on, safety_hooks, targets_onloaded
from seqcal.experts import routed_experts
from seqcal.modifiers.contract import ModifierSet
from seqcal.modifiers.kv_hooks import kv_tap, kv_update_sites
from seqcal.tracing import TracingError
from seqcal.tracing.diagnostics import Problem
from seqcal.tracing.fallback import capture_first_inputs, chain_batches, chain_graph, check_chain
from seqcal.tracing.partition import OnePassError, Subgraph, partition, within
from seqcal.tracing.targets import infer_candidates, match_targets

logger = logging.getLogger("seqcal")


def one_pass_subgraphs(
    model: torch.nn.Module,
    sample: dict[str, Any],
    modifiers: list[Any],
    args: Any,  # execution.pipeline.PipelineArgs
) -> SubgraphList | None:
    """Subgraphs cut before the modifiers' modules, or None when that mode does not apply to this run."""
    if not args.one_pass or args.targets_per_subgraph != 1:
        return None
    modifiers = ModifierSet.of(modifiers)
    if not modifiers.input_only:
        return None
    wanted = {*modifiers.quantized(), *modifiers.pruned()}
    if not wanted:
        return None
    # Only modules inside the layer stacks that the layer cut would trace around (the text decoder's
    # layers): the code between them is what the zoo checks; a vision tower traced module by module is not.
    routed = routed_experts(model, sorted(wanted))  # called in a loop over the tokens each expert is routed
    if routed:
        logger.info("seqcal: cutting at layers, not before each module (MoE experts such as %s run in a "
                    "data-dependent loop; their layer is calibrated whole)", routed[0])  # fmt: skip
        return None
    layers = tuple(f"{layer}." for layer in infer_candidates(model).values())
    outside = sorted(n for n in wanted if not n.startswith(layers))
    if not layers or outside:
        logger.info("seqcal: cutting at layers, not before each module (%s outside the layers)", outside[:3])
        return None
    names = [n for n, _ in model.named_modules() if n in wanted]
    pattern = "re:^(" + "|".join(re.escape(n) for n in names) + ")$"
    attention = sorted({n for kv in modifiers.kv() for n in kv.modules})
    tap = None
    if attention:  # kv_cache_scheme: the keys and values reach the graph through a stand-in cache
        tap, argument = kv_tap(model, attention), _cache_argument(model)
        if tap is None or argument is None:
            logger.info("seqcal: cutting at layers, not before each module (the attention modules' cache updates "
                        "cannot be told apart by layer_idx, or the model takes no cache argument)")  # fmt: skip
            return None
        sample = {**sample, argument: tap}
    try:
        subgraphs = trace_subgraphs(
            model, sample, [pattern], args.tracing_ignore, None, 1, cut="before", trace_into=args.trace_into,
            verify=False,
        )  # fmt: skip
    except (TracingError, OnePassError) as err:
        # Not an error: the layer-level cut below handles this model (it hooks modules inside layers).
        reason = err.problems[0].what if isinstance(err, TracingError) else str(err)
        log = logger.warning if args.trace_into else logger.info  # asked for a full graph: say it differs
        log("seqcal: cutting at layers, not before each module (%s)", reason)
        return None
    # The first subgraph (before any group) has no cached group inputs: a module it holds through a parent its
    # code reads (``self_attn`` before an ``o_proj`` target when q/k/v are not targets) would be compressed
    # there, before any of its inputs were seen. The layer cut calibrates such a module with hooks instead.
    early = [n for n in names for sg in subgraphs if not sg.target_inputs and sg.holds(n)]
    if early:
        logger.info("seqcal: cutting at layers, not before each module (%s is used before its group's cut)",
                    early[0])  # fmt: skip
        return None
    if tap is not None:
        sites = kv_update_sites(subgraphs, attention)
        if sites is None:
            logger.info("seqcal: cutting at layers, not before each module (not every attention module's cache "
                        "update runs in a subgraph of its own group)")  # fmt: skip
            return None
        for sg in subgraphs:
            sg.kv_updates = sites.get(sg.index, [])
        subgraphs.kv_tap, subgraphs.kv_sample = tap, sample
    return subgraphs


def runs_forward(sg: Subgraph) -> bool:
    """Whether the calibration runs ``sg``'s nodes at all. A subgraph cut before its targets whose outputs no
    later subgraph reads and that runs no KV-cache update (the one-pass cut's last one: down_proj, the final norm,
    lm_head) calibrates from its targets' cached inputs and solves, nothing more (``one_subgraph.run_from_inputs``);
    so does its replay and its full-precision reference pass (both only for a subgraph with outputs)."""
    return bool(sg.outputs or sg.kv_updates or not sg.target_inputs)


def read_whole(sg: Subgraph) -> list[str]:
    """``sg``'s modules less the embeddings it reads by rows (``execution.embedding_rows``)."""
    return [m for m in sg.modules if m not in sg.by_rows]


def onloaded_modules(sg: Subgraph) -> list[str]:
    """The modules of ``sg`` whose weights the calibration reads: all of them when its nodes run, else its
    targets and the modules none of its nodes use (producers a transform folds into: ``prepare_modifiers``).

    The others (the lm_head after the last down_proj) are read only when the checkpoint writes them.

    Example:
        >>> onloaded_modules(subgraphs[-1])  # doctest: +SKIP   (one-pass cut, GPTQ)
        ['model.layers.23.mlp.down_proj']
    """
    if runs_forward(sg):
        return read_whole(sg)
    used = {str(n.target) for n in sg.nodes if n.op == "call_module"}
    for node in sg.nodes:  # a parameter stands for itself and for its owner (partition._modules_of)
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                used.update({str(arg.target), str(arg.target).rpartition(".")[0]})
    return [m for m in sg.modules if within(m, sg.targets) or m not in used]


def _cache_argument(model: torch.nn.Module) -> str | None:
    """The model forward's cache argument (``cache`` since transformers 5.24, ``past_key_values`` before)."""
    params = inspect.signature(type(model).forward).parameters
    return next((a for a in ("cache", "past_key_values") if a in params), None)


def log_cut(
    one_pass: SubgraphList | None,
    targets: list[str] | None,
    modifiers: list[Any],
    args: Any,  # execution.pipeline.PipelineArgs
) -> None:
    """One INFO line on how the graph is cut and why (``one_pass_subgraphs`` says itself why it declined)."""
    layer_cut = "a calibration and a propagation pass per layer"
    if one_pass is not None:
        logger.info(
            "seqcal: one pass: cut before each group of quantized modules, %d subgraphs", len(one_pass)
        )
    elif targets is not None:
        logger.info("seqcal: cutting after each of the sequential targets %s: %s", targets, layer_cut)
    elif not args.one_pass or args.targets_per_subgraph != 1:
        logger.info("seqcal: cutting after each layer (one_pass=False, CLI --layer-cut): %s", layer_cut)
    elif not ModifierSet.of(modifiers).input_only:
        mods = ModifierSet.of(modifiers)
        needs = [type(m).__name__ for m, n in zip(mods, mods.needs) if not n.input_only]
        logger.info(
            "seqcal: cutting after each layer (%s needs more than its modules' inputs): %s", needs, layer_cut
        )


@contextlib.contextmanager
def reading_weights(model: torch.nn.Module, store: WeightStore | None) -> Iterator[None]:
    """Weights on meta (``store`` not None) read per module, on the cpu, while the model's own code runs
    outside any subgraph: the tracer deciding a branch on the sample (Mllama's ``cross_attention_states is
    None``, computed by the vision tower), the layer-by-layer fallback capturing the layers' inputs."""
    if store is None:
        yield
        return
    cpu = torch.device("cpu")
    with safety_hooks(model, store, cpu), buffers_on(model, cpu):
        yield


def verify_run(
    subgraphs: SubgraphList, batch: dict[str, Any], store: WeightStore | None, device: torch.device
) -> Divergence | None:
    """Check ``subgraphs`` against the model's forward on a batch shaped unlike ``batch`` (see
    ``seqcal.execution.verify``); offloaded weights are read per module for the eager run and per subgraph for
    the partitioned one, so the check stays within the run's memory bound."""
    start = time.perf_counter()
    if store is None:
        diverged = verify_partition(subgraphs, batch, device)
    else:
        # every module onloaded around its subgraph, the embeddings by rows as calibration reads them
        weights = SubgraphWeights(subgraphs.model, store, subgraphs, device, read=read_whole)

        @contextlib.contextmanager
        def onloading() -> Any:
            with safety_hooks(subgraphs.model, store, device), buffers_on(subgraphs.model, device), \
                    targets_onloaded(subgraphs.model, store, subgraphs.targets, device):  # fmt: skip
                yield

        @contextlib.contextmanager
        def onloaded(sg: Any) -> Any:
            weights.onload(sg)
            try:
                yield
            finally:
                weights.release(sg)

        diverged = verify_partition(subgraphs, batch, device, onloading, onloaded)
    if diverged is None:
        logger.info(
            "seqcal: the partition matches the model's forward on a second batch (checked in %.2f s)",
            time.perf_counter() - start,
        )
    return diverged


def layerwise_fallback(
    model: torch.nn.Module, batches: list[dict[str, Any]], targets: list[str] | None, err: TracingError
) -> tuple[SubgraphList, list[dict[str, Any]]]:
    """Tracing failed: calibrate layer by layer with hooks if the targets form a simple chain, else re-raise."""

    found = match_targets(model, targets) if targets else infer_candidates(model)
    order = [name for name, _ in model.named_modules() if name in set(found.values())]
    reason = check_chain(model, order, batches[0]) if order else "no targets"
    if reason is not None:
        fix = "follow the tracing fixes above; the layer-by-layer fallback does not apply"
        raise TracingError([*err.problems, Problem("layer-by-layer fallback", reason, fix)]) from err
    logger.warning(
        "seqcal: tracing failed (%s); the %d targets form a simple chain, so calibrating layer by layer "
        "with hooks instead. Check the per-layer errors in the report.",
        err.problems[0].what,
        len(order),
    )
    traced = chain_graph(order, capture_first_inputs(model, order[0], batches[0]))
    names = {id(m): n for n, m in model.named_modules()}
    subgraphs = SubgraphList(model, traced, partition(traced.graph, traced.targets, 1, names))
    return subgraphs, chain_batches(model, order[0], batches)
