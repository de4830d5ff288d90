"""Embeddings read by rows: a subgraph that looks its batch's tokens up in an embedding no modifier edits reads
only the rows the batch names, never the whole table.

A vocabulary is often a model's largest single weight (DeepSeek-V3's 129280 x 7168 is 1.85 GB in bf16; Gemma 3's
262144 rows are a third of its small models' weights), and one calibration batch names a few thousand of its
rows. ``mark_by_rows`` lists, per subgraph (``Subgraph.by_rows``), the embeddings read so:

- ``nn.Embedding``'s own forward, or a subclass's that only scales or normalizes what ``super().forward`` looks up
  (Gemma's and Bart's scaled embeddings), without ``max_norm`` (which writes the table), called as a module by
  the subgraph's nodes or its opaque statements and read otherwise by no subgraph;
- not quantized or pruned by a modifier, in a run whose every modifier declares it changes no other weight
  (``Needs.own_modules_only``: the quantizers and pruners; a fold or a rotation edits the embedding's table, and
  a user's modifier may, so such runs read every embedding whole).

``execution.cuts.onloaded_modules`` leaves them out of the subgraph's onload, and the memory plan with it. When
one runs with its weight on meta, the safety hook (``execution.weights``) calls ``lookup``: for that call a table
of just the rows its input names takes the weight's place, the input renumbered into it. The output is the
whole table's, bit for bit (a lookup copies rows; ``padding_idx`` acts only on gradients). The checkpoint
copies such a weight from its file in pieces (``checkpoint.host_tensors``).

Example:
    >>> mark_by_rows(model, subgraphs, modifiers)  # doctest: +SKIP
    >>> subgraphs[0].by_rows
    ['model.embed_tokens']
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import torch

from seqcal.execution.store import WeightStore
from seqcal.modifiers.contract import ModifierSet
from seqcal.tracing.partition import Subgraph, within
from seqcal.tracing.values import OpaqueCall


def reads_rows(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward only looks rows up in its weight (``_looks_up``), without ``max_norm``."""
    return isinstance(module, torch.nn.Embedding) and module.max_norm is None and _looks_up(type(module))


def _is_super_forward(node: ast.AST | None) -> bool:
    """Whether ``node`` is ``super().forward``."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "forward"
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "super"
        and not node.value.args
    )


@functools.cache
def _looks_up(cls: type) -> bool:
    """Whether ``cls.forward`` only looks its input up: ``nn.Embedding``'s own, or a subclass's whose input goes only
    to ``super().forward`` and that reads of the weight only its dtype (transformers' scaled embeddings, Gemma's
    and Bart's: ``super().forward(input_ids) * self.embed_scale``, and those that normalize the rows)."""
    if cls.forward is torch.nn.Embedding.forward:
        return True
    if "forward" not in cls.__dict__ or len(cls.__bases__) != 1:
        return "forward" not in cls.__dict__ and len(cls.__bases__) == 1 and _looks_up(cls.__bases__[0])
    try:
        function = ast.parse(textwrap.dedent(inspect.getsource(cls.forward))).body[0]
    except (OSError, TypeError, SyntaxError):  # no source: not known to only look up
        return False
    arguments = function.args if isinstance(function, ast.FunctionDef) else None
    if (
        arguments is None
        or arguments.vararg
        or arguments.kwarg
        or arguments.kwonlyargs
        or len(arguments.args) != 2
    ):
        return False
    ids = arguments.args[1].arg
    parent = {child: node for node in ast.walk(function) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and node.id == ids:
            call = parent.get(node)
            if not (isinstance(call, ast.Call) and call.args == [node] and not call.keywords):
                return False
            if not _is_super_forward(call.func):
                return False
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr in ("padding_idx", "num_embeddings", "max_norm", "forward"):
                return False
            if node.attr == "weight" and getattr(parent.get(node), "attr", None) != "dtype":
                return False
    return _looks_up(cls.__bases__[0])


def _only_called(code: str) -> set[str]:
    """The attributes of ``self`` that the statements ``code`` (an opaque site's) use only as what they call."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    called, other = set(), set()
    for node in ast.walk(tree):
        callee = node.func if isinstance(node, ast.Call) else None
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, ast.Attribute)
                and isinstance(child.value, ast.Name)
                and child.value.id == "self"
            ):
                (called if child is callee else other).add(child.attr)
    return called - other


def mark_by_rows(model: torch.nn.Module, subgraphs: Sequence[Subgraph], modifiers: Sequence[Any]) -> None:
    """Set each subgraph's ``by_rows``: the embeddings it reads by rows (the module docstring says which).

    An embedding is called by a call_module node, or by the statements of an opaque node (``self.embed_tokens(
    input_ids)`` in the model's forward, run as it is); any other use of it in any subgraph (a get_attr of its
    weight, the module passed or read in opaque statements) reads it whole.
    """
    mods = ModifierSet.of(modifiers)
    # a modifier may change other weights (a fold, a rotation): all read whole
    if not mods.own_modules_only():
        return
    edited, modules = {*mods.quantized(), *mods.pruned()}, dict(model.named_modules())
    names = {id(m): n for n, m in modules.items()}
    called: dict[int, list[str]] = {sg.index: [] for sg in subgraphs}
    other: set[str] = set()  # modules used otherwise than called
    for sg in subgraphs:
        for node in sg.nodes:
            for arg in (node, *node.all_input_nodes):  # get_attr nodes are resolved where they are used
                if arg.op == "get_attr":
                    other.update({str(arg.target), str(arg.target).rpartition(".")[0]})
            if node.op == "call_module":
                called[sg.index].append(str(node.target))
            elif node.op == "call_function" and isinstance(node.target, OpaqueCall):
                prefix, site = names.get(id(node.target.module), ""), node.target.site
                only = _only_called(site.code)
                for attr in site.touched:
                    name = f"{prefix}.{attr}" if prefix else attr
                    (called[sg.index].append if attr in only else other.add)(name)
    for sg in subgraphs:
        sg.by_rows = [
            name
            for name in dict.fromkeys(called[sg.index])
            if name not in other
            and name not in edited
            and not within(name, sg.targets)
            and name in modules
            and reads_rows(modules[name])
        ]


def lookup(
    module: torch.nn.Embedding, name: str, store: WeightStore, device: torch.device, args: tuple
) -> tuple[tuple, Callable[[], None]] | None:
    """For one call of embedding ``module`` (qualified ``name``, its weight on meta): the rows ``args[0]`` names,
    read from ``store``, in the weight's place, and ``args`` with the ids renumbered into them.

    Returns:
        The call's arguments and what puts the module back after it; None when the input is not a tensor of ids
        inside the table (the caller onloads the whole weight, and the lookup fails as it would).
    """
    ids = args[0] if args else None
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex():
        return None
    rows, index = torch.unique(ids, sorted=True, return_inverse=True)
    if rows.numel() and (rows[0] < 0 or rows[-1] >= module.num_embeddings):
        return None
    weight, padding_idx = module.weight, module.padding_idx
    table = store.read_rows(f"{name}.weight" if name else "weight", rows.to("cpu", torch.int64))
    # the weight's dtype, as onloading gives it (accelerate casts a value to its parameter's dtype)
    module._parameters["weight"] = torch.nn.Parameter(table.to(device, weight.dtype), requires_grad=False)
    module.padding_idx = None  # it names a row of the whole table; a forward pass never reads it

    def restore() -> None:
        module._parameters["weight"], module.padding_idx = weight, padding_idx

    return (index, *args[1:]), restore
