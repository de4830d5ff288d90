"""Partition a traced graph into topologically ordered subgraphs around the sequential targets."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from torch import fx

from seqcal.tracing.values import SCOPE, OpaqueCall


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
        target_inputs: for subgraphs cut before their targets (``cut="before"``): the name of the cached
            value each target reads -> the targets reading it (q/k/v share one, gate/up another).
        kv_updates: attention modules whose KV-cache update this subgraph runs (set by the pipeline for a
            ``kv_cache_scheme`` in the one-pass cut): it calibrates their k_scale / v_scale, and holds them.
        by_rows: embeddings of ``modules`` it reads by rows, never onloaded whole (set by the pipeline:
            ``execution.embedding_rows``).
    """

    index: int
    nodes: list[fx.Node]
    targets: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    frees: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    returns: bool = False
    target_inputs: dict[str, list[str]] = field(default_factory=dict)
    kv_updates: list[str] = field(default_factory=list)
    by_rows: list[str] = field(default_factory=list)

    def holds(self, name: str) -> bool:
        """Whether module ``name`` is one of ``modules`` or inside one of them (``within``), or an attention
        module whose cache update it runs (``kv_updates``: its k_scale / v_scale are saved with the subgraph)."""
        return within(name, self.modules) or name in self.kv_updates


def within(name: str, modules: Collection[str]) -> bool:
    """Whether module ``name`` is one of ``modules`` or inside one of them.

    The root module ``""`` holds every module: a subgraph that uses it onloads every weight
    (``execution.weights.params_under``), so the checkpoint writes, and a replay puts back, every module with it.

    Args:
        name: a qualified module (or parameter) name.
        modules: qualified module names, as ``Subgraph.modules``.

    Returns:
        True when ``name`` is in ``modules``, starts with one of them and a dot, or ``modules`` holds ``""``.

    Example:
        >>> within("model.layers.0.mlp", ["model.layers.0"]), within("model.layers.00", ["model.layers.0"])
        (True, False)
        >>> within("lm_head", [""])
        True
    """
    if name in modules or "" in modules:
        return True
    return name.startswith(tuple(m + "." for m in modules))


class OnePassError(ValueError):
    """The graph cannot be cut before its targets; the message says why (the caller cuts after them)."""


def target_ends(nodes: Iterable[fx.Node], targets: Sequence[str]) -> dict[fx.Node, str]:
    """The node that ends each target: its call_module node, or for a target traced into (``trace_into``)
    the last node of its region (nodes whose ``meta["seqcal_module"]`` is the target or inside it).

    Args:
        nodes: a graph's nodes (``graph.nodes``) or a subgraph's (``Subgraph.nodes``), in order.
        targets: target module names.

    Returns:
        End node -> target name, in execution order.
    """
    target_set = set(targets)
    owners: dict[str, str | None] = {}  # scope -> the target it lies in, if any

    def owner(scope: str) -> str | None:
        if scope not in owners:
            parts = scope.split(".")
            prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
            owners[scope] = next((p for p in prefixes if p in target_set), None)
        return owners[scope]

    last: dict[str, fx.Node] = {}
    for node in nodes:
        if node.op == "call_module" and node.target in target_set:
            last[str(node.target)] = node
        elif node.op not in ("placeholder", "get_attr", "output") and (scope := node.meta.get(SCOPE)):
            if (target := owner(scope)) is not None:
                last[target] = node
    return {node: name for name, node in last.items()}


def _cut_points(graph: fx.Graph, targets: Sequence[str], targets_per_subgraph: int) -> list[list[fx.Node]]:
    """Node lists: each ends with its k-th target; what follows the last target is the final one."""
    ends = target_ends(graph.nodes, targets)
    groups: list[list[fx.Node]] = [[]]
    seen = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        groups[-1].append(node)
        if node in ends:
            seen += 1
            if seen % targets_per_subgraph == 0 or seen == len(targets):
                groups.append([])
    return groups


def _input_of(node: fx.Node) -> fx.Node | None:
    """The value a target module is called on (its first argument), when it is a graph value."""
    first = node.args[0] if node.args else next(iter(node.kwargs.values()), None)
    return first if isinstance(first, fx.Node) else None


