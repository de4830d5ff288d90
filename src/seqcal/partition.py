"""Partition a traced graph into topologically ordered subgraphs around the sequential targets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import fx

from seqcal.tracing.values import OpaqueCall


@dataclass
class Subgraph:
    """A contiguous slice of the graph, run as one unit over all calibration batches.

    Attributes:
        index: position in execution order.
        nodes: the nodes it computes, in topological order (get_attr nodes are resolved where used).
        targets: qualified names of the target modules it calls.
        inputs: names of values it reads that earlier subgraphs (or the model inputs) produced.
        outputs: names of values it produces that later subgraphs read.
        frees: names of cached values whose last reader is this subgraph (dropped after it runs).
        modules: qualified names of the modules whose weights it uses (for onloading).
        returns: whether it holds the graph's output node.
    """

    index: int
    nodes: list[fx.Node]
    targets: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    frees: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    returns: bool = False


def _cut_points(graph: fx.Graph, targets: Sequence[str], targets_per_subgraph: int) -> list[list[fx.Node]]:
    """Node lists: each ends with its k-th target; what follows the last target is the final one."""
    target_set = set(targets)
    groups: list[list[fx.Node]] = [[]]
    seen = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        groups[-1].append(node)
        if node.op == "call_module" and node.target in target_set:
            seen += 1
            if seen % targets_per_subgraph == 0 or seen == len(targets):
                groups.append([])
    return groups


def _modules_of(nodes: Sequence[fx.Node], module_names: dict[int, str]) -> list[str]:
    used: list[str] = []
    for node in nodes:
        if node.op == "call_module":
            used.append(str(node.target))
        elif node.op == "call_function" and isinstance(node.target, OpaqueCall):
            prefix = module_names.get(id(node.target.module), "")
            for attr in node.target.site.touched:
                name = f"{prefix}.{attr}" if prefix else attr
                if name in module_names.values():
                    used.append(name)
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                used.append(str(arg.target).rsplit(".", 1)[0])
    return list(dict.fromkeys(used))


def partition(
    graph: fx.Graph,
    targets: Sequence[str],
    targets_per_subgraph: int = 1,
    module_names: dict[int, str] | None = None,
) -> list[Subgraph]:
    """Cut ``graph`` after every ``targets_per_subgraph``-th target; the tail after the last is its own.

    With N targets and k=1 this gives N+1 subgraphs: subgraph i ends with target i (the nodes between
    target i-1 and target i come with it), the last one holds what follows the last target (final norm,
    head, output). Values crossing a cut are listed as outputs/inputs; each is freed after its last reader.

    Args:
        graph: a traced graph (see ``seqcal.tracing.trace``).
        targets: target module names in execution order.
        targets_per_subgraph: how many targets share one subgraph.
        module_names: id(module) -> qualified name, to list the modules opaque nodes use.

    Returns:
        Subgraphs in execution order.

    Example:
        >>> subgraphs = partition(result.graph, result.targets)  # doctest: +SKIP
        >>> [len(s.targets) for s in subgraphs]  # doctest: +SKIP
        [1, 1, 1, 0]
    """
    if targets_per_subgraph < 1:
        raise ValueError(f"targets_per_subgraph must be >= 1, got {targets_per_subgraph}")
    groups = _cut_points(graph, targets, targets_per_subgraph)
    owner: dict[fx.Node, int] = {node: i for i, nodes in enumerate(groups) for node in nodes}
    target_set = set(targets)
    subgraphs = [
        Subgraph(
            index=i,
            nodes=nodes,
            targets=[str(n.target) for n in nodes if n.op == "call_module" and n.target in target_set],
            modules=_modules_of(nodes, module_names or {}),
            returns=any(n.op == "output" for n in nodes),
        )
        for i, nodes in enumerate(groups)
    ]
    last_use: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            continue
        produced_in = owner.get(node, -1)  # placeholders come from the batch, before subgraph 0
        readers = sorted({owner[user] for user in node.users if user in owner})
        for reader in readers:
            if reader != produced_in:
                subgraphs[reader].inputs.append(node.name)
        if readers and readers[-1] != produced_in:
            if produced_in >= 0:
                subgraphs[produced_in].outputs.append(node.name)
            last_use[node.name] = readers[-1]
    for name, index in last_use.items():
        subgraphs[index].frees.append(name)
    return subgraphs
