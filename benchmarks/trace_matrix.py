"""Side-by-side tracing coverage: seqcal vs llm-compressor 0.14 over the architecture zoo.

For every architecture of ``tests/zoo.py`` and every tool, a fresh subprocess (in that tool's venv)
builds the tiny model, traces it on ``make_inputs(batch=1, seq_len=12)``, then runs the partitioned
model on other inputs (``batch=2, seq_len=9, left_pad=3``) and compares the primary output (logits,
else last_hidden_state, else the first tensor) with eager ``model(**inputs)``: max abs diff
<= 1e-5 * max(1, |ref|max). The subgraph count is right when it equals the number of zoo target
modules (``target_class`` and ``other_targets`` instances) the forward calls, plus one.

The seqcal side runs in ``.venv`` (this file, ``--worker``); the peer side runs
``benchmarks/_peer_trace.py`` in ``.peer-venv`` (made by ``benchmarks/setup_peer.sh``). Both reuse
``evaluate`` below, so they differ only in the trace and run calls. This module imports only the
standard library and torch at top level, so the peer venv can import it.

Example:
    $ bash benchmarks/setup_peer.sh
    $ .venv/bin/python benchmarks/trace_matrix.py                 # plain table + totals
    $ .venv/bin/python benchmarks/trace_matrix.py --markdown      # markdown for RESULTS.md
    $ .venv/bin/python benchmarks/trace_matrix.py --archs llama t5 --json out/trace.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOOLS: dict[str, tuple[Path, Path]] = {
    # tool -> (python of its venv, worker script)
    "seqcal": (REPO / ".venv/bin/python", Path(__file__).resolve()),
    "peer": (REPO / ".peer-venv/bin/python", REPO / "benchmarks/_peer_trace.py"),
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


def _seqcal_trace(model: Any, sample: dict[str, Any]) -> tuple[Any, int, str]:
    from seqcal import trace_subgraphs

    subgraphs = trace_subgraphs(model, sample)
    return subgraphs, len(subgraphs), ""


SEQCAL = Adapter("seqcal", _seqcal_trace, lambda _model, subgraphs, inputs: subgraphs.run(**inputs))


def worker_main(arch: str, adapter: Adapter = SEQCAL) -> None:
    """Entry point of a worker process: print one result line; any crash becomes an ``error`` cell."""
    try:
        emit(evaluate(arch, adapter))
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        emit(Result(arch, adapter.tool, status="error", error=f"worker: {short_error(exc)}"))


# ------------------------------------------------------------------------------- orchestrator side


def run_cell(arch: str, tool: str, timeout: float) -> Result:
    """Run one worker subprocess for (arch, tool) and parse its result; crashes become errors."""
    python, script = TOOLS[tool]
    if not python.exists():
        hint = "bash benchmarks/setup_peer.sh" if tool == "peer" else "make venv"
        return Result(arch, tool, status="error", error=f"{python} missing; run `{hint}`")
    args = [str(python), str(script), "--worker", arch]
    # One thread per worker keeps CPU use moderate; the models are tiny anyway.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return Result(arch, tool, status="error", error=f"timeout after {timeout:.0f}s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            return Result(**json.loads(line[len(MARKER) :]))
    tail = (proc.stderr.strip().splitlines() or ["<no stderr>"])[-1]
    return Result(arch, tool, status="error", error=f"worker exit {proc.returncode}: {tail[:160]}")


def _traced(r: Result) -> str:
    if r.status == "n/a":
        return "n/a in transformers " + r.versions.get("transformers", "?")
    return "yes" if r.traced else "no: " + r.error.removeprefix("trace: ")


def _count(r: Result) -> str:
    if r.count is None:
        return "-"
    return "yes" if r.count == r.expected else f"no ({r.count}, want {r.expected})"


def _equal(r: Result) -> str:
    if r.equal is None:
        return "-"
    if r.error.startswith("run:"):
        return "no: " + r.error.removeprefix("run: ")
    via = "" if r.compared == "output" else f" (via {r.compared})"
    if r.equal:
        return "yes" + via
    if r.diff is None or r.diff <= TOLERANCE * (r.scale or 1.0):  # structural: see the notes
        return "no" + via
    return f"no{via}: diff {r.diff:.2g} (scale {r.scale:.2g}) at {r.worst}"


def _cells(r: Result) -> list[str]:
    return [_traced(r), _count(r), _equal(r)]


def totals(results: Sequence[Result]) -> dict[str, int]:
    """Counts for one tool: archs, n/a, traced, count right, output equal, all three right."""
    ok = [r for r in results if r.status != "n/a"]
    return {
        "archs": len(results),
        "n/a": len(results) - len(ok),
        "traced": sum(r.traced for r in ok),
        "count right": sum(r.count is not None and r.count == r.expected for r in ok),
        "output equal": sum(bool(r.equal) for r in ok),
        "all right": sum(r.traced and r.count == r.expected and bool(r.equal) for r in ok),
    }


def _settings_summary(tool: str, results: Sequence[Result]) -> str:
    """One line on how much the tool's run settings move the eager output (the reference it gets)."""
    moved = [r for r in results if r.settings_diff]
    if not moved:
        return ""
    worst = max(r.settings_diff[0] for r in moved)
    unpadded = max(
        (r.settings_diff[1] for r in moved if r.settings_diff[1] == r.settings_diff[1]), default=worst
    )
    return (
        f"{tool}: its run settings change the eager output in {len(moved)}/{len(results)} archs, by up to "
        f"{worst:.2g}, but by at most {unpadded:.2g} on unpadded tokens; each tool is compared with the "
        "unpartitioned model run under its own settings"
    )


