"""The graph interpreter: runs a subgraph's fx nodes against a model, each value dropped after its last read.

It lives beside the graph (``partition.Subgraph``) so that the tracer (the decisions of ``decide``), the
partition checks, the graph report and the executor all run subgraphs with it; none of them imports the
others for it.

Example:
    >>> runner = GraphRunner(model)  # doctest: +SKIP
    >>> env = {name: value for name, value in inputs.items()}  # doctest: +SKIP
    >>> out = runner.run(subgraph, env, release=())  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.immutable_collections import immutable_dict, immutable_list

from seqcal.backend import linears_on_onednn
from seqcal.errors import SeqcalError
from seqcal.tracing.partition import Subgraph
from seqcal.tracing.values import OpaqueCall

__all__ = ["GraphRunner", "SubgraphExecutionError"]


class SubgraphExecutionError(RuntimeError):
    """A node failed while running a subgraph; the message names the subgraph, node and source."""


def _describe(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, OpaqueCall):
        site = target.site
        return f"opaque code of {site.owner} at {site.filename}:{site.lineno} (`{site.source}`)"
    name = getattr(target, "__qualname__", None) or str(target)
    return f"{node.op} {name}"


class GraphRunner:
    """Evaluates a subgraph's nodes against a model; modules and attributes are resolved at run time.

    Resolution at run time (not at trace time) is what lets weights be offloaded and swapped in between.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | str | None = None) -> None:
        self.model = model
        # a calibration's execution device: float32 Linears on the CPU run on oneDNN there (algorithms.products);
        # None keeps torch's kernels (SubgraphList.run, the partition checks: the same bits as eager)
        self.device = device
        self._modules = dict(model.named_modules())
        # id(subgraph) -> (the subgraph, what it keeps, node position -> values last read there)
        self._releases: dict[int, tuple[Subgraph, frozenset[str], dict[int, list[str]]]] = {}

    def attr(self, qualname: str) -> Any:
        owner, _, leaf = qualname.rpartition(".")
        return getattr(self._modules[owner] if owner else self.model, leaf) if leaf else self.model

    def run(self, subgraph: Subgraph, env: dict[str, Any], until: str | None = None,
            release: Sequence[str] | None = None) -> Any:  # fmt: skip
        """Compute ``subgraph``'s nodes into ``env`` (which holds its inputs), or those up to the node named
        ``until``; returns the graph output if any.

        With ``release`` (names to keep besides the subgraph's outputs), each value is dropped from ``env`` after
        the node that reads it last, its inputs' included, as eager code frees its temporaries: the values alive
        at once are those still to be read, not every value the subgraph made (an MLP's gate, up, activation and
        product of a whole batch, on a GPU beside the solve's memory). Without it ``env`` ends with every value,
        for callers that read them afterwards (the memory plan's measurement, the tracer's decisions).
        """
        releases = None if release is None else self._last_reads(subgraph, release)
        with linears_on_onednn(self.device):
            return self._run(subgraph, env, until, releases)

    def _last_reads(self, subgraph: Subgraph, keep: Sequence[str]) -> dict[int, list[str]]:
        """Node position -> the values of ``env`` last read by the node there (kept ones and outputs excepted).

        A value no node of the subgraph reads goes right after it is made. Worked out once per subgraph.
        """
        protected = frozenset((*getattr(subgraph, "outputs", ()), *keep))
        cached = self._releases.get(id(subgraph))
        if cached is not None and cached[0] is subgraph and cached[1] == protected:
            return cached[2]
        last: dict[str, int] = {}
        for i, node in enumerate(subgraph.nodes):
            last.setdefault(node.name, i)  # made here; read later (below) or by no one
            for read in node.all_input_nodes:
                last[read.name] = i
        releases: dict[int, list[str]] = {}
        for name, i in last.items():
            if name not in protected:
                releases.setdefault(i, []).append(name)
        self._releases[id(subgraph)] = (subgraph, protected, releases)
        return releases

    def _run(self, subgraph: Subgraph, env: dict[str, Any], until: str | None,
             releases: dict[int, list[str]] | None) -> Any:  # fmt: skip
        result = None
        for i, node in enumerate(subgraph.nodes):
            args = self._load(node.args, env)
            kwargs = self._load(node.kwargs, env)
            try:
                if node.op == "output":
                    result = args[0]
                else:
                    env[node.name] = self._call(node, args, kwargs)
            except SeqcalError:
                raise  # says itself what is wrong and what to do (a guard of the trace, say)
            except Exception as exc:
                raise SubgraphExecutionError(
                    f"subgraph {subgraph.index} failed at node {node.name!r} ({_describe(node)}): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if node.name == until:
                return None
            del args, kwargs  # this node's operands: referenced no more than the values still in env
            if releases is not None:
                for name in releases.get(i, ()):
                    env.pop(name, None)
        return result

    def _load(self, arg: Any, env: dict[str, Any]) -> Any:
        """Replace nodes by their values; fx's immutable containers become plain ones, as eager code has."""
        if isinstance(arg, fx.Node):
            return self.attr(str(arg.target)) if arg.op == "get_attr" else env[arg.name]
        if isinstance(arg, dict) and type(arg) in (dict, immutable_dict):
            return {k: self._load(v, env) for k, v in arg.items()}
        if type(arg) in (list, immutable_list):
            return [self._load(v, env) for v in arg]
        if type(arg) is tuple:
            return tuple(self._load(v, env) for v in arg)
        if isinstance(arg, slice):
            return slice(self._load(arg.start, env), self._load(arg.stop, env), self._load(arg.step, env))
        return arg

    def _call(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        if node.op == "call_module":
            return self._modules[str(node.target)](*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)  # type: ignore[operator]
        if node.op == "call_method":
            obj, *rest = args
            return getattr(obj, str(node.target))(*rest, **kwargs)
        raise AssertionError(f"unexpected node op {node.op!r}")
