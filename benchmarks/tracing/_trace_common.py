"""Measuring code of ``benchmarks/tracing/trace_matrix.py``, shared by its seqcal and peer workers.

``evaluate(arch, adapter)`` builds a zoo model, records the eager run (hooks on every module), traces and
runs it through the tool's ``Adapter`` and fills a ``Result``: subgraph count against the zoo targets the
forward calls, and the partitioned output against eager within ``TOLERANCE``. ``emit`` prints the result
line the orchestrator parses. Imports only the standard library at top level (torch and transformers
inside functions), so the peer venv can import it.

Example:
    >>> result = evaluate("llama", SEQCAL)  # SEQCAL: trace_matrix's seqcal adapter  # doctest: +SKIP
    >>> result.equal, result.count == result.expected  # doctest: +SKIP
    (True, True)
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TOOLS: dict[str, tuple[Path, Path]] = {
    # tool -> (python of its venv, worker script)
    "seqcal": (REPO / ".venv/bin/python", REPO / "benchmarks/tracing/trace_matrix.py"),
    "peer": (REPO / ".peer-venv/bin/python", REPO / "benchmarks/tracing/_peer_trace.py"),
}
MARKER = "@@TRACE_MATRIX@@ "
TOLERANCE = 1e-5
SAMPLE = {"batch": 1, "seq_len": 12, "left_pad": 0}
CHECK = {"batch": 2, "seq_len": 9, "left_pad": 3}


@dataclass
class Result:
    """One (architecture, tool) cell of the matrix.

    Args:
        arch: zoo key. tool: ``"seqcal"`` or ``"peer"``. family: zoo family.
        status: ``"ok"`` (the worker got through), ``"n/a"`` (the zoo model or its inputs do not
            exist / run eagerly in this venv's transformers), ``"error"`` (worker crash or timeout).
        traced: tracing returned subgraphs. count: their number. expected: zoo targets called + 1.
        equal: partitioned output within tolerance of eager; diff/scale: max abs diff and its scale.
        trace_s: seconds ``trace_fn`` took. compared: ``"output"``, or the leaf module whose output
            stood in for a final output the tool does not return. worst: where the largest
            relative difference was seen (``"output"`` or ``"<target name>[call]"``).
        settings_diff: when the tool's own run settings (``Adapter.reference``) change the eager
            output: [max abs diff, the same on unpadded tokens only (nan if unknown)].
        error: short message of the failing stage. note: extra facts (peer's inferred targets).
    """

    arch: str
    tool: str
    family: str = ""
    status: str = "ok"
    traced: bool = False
    count: int | None = None
    expected: int | None = None
    equal: bool | None = None
    diff: float | None = None
    scale: float | None = None
    trace_s: float | None = None
    compared: str = ""
    worst: str = ""
    settings_diff: list[float] = field(default_factory=list)
    error: str = ""
    note: str = ""
    versions: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tool not in TOOLS:
            raise ValueError(f"Result {self.arch!r}: tool {self.tool!r} is not one of {sorted(TOOLS)}")
        if self.status not in ("ok", "n/a", "error"):
            raise ValueError(f"Result {self.arch!r}: status {self.status!r} is not ok, n/a or error")


# ------------------------------------------------------------------------------------- worker side


def short_error(exc: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def primary_tensor(output: Any) -> Any:
    """The output compared: ``logits``, else ``last_hidden_state``, else the first tensor found."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):  # ModelOutput is an OrderedDict; the peer may return a dict
        for key in ("logits", "last_hidden_state"):
            if isinstance(output.get(key), torch.Tensor):
                return output[key]
        items: Sequence[Any] = list(output.values())
    elif isinstance(output, (tuple, list)):
        items = output
    else:
        return None
    for item in items:
        found = primary_tensor(item)
        if found is not None:
            return found
    return None


@dataclass
class Recording:
    """What forward hooks saw during one run: each module's primary outputs, and the call order."""

    outputs: dict[str, list[Any]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)


@contextlib.contextmanager
def recording(model: Any) -> Iterator[Recording]:
    """Record every module call of ``model`` (hooks on all modules, removed in ``finally``).

    The peer's graphs drop the model's return value, so the partitioned run is also compared
    module by module: the zoo targets' outputs and the output of the last leaf module (lm_head).
    """
    rec = Recording()

    def hook(name: str) -> Callable[..., None]:
        def record(_module: Any, _args: Any, output: Any) -> None:  # returns None: output unchanged
            tensor = primary_tensor(output)
            rec.outputs.setdefault(name, []).append(None if tensor is None else tensor.detach().clone())
            rec.order.append(name)

        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in model.named_modules()]
    try:
        yield rec
    finally:
        for handle in handles:
            handle.remove()


def tensor_diff(out: Any, ref: Any) -> tuple[float, float] | str:
    """(max abs diff, scale) of two tensors, or why they cannot be compared."""
    if ref is None or out is None:
        return f"{'eager' if ref is None else 'partitioned'} value holds no tensor"
    if out.shape != ref.shape or out.device != ref.device:
        return f"shape/device {tuple(out.shape)}@{out.device} != {tuple(ref.shape)}@{ref.device}"
    scale = max(1.0, ref.float().abs().max().item())
    diff = (out.float() - ref.float()).abs().max().item() if ref.numel() else 0.0
    return diff, scale


def check(
    result: Result, got: Any, want: Any, got_rec: Recording, want_rec: Recording, targets: list[str]
) -> None:
    """Compare a partitioned run with the eager one into ``result``: final output and each target's.

    The final output is the returned primary tensor; when the tool returns none (the peer's last
    subgraph returns ``{}``), the output of the last leaf module eager called stands in for it.
    """
    leaves = [n for n in want_rec.order if n and not any(k.startswith(n + ".") for k in want_rec.outputs)]
    result.equal, result.diff, result.scale, result.compared = True, 0.0, 1.0, "output"
    pairs = [("output", primary_tensor(got), primary_tensor(want))]
    if pairs[0][1] is None and leaves:
        last = result.compared = leaves[-1]
        pairs = [(last, (got_rec.outputs.get(last) or [None])[-1], want_rec.outputs[last][-1])]
    notes = []
    miscounted = [n for n in targets if len(got_rec.outputs.get(n, [])) != len(want_rec.outputs[n])]
    if miscounted:
        result.equal = False
        shown = ", ".join(f"{n} {len(got_rec.outputs.get(n, []))}x" for n in miscounted[:2])
        notes.append(f"{len(miscounted)}/{len(targets)} targets called other than eagerly ({shown}...)")
    for name in targets:
        pairs += [
            (f"{name}[{i}]", *pair)
            for i, pair in enumerate(zip(got_rec.outputs.get(name, []), want_rec.outputs[name]))
        ]
    for where, out, ref in pairs:
        diff = tensor_diff(out, ref)
        if isinstance(diff, str):
            result.equal = False
            notes.append(f"{where}: {diff}")
            continue
        if diff[0] / diff[1] >= result.diff / result.scale:
            result.diff, result.scale, result.worst = diff[0], diff[1], where
        result.equal = result.equal and diff[0] <= TOLERANCE * diff[1]
    result.note = "; ".join(filter(None, [result.note, *notes]))


@dataclass(frozen=True)
class Adapter:
    """How one tool traces and runs a model; ``evaluate`` does everything else the same way.

    Args:
        tool: key of ``TOOLS``.
        trace: ``(model, sample) -> (handle, subgraph count, note)``.
        run: ``(model, handle, inputs) -> output`` of the partitioned model.
        reference: ``model -> context`` the eager reference runs in: the settings the tool itself
            runs the model under (the peer forces eager attention and turns the KV cache off).
        setup_errors_are_na: a failure to build the model or run it eagerly means the zoo entry
            does not exist in this venv's transformers (the peer's older one): status ``"n/a"``.
    """

    tool: str
    trace: Callable[[Any, dict[str, Any]], tuple[Any, int, str]]
    run: Callable[[Any, Any, dict[str, Any]], Any]
    reference: Callable[[Any], contextlib.AbstractContextManager[Any]] = lambda _model: (
        contextlib.nullcontext()
    )
    setup_errors_are_na: bool = False


def evaluate(arch: str, adapter: Adapter) -> Result:
    """Build, trace and check one architecture with one tool.

    Args:
        arch: zoo key.
        adapter: the tool's trace and run calls.

    Returns:
        The filled ``Result``; failures are described in it, never raised.

    Example:
        >>> evaluate("llama", SEQCAL).equal  # doctest: +SKIP
        True
    """
    import torch
    import transformers

    sys.path.insert(0, str(REPO / "tests"))
    from zoo import ARCHS

    spec = ARCHS[arch]
    result = Result(arch, adapter.tool, spec.family, versions={"transformers": transformers.__version__})
    try:
        model = spec.build()
        sample, inputs = spec.make_inputs(model, **SAMPLE), spec.make_inputs(model, **CHECK)
        with torch.no_grad():
            default = primary_tensor(model(**inputs))
            with adapter.reference(model), recording(model) as want_rec:
                want = model(**inputs)
    except Exception as exc:  # noqa: BLE001 - any setup failure is reported, not raised
        result.status = "n/a" if adapter.setup_errors_are_na else "error"
        result.error = f"setup: {short_error(exc)}"
        return result
    targets, notes = _called_targets(model, spec, want_rec)
    result.expected = len(targets) + 1
    result.settings_diff = _settings_diff(primary_tensor(want), default, inputs)
    start = time.perf_counter()
    try:
        handle, result.count, note = adapter.trace(model, sample)
        result.traced = True
        notes.append(note)
    except Exception as exc:  # noqa: BLE001
        result.error = f"trace: {short_error(exc)}"
        return result
    finally:
        result.trace_s = round(time.perf_counter() - start, 2)
        result.note = "; ".join(filter(None, notes))
    try:
        with recording(model) as got_rec, torch.no_grad():
            got = adapter.run(model, handle, inputs)
        check(result, got, want, got_rec, want_rec, targets)
    except Exception as exc:  # noqa: BLE001
        result.equal, result.error = False, f"run: {short_error(exc)}"
    return result


def _settings_diff(want: Any, default: Any, inputs: dict[str, Any]) -> list[float]:
    """[diff, diff on unpadded tokens] between the tool-settings and default eager outputs, or []."""
    diff = tensor_diff(want, default)
    if isinstance(diff, str) or diff[0] <= TOLERANCE * diff[1]:
        return []
    mask = inputs.get("decoder_attention_mask", inputs.get("attention_mask"))
    if mask is None or tuple(want.shape[:2]) != tuple(mask.shape):
        return [diff[0], float("nan")]
    kept = mask.bool()  # [batch, seq]: real tokens only
    return [diff[0], (want[kept].float() - default[kept].float()).abs().max().item()]


def _called_targets(model: Any, spec: Any, rec: Recording) -> tuple[list[str], list[str]]:
    """Names of the zoo target modules the recorded forward called, and a note on a count mismatch."""
    classes = {spec.target_class, *spec.other_targets}
    names = [n for n in rec.outputs if type(model.get_submodule(n)).__name__ in classes]
    main = sum(type(model.get_submodule(n)).__name__ == spec.target_class for n in names)
    if main == spec.num_targets:
        return names, []
    return names, [f"forward calls {main} {spec.target_class}, zoo says {spec.num_targets}"]


def emit(result: Result) -> None:
    """Print the result as the marker line the orchestrator parses (last line of stdout)."""
    print(MARKER + json.dumps(asdict(result)), flush=True)