def render(rows: dict[str, dict[str, Result]], markdown: bool) -> str:
    """The side-by-side table, totals and notes, as plain text or markdown."""
    tools = list(next(iter(rows.values())))
    head = ["arch", "family"] + [f"{t} {c}" for t in tools for c in ("traced", "count", "equal")]
    body = [
        [a, next(iter(c.values())).family or "-"] + [x for t in tools for x in _cells(c[t])]
        for a, c in rows.items()
    ]
    sums = {t: totals([c[t] for c in rows.values()]) for t in tools}
    notes = [f"{a} ({t}): {c[t].note}" for a, c in rows.items() for t in tools if c[t].note]
    notes += [_settings_summary(t, [c[t] for c in rows.values()]) for t in tools]
    notes = [n for n in notes if n]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(x.replace("|", "\\|") for x in row) + " |" for row in body]
        lines += ["", "| totals | " + " | ".join(tools) + " |", "|---|" + "---|" * len(tools)]
        lines += [f"| {k} | " + " | ".join(str(sums[t][k]) for t in tools) + " |" for k in sums[tools[0]]]
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
        return "\n".join(lines)
    widths = [max(len(str(row[i])) for row in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [head, *body]]
    lines += ["", "totals: " + "; ".join(f"{t}: {sums[t]}" for t in tools), ""]
    return "\n".join(lines + [f"note: {n}" for n in notes])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the matrix (one subprocess at a time) and print it; ``--worker`` runs one seqcal cell."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="ARCH", help=argparse.SUPPRESS)
    parser.add_argument("--archs", nargs="*", help="zoo keys (default: the whole zoo)")
    parser.add_argument("--tools", nargs="*", default=list(TOOLS), choices=list(TOOLS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per (arch, tool) subprocess")
    parser.add_argument("--markdown", action="store_true", help="print markdown for benchmarks/RESULTS.md")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    sys.path.insert(0, str(REPO / "tests"))
    from zoo import ARCHS

    archs = args.archs or list(ARCHS)
    unknown = sorted(set(archs) - set(ARCHS))
    if unknown:
        parser.error(f"unknown --archs {unknown}; valid: {sorted(ARCHS)}")
    rows: dict[str, dict[str, Result]] = {}
    for arch in archs:
        rows[arch] = {}
        for tool in args.tools:
            result = run_cell(arch, tool, args.timeout)
            result.family = result.family or ARCHS[arch].family
            rows[arch][tool] = result
            print(f"[{arch} / {tool}] {' | '.join(_cells(result))}", file=sys.stderr, flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({a: {t: asdict(r) for t, r in c.items()} for a, c in rows.items()}, indent=1)
        )
    print(render(rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
