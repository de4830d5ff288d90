"""The public tracing API: ``trace_subgraphs`` and the ``SubgraphList`` it returns."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import torch

from seqcal.execution.cache.store import ActivationCache
from seqcal.execution.executor import run_subgraphs
from seqcal.tracing import TraceResult, split_inputs, trace
from seqcal.tracing.leaves import TraceInto
from seqcal.tracing.partition import Subgraph, partition

logger = logging.getLogger("seqcal")


class SubgraphList(Sequence[Subgraph]):
    """Subgraphs of a traced model in execution order; ``run`` executes them one by one."""

    def __init__(self, model: torch.nn.Module, traced: TraceResult, subgraphs: list[Subgraph]) -> None:
        self.model = model
        self.traced = traced
        self._subgraphs = subgraphs
        self.placeholders = {str(n.target): n.name for n in traced.graph.nodes if n.op == "placeholder"}

    @overload
    def __getitem__(self, index: int) -> Subgraph: ...
    @overload
    def __getitem__(self, index: slice) -> list[Subgraph]: ...
    def __getitem__(self, index: int | slice) -> Subgraph | list[Subgraph]:
        return self._subgraphs[index]

    def __len__(self) -> int:
        return len(self._subgraphs)

    def __iter__(self) -> Iterator[Subgraph]:
        return iter(self._subgraphs)

    @property
    def targets(self) -> list[str]:
        """Qualified names of the target modules, in execution order."""
        return list(self.traced.targets)

    def check_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The tensor inputs of ``inputs``, after checking they have the trace's structure.

        Raises:
            ValueError: other input names than the trace sample, or other non-tensor values.
        """
        tensors, constants = split_inputs(inputs)
        expected = self.traced.input_names
        if sorted(tensors) != sorted(expected):
            raise ValueError(
                f"inputs {sorted(tensors)} differ from the traced inputs {sorted(expected)}; "
                "pass the same input names as the trace sample, or trace again with these"
            )
        for key, value in {**self.traced.constants, **constants}.items():
            traced = self.traced.constants.get(key, "<absent>")
            if key not in constants or key not in self.traced.constants or not _same(value, traced):
                raise ValueError(
                    f"non-tensor input {key}={constants.get(key, '<absent>')!r} differs from the trace "
                    f"({key}={traced!r}); the graph is specialised on it: trace again with this value"
                )
        return tensors

    def run(self, *, cache: ActivationCache | None = None, progress: bool = False, **inputs: Any) -> Any:
        """Run the subgraphs one by one on one batch; returns what ``model(**inputs)`` returns.

        Args:
            cache: where values between subgraphs live (default: a cpu cache made for this call).
            progress: show a progress bar.
            **inputs: model inputs with the same names (and non-tensor values) as the trace sample.

        Example:
            >>> out = subgraphs.run(input_ids=ids, attention_mask=mask)  # doctest: +SKIP
        """
        tensors = self.check_inputs(inputs)
        owned = cache is None
        if owned:  # not `cache or ...`: an empty cache is falsy (it has a length)
            cache = ActivationCache(offload="cpu", device=model_device(self.model))
        try:
            with torch.no_grad():
                outputs = run_subgraphs(
                    self.model, self, [tensors], cache, self.placeholders, progress=progress
                )
        finally:
            if owned:
                cache.close()
        return outputs[0]

    def table(self) -> list[dict[str, Any]]:
        """One row per subgraph: index, targets, parameter count, inputs -> outputs."""
        named = dict(self.model.named_modules())
        rows = []
        for sg in self:
            params = sum(
                p.numel() for m in sg.modules if m in named for p in named[m].parameters(recurse=True)
            )
            rows.append(
                {
                    "index": sg.index,
                    "targets": sg.targets,
                    "params": params,
                    "nodes": len(sg.nodes),
                    "inputs": sg.inputs,
                    "outputs": sg.outputs if not sg.returns else ["<output>"],
                }
            )
        return rows


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality are compared by identity
        return a is b


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first materialised parameter (cpu when all are on meta)."""
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def trace_subgraphs(
    model: torch.nn.Module,
    sample: Mapping[str, Any],
    sequential_targets: str | Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    leaf_modules: Sequence[str] | None = None,
    targets_per_subgraph: int = 1,
    cut: str = "after",
    trace_into: TraceInto = None,
    trace_depth: int | None = None,
    verify: bool = True,
) -> SubgraphList:
    """Trace ``model`` on ``sample`` and cut it into subgraphs around the sequential targets.

    Args:
        model: a transformers model (weights may be on meta, cpu or offloaded).
        sample: keyword inputs as for ``model(**sample)``; only their structure is used.
        sequential_targets: class names or ``re:`` name patterns; default: inferred layer stacks.
        ignore: function/method names always run opaquely.
        leaf_modules: class names or ``re:`` patterns of modules kept as single nodes, also in a full trace.
        targets_per_subgraph: targets per subgraph (default 1: N targets give N+1 subgraphs).
        cut: "after" (each subgraph ends with its target) or "before" (each starts with its targets and the
            ones sharing their input; see ``partition``).
        trace_into: ``"all"`` (the full graph) or class names / ``re:`` patterns of modules to trace into
            instead of keeping them one node (default: only what leads to the targets is traced). torch.nn's
            own modules (Linear, norms ...) stay nodes; a target traced into is a region in its own subgraph.
        trace_depth: open only modules at most this many levels below the ones traced anyway.
        verify: run the partition and the model's own forward on a second sample shaped unlike ``sample``
            (another batch size and length, left padding) and refuse when they differ (see
            ``seqcal.execution.verify``). Skipped when weights are on meta. False skips it.

    Returns:
        A SubgraphList: ``len()``, ``.targets``, ``.run(**inputs)``.

    Raises:
        TracingError: some target cannot be its own node, or the partition's outputs differ from eager on
            the second sample; the message names where, the file and line, and the fix.

    Example:
        >>> subgraphs = trace_subgraphs(model, {"input_ids": ids, "attention_mask": mask})  # doctest: +SKIP
        >>> len(subgraphs) == len(subgraphs.targets) + 1  # doctest: +SKIP
        True
        >>> full = trace_subgraphs(model, sample, trace_into="all")  # attention and MLP ops as nodes  # doctest: +SKIP
    """
    traced = trace(model, sample, sequential_targets, ignore, leaf_modules, trace_into, trace_depth)
    names = {id(m): n for n, m in model.named_modules()}
    subgraphs = SubgraphList(
        model, traced, partition(traced.graph, traced.targets, targets_per_subgraph, names, cut)
    )
    if verify:
        _verify(subgraphs, sample)
    return subgraphs


def _verify(subgraphs: SubgraphList, sample: Mapping[str, Any]) -> None:
    """Refuse a partition whose outputs differ from eager on a second sample (weights on meta: skipped)."""
    from seqcal.execution.verify import refuse, verify_partition

    if any(p.device.type == "meta" for p in subgraphs.model.parameters()):
        logger.info("seqcal: weights on meta, so the partition is not checked against the model's forward")
        return
    start = time.perf_counter()
    divergence = verify_partition(subgraphs, sample)
    if divergence is not None:
        raise refuse(divergence, subgraphs.model)
    logger.info(
        "seqcal: the partition matches the model's forward (checked in %.2f s)", time.perf_counter() - start
    )
