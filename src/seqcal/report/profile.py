"""A Chrome-trace profiler for the calibration loop: where time and memory went, per subgraph and stage.

``Profiler(path)`` records complete events (``"ph": "X"``) on one track per stage, and after each span the
host resident memory and the device's allocated memory as counter events (``"ph": "C"``). ``close()`` writes
``{"traceEvents": [...], "displayTimeUnit": "ms"}``, which chrome://tracing and ui.perfetto.dev open.
``Profiler(None)`` (or ``NullProfiler()``) records nothing: ``span`` returns one shared no-op context
manager, so the executor can always call it.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import psutil
import torch

TRACKS = (
    "onload",
    "calibration",
    "compress",
    "propagation",
    "cache",
    "offload",
    "save",
    "write",
    "verify",
    "communication",
)
# Tracks whose spans do not synchronize the device: cache spans (see _now_us) and the checkpoint's writes on
# a worker thread (host files only; a synchronize there would wait for the calibration's kernels).
UNSYNCED = ("cache", "write")
CACHE_COUNTER_INTERVAL_US = 1000  # cache spans are many and short: sample memory after them at most per ms
_MIB = 1 << 20


class _Discard:
    """What a disabled span yields: writes of extra args (``s["bytes"] = n``) go nowhere."""

    __slots__ = ()

    def __setitem__(self, key: str, value: Any) -> None:
        pass

    def update(self, *args: Any, **kwargs: Any) -> None:
        pass


class _NoSpan:
    """The shared no-op span of a disabled profiler: entering and leaving it does nothing."""

    __slots__ = ()

    def __enter__(self) -> _Discard:
        return _DISCARD

    def __exit__(self, *exc: object) -> None:
        return None


_DISCARD = _Discard()
NO_SPAN = _NoSpan()


class _Span:
    __slots__ = ("profiler", "track", "name", "args", "start")

    def __init__(self, profiler: Profiler, track: str, name: str, args: dict[str, Any]) -> None:
        self.profiler, self.track, self.name, self.args, self.start = profiler, track, name, args, 0

    def __enter__(self) -> dict[str, Any]:
        self.profiler._open(self)
        return self.args

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            self.args["error"] = exc_type.__name__
        self.profiler._close(self)


class Profiler:
    """Collects Chrome trace events; ``Profiler(None)`` is disabled and costs nothing measurable.

    Args:
        path: the JSON file ``close()`` writes; None disables the profiler.

    Example:
        >>> with Profiler("trace.json") as prof:  # doctest: +SKIP
        ...     with prof.span("calibration", "subgraph 3", subgraph=3) as args:
        ...         args["batches"] = 64
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = None if path is None else Path(path)
        self.events: list[dict[str, Any]] = []
        self._open_spans: dict[str, str] = {}  # track -> name of its open span
        self._origin = time.perf_counter_ns()
        self._last_counter_us = -CACHE_COUNTER_INTERVAL_US
        self._closed = False
        self._process = psutil.Process() if self.path is not None else None
        self._cuda = self.path is not None and torch.cuda.is_available()
        if self.path is not None:
            self.events.append({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "seqcal"}})
            for tid, track in enumerate(TRACKS, start=1):
                self.events.append(
                    {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}}
                )
                self.events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
                                    "args": {"sort_index": tid}})  # fmt: skip

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profiler:
        """A closed profiler holding the events of a trace file ``close()`` wrote, e.g. to print ``summary()``.

        Example:
            >>> print(Profiler.load("trace.json").summary(report))  # doctest: +SKIP
        """
        prof = cls(path)
        try:
            prof.events = json.loads(Path(path).read_text())["traceEvents"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"Profiler.load: {path} is not a Chrome trace written by Profiler.close ({err})"
            ) from err
        prof._closed = True
        return prof

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def span(self, track: str, name: str, **args: Any) -> AbstractContextManager[Any]:
        """A context manager timing one stage; yields its ``args`` dict to add values known at the end.

        Args:
            track: one of ``TRACKS``; spans on one track never overlap (nesting on a track raises).
            name: the event's name, e.g. ``"subgraph 3"`` or a module name.
            **args: shown with the event (``subgraph=3``, ``bytes=...``); ``subgraph`` groups ``summary()``.
        """
        if self.path is None:
            return NO_SPAN
        if track not in TRACKS:
            raise ValueError(f"Profiler.span: track {track!r} is not one of {list(TRACKS)}")
        return _Span(self, track, name, args)

    def _now_us(self, track: str) -> int:
        # The host clock only means something once queued kernels finished: synchronize, except around cache
        # spans (tens of thousands of them): syncing those stalled host and device, +15% of a GPTQ run on an
        # H200 (benchmarks/RESULTS.md). A cache span is the host time to queue its copies; the device time of
        # the copies lands in the enclosing stage's span, which does synchronize.
        if self._cuda and track not in UNSYNCED:
            torch.cuda.synchronize()
        # Integer microseconds: a span's end (ts + dur) is then exactly comparable to the next start.
        return (time.perf_counter_ns() - self._origin) // 1000

    def _open(self, span: _Span) -> None:
        if self._closed:
            raise RuntimeError(f"Profiler.span({span.track!r}, {span.name!r}): the profiler is closed")
        if span.track in self._open_spans:
            raise RuntimeError(
                f"Profiler.span({span.track!r}, {span.name!r}): track {span.track!r} already has the open "
                f"span {self._open_spans[span.track]!r}; spans on one track must not overlap: put the inner "
                "one on another track"
            )
        self._open_spans[span.track] = span.name
        span.start = self._now_us(span.track)

    def _close(self, span: _Span) -> None:
        end = self._now_us(span.track)
        del self._open_spans[span.track]
        self.events.append({"name": span.name, "cat": span.track, "ph": "X", "ts": span.start,
                            "dur": end - span.start, "pid": 1, "tid": TRACKS.index(span.track) + 1,
                            "args": span.args})  # fmt: skip
        if span.track != "cache" or end - self._last_counter_us >= CACHE_COUNTER_INTERVAL_US:
            self._sample_memory(end)

    def _sample_memory(self, ts: int) -> None:
        assert self._process is not None
        self._last_counter_us = ts
        rss = self._process.memory_info().rss / _MIB
        self.events.append({"name": "host RSS (MiB)", "ph": "C", "ts": ts, "pid": 1, "args": {"rss": rss}})
        # "peak": the process's peak so far (torch's, never reset here): the span where it last rises holds the
        # run's peak device memory, which the samples between spans miss
        if self._cuda:
            dev, peak = torch.cuda.memory_allocated() / _MIB, torch.cuda.max_memory_allocated() / _MIB
            self.events.append({"name": "device memory (MiB)", "ph": "C", "ts": ts, "pid": 1,
                                "args": {"allocated": dev, "peak": peak}})  # fmt: skip

    def close(self) -> Path | None:
        """Write the trace JSON (once; later calls do nothing). Returns the path, None when disabled."""
        if self.path is None or self._closed:
            return self.path
        self._closed = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}, default=str))
        os.replace(tmp, self.path)  # a viewer never opens a half-written trace
        return self.path

    def __enter__(self) -> Profiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def summary(self, report: Mapping[str, Any] | None = None, top: int = 10) -> str:
        """Per subgraph: wall time, time per track, peak host RSS and device memory; then top GPTQ modules.

        Args:
            report: the run report ``{"subgraphs": [{index, targets, rel_error, seconds}], "modules": {name:
                {"gptq_loss", "gptq_seconds"}}}`` (optional) for target names and per-module GPTQ times.
            top: how many modules to list.

        Returns:
            The table text ("" when disabled).
        """
        if self.path is None:
            return ""
        rows = _per_subgraph(self.events)
        names = {
            r.get("index"): ", ".join(r.get("targets") or []) for r in (report or {}).get("subgraphs") or []
        }
        # verify: once per run, not per subgraph; write: on a worker thread while the next subgraph runs
        tracks = [t for t in TRACKS if t not in ("save", "write", "verify")]
        head = f"{'#':>3}  {'target':<24} {'wall s':>8} " + " ".join(f"{t[:8]:>8}" for t in tracks)
        lines = [head + f" {'RSS MiB':>9} {'dev MiB':>9}"]
        for index, row in sorted(rows.items()):
            cells = " ".join(f"{row['tracks'].get(t, 0.0):>8.3f}" for t in tracks)
            lines.append(f"{index:>3}  {(names.get(index) or '-')[:24]:<24} {row['wall']:>8.3f} {cells} "
                         f"{_num(row['rss']):>9} {_num(row['dev']):>9}")  # fmt: skip
        peak = _device_peak(self.events)
        if peak is not None:
            mib, span = peak
            where = f"in {span['cat']} of subgraph {span['args']['subgraph']}" if span else "between spans"
            lines.append(f"peak device memory {mib:.0f} MiB, reached {where}")
        written = [e for e in self.events if e.get("ph") == "X" and e.get("cat") == "write"]
        if written:  # the streaming checkpoint's files, after each subgraph (checkpoint.streaming)
            saves = [e for e in self.events if e.get("ph") == "X" and e.get("cat") == "save" and "subgraph" in
                     e.get("args", {})]  # fmt: skip
            waited = sum(_float(e.get("args", {}).get("waited_s")) for e in saves)
            seconds = sum(e["dur"] for e in written) / 1e6
            where = ("on a worker thread" if all(e.get("args", {}).get("worker") for e in written)
                     else "by the calibration's thread, inside its save spans")  # fmt: skip
            lines.append(f"checkpoint files of {len(written)} subgraphs written {where}: {seconds:.3f} s; save "
                         f"spans {sum(e['dur'] for e in saves) / 1e6:.3f} s, {waited:.3f} s of it waiting for the "
                         "worker")  # fmt: skip
        checked = sum(e["dur"] for e in self.events if e.get("ph") == "X" and e.get("cat") == "verify") / 1e6
        if checked:
            lines.append(f"partition checked against the model's forward before calibrating: {checked:.3f} s")
        modules = [(n, m) for n, m in ((report or {}).get("modules") or {}).items() if isinstance(m, Mapping)]
        ranked = sorted(modules, key=lambda kv: _float(kv[1].get("gptq_seconds")), reverse=True)[:top]
        if ranked:
            lines += [
                "",
                f"top {len(ranked)} modules by GPTQ time:",
                f"{'module':<48} {'GPTQ s':>8} {'loss':>10}",
            ]
            for name, m in ranked:
                lines.append(
                    f"{name:<48} {_float(m.get('gptq_seconds')):>8.3f} {_num(m.get('gptq_loss'), '.4g'):>10}"
                )
        return "\n".join(lines)


