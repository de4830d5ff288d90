"""Checking a partition against the model's own forward on a second, differently shaped sample.

A graph is traced on one sample. Code the tracer specialised to that sample (a shape, a Python number read
from a tensor, a mask built once) gives other batches wrong values without raising anything. So before a
partition is used it runs on a sample of another batch size and length, with left padding, and its
outputs are compared with eager ``model(**sample)``. When they differ, a second run with hooks on the
targets finds the first target whose inputs differ, and the error names the code between it and the last
target that still matched (its opaque statements, with file and line).

The check costs one eager forward and one partitioned run of a short batch (the calibration batch is cut
to its last ``CHECK_TOKENS`` tokens: ``seqcal.execution.check_sample`` makes it), and a second pair of runs only
when it fails.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from seqcal.execution.cache.store import ActivationCache
from seqcal.execution.check_sample import check_sample, pad_id_of
from seqcal.execution.executor import _put_inputs
from seqcal.tracing.diagnostics import Problem, TracingError
from seqcal.tracing.runner import GraphRunner
from seqcal.tracing.values import OpaqueCall

logger = logging.getLogger("seqcal")

# Relative error (Frobenius) above which a value differs from eager. Both runs compute the same operations
# on the same inputs, so they agree to rounding; a specialised trace is off by far more (tens of percent).
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
HALF_TOLERANCE = 2e-2  # float16 / bfloat16: fused kernels may round differently
# Entries compared at a time (float64 copies of 8 MB each): an output's error never needs a copy of it whole.
ERROR_CHUNK = 1 << 20


@dataclass(frozen=True)
class Divergence:
    """Where a partition's values first differ from eager.

    Attributes:
        value: what differs ("the output logits", "the inputs of model.layers.1").
        error: its relative error (Frobenius norm of the difference over that of eager's value).
        sample: the check sample ("batch 2 x 67 tokens, left padding").
        after: the last target whose inputs still matched, or None when none did (or none was checked).
        sites: the opaque statements between ``after`` and the differing value, as "file:line (source)".
        failure: the error the partitioned run raised, when it failed where eager ran.
    """

    value: str
    error: float
    sample: str
    after: str | None = None
    sites: tuple[str, ...] = ()
    failure: str | None = None

    def what(self) -> str:
        """One clause: which values differ, on what sample, by how much."""
        if self.failure is not None:
            return f"fails on a second sample ({self.sample}) on which the model's own forward runs: {self.failure}"
        span = f" (the values up to {self.after} match)" if self.after else ""
        return (
            f"gives {self.value} that differ from the model's own forward on a second sample ({self.sample}): "
            f"relative error {self.error:.3g}{span}"
        )

    def problem(self) -> Problem:
        """The TracingError entry: what differs, where the code that made it is, and what to do."""
        sites = f"; opaque code in that span: {', '.join(self.sites[:4])}" if self.sites else ""
        return Problem(
            where=self.value.removeprefix("inputs of ").removeprefix("output "),
            what=(
                f"the partition {self.what()}{sites}. The trace holds something specialised to the trace "
                "sample, so calibrating with it would give a wrong model"
            ),
            fix=(
                "pass the function that computes it in ignore=[...] so it runs at execution time, or choose "
                "sequential_targets outside that code; verify=False (CLI --no-verify) skips this check at "
                "your own risk"
            ),
        )


def verify_partition(
    subgraphs: Any,
    sample: Mapping[str, Any],
    device: torch.device | None = None,
    onloading: Callable[[], contextlib.AbstractContextManager] | None = None,
    on_subgraph: Callable[[Any], contextlib.AbstractContextManager] | None = None,
) -> Divergence | None:
    """Run ``subgraphs`` and eager ``model(**check)`` on a check sample made from ``sample``; None when equal.

    Args:
        subgraphs: a ``SubgraphList``.
        sample: the trace sample (or a calibration batch) the check sample is made from.
        device: where inputs go (default: the model's first materialised parameter's device).
        onloading: a context around each run that gives modules their weights as they run (offloaded models).
        on_subgraph: a context per subgraph of the partitioned run that gives it its weights.

    Returns:
        None when every output matches, else where the values first differ.
    """
    made = check_sample(sample, pad_id_of(subgraphs.model))
    check, what = made if made is not None else (dict(sample), "the trace sample itself")
    device = device or _device(subgraphs.model)

    def on_device(inputs: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    check = on_device(check)
    onloading = onloading or contextlib.nullcontext
    try:
        with onloading():
            want = _eager(subgraphs.model, check)
    except Exception as exc:  # noqa: BLE001 - the model itself rejects this sample: check on the trace sample
        if made is None:
            raise
        logger.info(
            "seqcal: the model's forward rejects the check sample (%s): checking on the trace sample", exc
        )
        check, what = on_device(sample), "the trace sample"
        with onloading():
            want = _eager(subgraphs.model, check)
    try:
        with onloading():
            got = _partitioned(subgraphs, check, device, on_subgraph)
    except Exception as exc:  # noqa: BLE001 - a partition that cannot run a batch eager runs is not used
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return Divergence("partitioned run", float("inf"), what, failure=f"{type(exc).__name__}: {message}")
    worst = _compare(got, want)
    if worst is None:
        return None
    value, error = worst
    located = _locate(subgraphs, check, device, onloading, on_subgraph)
    if located is None:
        return Divergence(f"output {value}", error, what)
    target, after, target_error = located
    return Divergence(
        f"inputs of {target}", target_error, what, after, tuple(_sites(subgraphs, after, target))
    )


def refuse(divergence: Divergence, model: torch.nn.Module) -> TracingError:
    """The TracingError for a partition that differs from eager."""
    return TracingError([divergence.problem()], type(model).__name__)


def _device(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def _eager(model: torch.nn.Module, inputs: Mapping[str, Any]) -> Any:
    with torch.no_grad():
        return model(**inputs)


def _partitioned(
    subgraphs: Any, inputs: Mapping[str, Any], device: torch.device,
    on_subgraph: Callable[[Any], contextlib.AbstractContextManager] | None,
) -> Any:  # fmt: skip
    """The partition's output on one batch, subgraph by subgraph (each one's weights onloaded around it)."""
    tensors = subgraphs.check_inputs(inputs)
    runner = GraphRunner(subgraphs.model)
    result = None
    with ActivationCache(offload="cpu", device=device) as cache, torch.no_grad():
        _put_inputs(subgraphs, [tensors], cache, subgraphs.placeholders)
        for sg in subgraphs:
            with on_subgraph(sg) if on_subgraph else contextlib.nullcontext():
                env = {name: cache.fetch(0, name) for name in sg.inputs}
                out = runner.run(sg, env, release=())
            for name in sg.outputs:
                cache.put(0, name, env[name])
            if sg.returns:
                result = out
            for name in sg.frees:
                cache.drop_name(name)
    return result


def output_tensors(value: Any, path: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a model output (ModelOutput fields, tuples, lists, dicts) by path; caches and None skipped.

    Example:
        >>> sorted(output_tensors({"logits": torch.zeros(1), "past": (torch.zeros(1), None)}))
        ['logits', 'past[0]']
    """
    if isinstance(value, torch.Tensor):
        return {path or "output": value}
    if isinstance(value, Mapping):
        items = [(f"{path}.{key}" if path else str(key), item) for key, item in value.items()]
    elif isinstance(value, (tuple, list)):
        items = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    else:
        return {}
    found: dict[str, torch.Tensor] = {}
    for key, item in items:
        found.update(output_tensors(item, key))
    return found


