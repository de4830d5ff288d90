"""The retry loop around ``SeqTracer``: trace, make the statement that failed opaque (or the module that
refused a node), trace again, until the trace passes or ``MAX_RETRACES`` attempts were made.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import fx

from seqcal.tracing.diagnostics import Problem, TracingError, locate, refusal
from seqcal.tracing.policy import LeafPolicy, ModuleRefused, StatementFailed, TraceState
from seqcal.tracing.sources import StmtId
from seqcal.tracing.tracer import SeqTracer

logger = logging.getLogger("seqcal")


# Distinct statements that fail symbolically (shared by all instances of a class) plus refused modules.
MAX_RETRACES = 256


def trace_with_retries(
    root: torch.nn.Module,
    tensors: dict[str, Any],
    constants: dict[str, Any],
    policy: LeafPolicy,
    ignored: frozenset[str],
    decide: frozenset[StmtId] = frozenset(),
) -> tuple[fx.Graph, SeqTracer, TraceState]:
    """Trace, turning every simple statement that fails symbolically into an opaque node, until it passes.

    ``decide``: statements whose runtime tests are decided on the sample, with guards (see ``decide.py``).

    Raises:
        TracingError: a statement that reaches a target failed; the error names file, line and fix.
    """
    state = TraceState(decide=set(decide))
    for _ in range(MAX_RETRACES):
        tracer = SeqTracer(policy, ignored, state)
        try:
            graph = tracer.trace_root(root, tensors, constants)
            return graph, tracer, state
        except StatementFailed as failed:
            state.force_opaque.add(failed.sid)
            state.failures[failed.sid] = f"{type(failed.cause).__name__}: {failed.cause}"
        except ModuleRefused as refused:
            policy.refused.add(type(refused.module))
            state.refusals.append(
                refusal(refused.name, refused.module, refused.cause, tracer.rewritten_files, root)
            )
            logger.warning("seqcal: %s", str(state.refusals[-1]).strip())
        except TracingError:
            raise
        except Exception as exc:
            raise TracingError([locate(exc, tracer.rewritten_files, root)]) from exc
    raise TracingError(
        [
            Problem(
                where=type(root).__qualname__,
                what=f"gave up after {MAX_RETRACES} retraces",
                fix="report a bug",
            )
        ]
    )
