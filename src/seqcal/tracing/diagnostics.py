"""Errors that say where tracing failed, what went wrong and how to fix it (DESIGN invariant 2, style 9)."""

from __future__ import annotations

import linecache
import traceback
from dataclasses import dataclass

import torch

from seqcal.errors import SeqcalError


@dataclass(frozen=True)
class Problem:
    """One reason tracing cannot give a faithful partition."""

    where: str  # "file:line in Class.method" or a module's qualified name
    what: str
    fix: str
    source: str = ""  # the offending source line, when known

    def __str__(self) -> str:
        text = f"  - at {self.where}\n    what: {self.what}\n    fix:  {self.fix}"
        if self.source:
            text += f"\n    code: {self.source}"
        return text


class TracingError(SeqcalError, RuntimeError):
    """Tracing could not build a partition in which every target is its own call_module node."""

    def __init__(self, problems: list[Problem], model: str = "") -> None:
        self.problems = problems
        head = f"seqcal could not trace {model}" if model else "seqcal could not trace the model"
        super().__init__(f"{head} ({len(problems)} problem(s)):\n" + "\n".join(str(p) for p in problems))


def locate(exc: BaseException, rewritten_files: set[str], root: torch.nn.Module) -> Problem:
    """Turn an exception raised while tracing into a Problem naming the model source line that raised it.

    Rewritten forwards are compiled with their original file names and line numbers, so the deepest
    traceback frame in one of those files is the statement that failed.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    hit = next((f for f in reversed(frames) if f.filename in rewritten_files), None)
    if hit is None:
        hit = frames[-1] if frames else None
    where = f"{hit.filename}:{hit.lineno} in {hit.name}" if hit else type(root).__qualname__
    source = linecache.getline(hit.filename, hit.lineno).strip() if hit and hit.lineno else ""
    return Problem(
        where=where,
        what=f"{type(exc).__name__}: {exc}",
        fix=(
            "this statement reaches a sequential target, so it must be traced. Either choose "
            "sequential_targets that are called outside it, make the module that runs it a leaf "
            "(leaf_modules=[...]) if it need not be split, or pass the function it calls in ignore=[...] "
            "if that function does not call a target"
        ),
        source=source,
    )


def refusal(
    name: str, module: torch.nn.Module, cause: BaseException, rewritten_files: set[str], root: torch.nn.Module
) -> Problem:
    """Where tracing into an opened module failed (file:line of the statement), as a Problem."""
    if isinstance(cause, TracingError) and cause.problems:
        where, what, source = cause.problems[0].where, cause.problems[0].what, cause.problems[0].source
    else:
        found = locate(cause, rewritten_files, root)
        where, what, source = found.where, found.what, found.source
    kind = type(module).__name__
    return Problem(
        where=where,
        what=f"cannot trace into {name} ({kind}), so every {kind} stays one node: {what}",
        fix=(
            f"nothing to do unless you need the inside of {kind}: pass the function this line calls in "
            f"ignore=[...] to run it opaquely, or name {kind} in leaf_modules to keep it closed quietly"
        ),
        source=source,
    )