def _compare(got: Any, want: Any) -> tuple[str, float] | None:
    """The output leaf that differs most (over the tolerance), or None; a missing leaf counts as differing."""
    mine = output_tensors(got)
    worst: tuple[str, float] | None = None
    for path, ref in output_tensors(want).items():
        if not ref.is_floating_point():
            same = path in mine and mine[path].shape == ref.shape and torch.equal(mine[path].cpu(), ref.cpu())
            error = 0.0 if same else float("inf")
        else:
            error = _error(mine.get(path), ref)
        if error > _tolerance(ref.dtype) and (worst is None or error > worst[1]):
            worst = (path, error)
    return worst


def _error(got: torch.Tensor | None, want: torch.Tensor, chunk: int = ERROR_CHUNK) -> float:
    """Relative error ``|got - want| / |want|`` (Frobenius, in float64) over the entries finite in both; inf when
    the shapes or the finite entries differ. Summed ``chunk`` entries at a time, so a large output (the logits
    of a sample with image tokens) costs a few MB beside it, not several float64 copies of it.

    Example:
        >>> _error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
        0.0
    """
    if got is None or got.shape != want.shape:
        return float("inf")
    a_all, b_all = got.detach().reshape(-1), want.detach().reshape(-1)
    diff = ref = 0.0
    seen = False
    for start in range(0, b_all.numel(), chunk):
        a, b = (t[start : start + chunk].to("cpu", torch.float64) for t in (a_all, b_all))
        finite = torch.isfinite(b)
        if not torch.equal(finite, torch.isfinite(a)):
            return float("inf")
        seen = seen or bool(finite.any())
        a, b = a[finite], b[finite]
        diff += float((a - b).square().sum())
        ref += float(b.square().sum())
    if not seen:
        return 0.0
    return diff**0.5 / max(ref**0.5, 1e-30)