def _cuts_before(graph: fx.Graph, targets: Sequence[str]) -> list[list[fx.Node]]:
    """Node lists: each (after the first) starts with a target and holds every later target on its input.

    Modules that read the same value (q/k/v on the normed hidden state, gate/up) stay in one group, so one
    Hessian serves them. Each target's input is then computed by an earlier group and reaches this one
    through the cache: calibration needs no forward pass of its own.

    Raises:
        OnePassError: a target is called more than once, or on a value that is not a graph value.
    """
    target_set = set(targets)
    groups: list[list[fx.Node]] = [[]]
    group_input: fx.Node | None = None
    calls: set[str] = set()
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "call_module" and node.target in target_set:
            name = str(node.target)
            if name in calls:
                raise OnePassError(f"{name} is called more than once in the graph")
            calls.add(name)
            source = _input_of(node)
            if source is None:
                raise OnePassError(f"{name} is not called on a traced value")
            if source is not group_input:
                groups.append([])
                group_input = source
        groups[-1].append(node)
    missing = [t for t in targets if t not in calls]
    if missing:
        raise OnePassError(
            f"{missing[0]} is traced into (not one call_module node), so nothing can cut before it"
        )
    return groups


def _modules_of(nodes: Sequence[fx.Node], module_names: dict[int, str]) -> list[str]:
    used: list[str] = []
    modules = set(module_names.values())
    parents = {m.rsplit(".", 1)[0] if "." in m else "" for m in modules if m}
    for node in nodes:
        if node.op == "call_module":
            used.append(str(node.target))
        elif node.op == "call_function" and isinstance(node.target, OpaqueCall):
            prefix = module_names.get(id(node.target.module), "")
            for attr in node.target.site.touched:
                name = f"{prefix}.{attr}" if prefix else attr
                if name in modules:
                    used.append(name)
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                # A module passed as a value (the attention module handed to sdpa_attention_forward) is
                # itself what is used; only a parameter or buffer stands for its owner. Its parent would
                # onload the whole layer for the q/k/v subgraph.
                # A parameter of a module that holds others (ZayaModel's input scale, beside its layers) stands
                # for itself: its owner would pull every layer into this subgraph.
                target = str(arg.target)
                owner = target.rsplit(".", 1)[0] if "." in target else ""
                used.append(target if target in modules or owner in parents else owner)
    return list(dict.fromkeys(used))


def partition(
    graph: fx.Graph,
    targets: Sequence[str],
    targets_per_subgraph: int = 1,
    module_names: dict[int, str] | None = None,
    cut: str = "after",
) -> list[Subgraph]:
    """Cut ``graph`` after every ``targets_per_subgraph``-th target; the tail after the last is its own.

    With N targets and k=1 this gives N+1 subgraphs: subgraph i ends with target i (the nodes between
    target i-1 and target i come with it), the last one holds what follows the last target (final norm,
    head, output). Values crossing a cut are listed as outputs/inputs; each is freed after its last reader.

    With ``cut="before"`` each subgraph after the first instead starts with a target (plus the later targets
    called on the same input) and ``target_inputs`` names the cached values those targets read: a modifier
    that needs only its modules' inputs (GPTQ, round to nearest) calibrates from the cache and the
    subgraph runs once, with the quantized weights (one forward pass per module instead of two).

    Args:
        graph: a traced graph (see ``seqcal.tracing.trace``).
        targets: target module names in execution order.
        targets_per_subgraph: how many targets share one subgraph.
        module_names: id(module) -> qualified name, to list the modules opaque nodes use.
        cut: "after" (targets end subgraphs) or "before" (targets start them; ``targets_per_subgraph`` 1).

    Returns:
        Subgraphs in execution order.

    Example:
        >>> subgraphs = partition(result.graph, result.targets)  # doctest: +SKIP
        >>> [len(s.targets) for s in subgraphs]  # doctest: +SKIP
        [1, 1, 1, 0]
    """
    if targets_per_subgraph < 1:
        raise ValueError(f"targets_per_subgraph must be >= 1, got {targets_per_subgraph}")
    if cut not in ("after", "before"):
        raise ValueError(f"cut={cut!r} is not one of ('after', 'before')")
    if cut == "before" and targets_per_subgraph != 1:
        raise ValueError(
            "cut='before' puts one group of targets in each subgraph; use targets_per_subgraph=1"
        )
    groups = (
        _cut_points(graph, targets, targets_per_subgraph) if cut == "after" else _cuts_before(graph, targets)
    )
    owner: dict[fx.Node, int] = {node: i for i, nodes in enumerate(groups) for node in nodes}
    target_set = set(targets)
    ends = target_ends(graph.nodes, targets)
    subgraphs = [
        Subgraph(
            index=i,
            nodes=nodes,
            targets=[ends[n] for n in nodes if n in ends],
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
    if cut == "before":
        for sg, nodes in zip(subgraphs, groups):
            for node in nodes:
                if node.op == "call_module" and node.target in target_set:
                    source = _input_of(node)
                    assert source is not None and source.name in sg.inputs, "checked by _cuts_before"
                    sg.target_inputs.setdefault(source.name, []).append(str(node.target))
    return subgraphs