class NullProfiler(Profiler):
    """A disabled profiler: ``span`` always returns the same no-op context manager."""

    def __init__(self) -> None:
        super().__init__(None)

    def span(self, track: str, name: str, **args: Any) -> AbstractContextManager[Any]:
        return NO_SPAN


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (nested tuples, lists, dicts): what a cache fetch or put moved.

    Example:
        >>> tensor_bytes({"h": torch.zeros(2, 3), "mask": None})
        24
    """
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, Mapping):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def _per_subgraph(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Subgraph -> wall seconds (first start to last end), seconds per track, peak RSS / device MiB."""
    rows: dict[int, dict[str, Any]] = {}
    for e in events:
        index = e.get("args", {}).get("subgraph") if e["ph"] == "X" else None
        if not isinstance(index, int):
            continue
        row = rows.setdefault(
            index, {"start": e["ts"], "end": e["ts"], "tracks": {}, "rss": None, "dev": None}
        )
        row["start"], row["end"] = min(row["start"], e["ts"]), max(row["end"], e["ts"] + e["dur"])
        row["tracks"][e["cat"]] = row["tracks"].get(e["cat"], 0.0) + e["dur"] / 1e6
    for row in rows.values():
        row["wall"] = (row["end"] - row["start"]) / 1e6
    for e in events:
        if e["ph"] != "C":
            continue
        key, value = (
            ("rss", e["args"].get("rss")) if "rss" in e["args"] else ("dev", e["args"].get("allocated"))
        )
        for row in rows.values():
            if row["start"] <= e["ts"] <= row["end"]:
                row[key] = value if row[key] is None else max(row[key], value)
    return rows


def _device_peak(events: list[dict[str, Any]]) -> tuple[float, dict[str, Any] | None] | None:
    """(the run's peak device MiB, the subgraph span it was reached in, or None), from the device counter's
    running peak (``peak``; absent from traces of older versions and without CUDA: then None).

    A sample is taken as a span closes, so the first sample at the final peak names the span that reached it:
    the innermost subgraph span ending at that instant (a cache span inside a stage closes first)."""
    samples = [e for e in events if e["ph"] == "C" and "peak" in e.get("args", {})]
    if not samples:
        return None
    top = max(e["args"]["peak"] for e in samples)
    ts = min(e["ts"] for e in samples if e["args"]["peak"] == top)
    spans = [e for e in events if e["ph"] == "X" and isinstance(e.get("args", {}).get("subgraph"), int)]
    ending = [e for e in spans if e["ts"] + e["dur"] == ts]
    return top, min(ending, key=lambda e: e["dur"]) if ending else None


def _float(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return 0.0
    return out if math.isfinite(out) else 0.0


def _num(value: Any, spec: str = ".0f") -> str:
    if value is None:
        return "-"
    try:
        return format(float(value), spec)
    except (TypeError, ValueError):
        return str(value)