def _tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, HALF_TOLERANCE)


def _first(value: Any) -> torch.Tensor | None:
    return next((leaf for leaf in output_tensors(value).values() if leaf.is_floating_point()), None)


@contextlib.contextmanager
def _capture(model: torch.nn.Module, names: Sequence[str], into: dict[str, torch.Tensor]) -> Iterator[None]:
    """Record (on the cpu) the first floating input of each named module, the first time it runs."""
    handles = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, name: str) -> None:
        value = _first((args, kwargs))
        if name not in into and value is not None:
            into[name] = value.detach().to("cpu", copy=True)

    try:
        for name in names:
            module = model.get_submodule(name)
            handles.append(
                module.register_forward_pre_hook(lambda m, a, k, n=name: hook(m, a, k, n), with_kwargs=True)
            )
        yield
    finally:
        for handle in handles:
            handle.remove()


def _locate(
    subgraphs: Any, check: Mapping[str, Any], device: torch.device,
    onloading: Callable[[], contextlib.AbstractContextManager],
    on_subgraph: Callable[[Any], contextlib.AbstractContextManager] | None,
) -> tuple[str, str | None, float] | None:  # fmt: skip
    """(first target whose inputs differ, the target before it, the error), or None if all inputs match."""
    called = {str(n.target) for n in subgraphs.traced.graph.nodes if n.op == "call_module"}
    targets = [t for t in subgraphs.targets if t in called]
    eager: dict[str, torch.Tensor] = {}
    mine: dict[str, torch.Tensor] = {}
    with _capture(subgraphs.model, targets, eager), onloading():
        _eager(subgraphs.model, check)
    with _capture(subgraphs.model, targets, mine), onloading():
        _partitioned(subgraphs, check, device, on_subgraph)
    previous = None
    for name in targets:
        if name in eager:
            error = _error(mine.get(name), eager[name])
            if error > _tolerance(eager[name].dtype):
                return name, previous, error
            previous = name
    return None


def _sites(subgraphs: Any, after: str | None, target: str) -> list[str]:
    """Opaque statements of the subgraphs from the one holding ``after`` to the one holding ``target``."""
    index = {t: sg.index for sg in subgraphs for t in sg.targets}
    start, stop = index.get(after, 0) if after else 0, index.get(target, len(subgraphs) - 1)
    sites: list[str] = []
    for sg in subgraphs[start : stop + 1]:
        for node in sg.nodes:
            site = getattr(node.target, "site", None) if isinstance(node.target, OpaqueCall) else None
            text = f"{site.filename}:{site.lineno} ({site.source})" if site else None
            if text and text not in sites:
                sites.append(text)
    return sites
