r"""Reading transformers' attention through its KV-cache write, for the smoothing mappings (``seqcal.mappings``).

HF attention forwards write this layer's keys and values to the cache in a statement tracing keeps opaque
(``if cache is not None: key_states, value_states = cache.update(key_states, value_states, ...)``). The write
appends positions and never mixes or rescales channels, so ``v_proj -> attention -> o_proj`` is a mapping
through it, provided each kv head serves one query head (grouped kv heads repeat v_proj's rows, which a
per-channel scale of v_proj cannot follow in o_proj's columns; llm-compressor skips that case too).

Example:
    >>> cache_write_names("if cache is not None:\n    k, v = cache.update(k, v, self.layer_idx)")
    ('k', 'v')
"""

from __future__ import annotations

import ast
from typing import Any

from torch import fx


def kv_groups(module: Any, modules: dict) -> int:
    """Query heads per kv head of an HF attention module (``num_key_value_groups``; 1 when it has none).

    Args:
        module: the attention call's module argument (a ``get_attr`` node), or anything else.
        modules: the model's ``named_modules()`` as a dict.

    Returns:
        The number of query heads that read each kv head (1: plain multi-head attention or unknown).

    Example:
        >>> kv_groups(node.args[0], dict(model.named_modules()))  # doctest: +SKIP
        2
    """
    attention = (
        modules.get(str(module.target)) if isinstance(module, fx.Node) and module.op == "get_attr" else None
    )
    groups = getattr(attention, "num_key_value_groups", 1)
    return groups if isinstance(groups, int) else 1


def cache_write_input(node: fx.Node) -> fx.Node | None:
    """``getitem(opaque, i)`` where the opaque statement is a KV-cache write (:func:`cache_write_names`) and item
    ``i`` is the keys or values it hands back: the node of the keys or values written, else None.

    The write appends this layer's keys and values to its cache along the sequence and returns them with the
    past ones: positions are added, channels are neither mixed nor rescaled, and the past entries came from the
    same Linear (scaled by the same fold), so a per-channel scale passes through it.

    Args:
        node: a ``getitem`` node of the traced graph.

    Returns:
        The node of the keys or values the write was given (the tensor to follow back), or None.

    Example:
        >>> cache_write_input(value_node)  # doctest: +SKIP
    """
    opaque, index = node.args
    site = getattr(getattr(opaque, "target", None), "site", None) if isinstance(opaque, fx.Node) else None
    if site is None or not isinstance(index, int) or index >= len(site.outputs):
        return None
    if len(opaque.args) != len(site.inputs) or site.outputs[index] not in cache_write_names(site.code):
        return None
    value = opaque.args[site.inputs.index(site.outputs[index])]
    return value if isinstance(value, fx.Node) else None


def cache_write_names(code: str) -> tuple[str, ...]:
    r"""The names a KV-cache write statement rebinds to what the cache returns for them, else ().

    Recognized: transformers' ``if cache is not None: key_states, value_states = cache.update(key_states,
    value_states, self.layer_idx, ...)`` (any names; a ``cache_kwargs = {...}`` before the update is allowed).

    Example:
        >>> cache_write_names("if cache is not None:\n    k, v = cache.update(k, v, self.layer_idx)")
        ('k', 'v')
    """
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return ()
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.If) or tree.body[0].orelse:
        return ()
    test, body = tree.body[0].test, tree.body[0].body
    is_not_none = (
        isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and len(test.ops) == 1
        and isinstance(test.ops[0], ast.IsNot) and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    )  # fmt: skip
    if not is_not_none:
        return ()
    cache = test.left.id  # type: ignore[union-attr]
    writes = [stmt for stmt in body if not _is_kwargs_dict(stmt)]
    if len(writes) != 1 or not isinstance(writes[0], ast.Assign) or len(writes[0].targets) != 1:
        return ()
    target, call = writes[0].targets[0], writes[0].value
    if not (isinstance(target, ast.Tuple) and isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr == "update" and isinstance(call.func.value, ast.Name)
            and call.func.value.id == cache):  # fmt: skip
        return ()
    names = [t.id for t in target.elts if isinstance(t, ast.Name)]
    passed = [a.id for a in call.args[: len(target.elts)] if isinstance(a, ast.Name)]
    return tuple(names) if len(names) == len(target.elts) >= 2 and names == passed else ()


def _is_kwargs_dict(stmt: ast.stmt) -> bool:
    """``cache_kwargs = {...}``: the cache's arguments, built before the update (older transformers)."""
    return (
        isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
        and isinstance(stmt.value, ast.Dict)
    )  # fmt: skip
