"""Explicit smoothing mappings (a recipe's ``mappings``): SmoothQuant's ``[[balance regexes], smooth regex]`` pairs
and AWQ's ``{smooth_layer, balance_layers}`` dicts, matched to module names and checked like the derived ones.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from seqcal.mappings.graph import (
    _is_norm,
    norm_fold_reason,
)
from seqcal.mappings.names import checkpoint_names
from seqcal.records import Mapping


def matches(pattern: str, name: str, module: torch.nn.Module, alias: str | None = None) -> bool:
    """A recipe pattern against a module: ``re:`` regex (``re.match`` on the qualified name), exact name,
    or class name (llm-compressor's rule for mappings, targets and ignore). ``alias`` is the module's name in
    the checkpoint when transformers renamed it at load (``seqcal.mappings.names``); either name matches."""
    names = (name,) if alias is None else (name, alias)
    if pattern.startswith("re:"):
        return any(re.match(pattern[3:], n) is not None for n in names)
    return pattern in names or type(module).__name__ == pattern


def _pairs(explicit: Sequence[Any], who: str) -> list[tuple[list[str], str]]:
    """(balance regexes, smooth regex) from SmoothQuant's lists or AWQ's dicts."""
    out = []
    for entry in explicit:
        if isinstance(entry, dict) and "smooth_layer" in entry and "balance_layers" in entry:
            out.append((list(entry["balance_layers"]), str(entry["smooth_layer"])))
        elif isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str):
            balance = entry[0] if isinstance(entry[0], (list, tuple)) else [entry[0]]
            out.append(([str(b) for b in balance], entry[1]))
        else:
            raise ValueError(
                f"{who}: mapping {entry!r} is neither [[balance regexes], smooth regex] nor "
                "{smooth_layer: regex, balance_layers: [regexes]}; write it in one of those forms"
            )
    return out


def common_depth(a: str, b: str) -> int:
    """Number of leading dotted components ``a`` and ``b`` share (the scope rule of explicit mappings)."""
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n


def explicit_mappings(
    model: torch.nn.Module, explicit: Sequence[Any], who: str = "mappings"
) -> list[Mapping]:
    """Resolve a recipe's mappings against ``model``; each smooth match gets the balance matches of its scope.

    Raises:
        ValueError (one sentence): a regex that matches no module, a producer that is neither a norm nor a
            Linear, an offset norm, or consumers of different input widths.
    """
    named, aliases = list(model.named_modules()), checkpoint_names(model)
    arch = type(model).__name__
    out = []
    for balance, smooth in _pairs(explicit, who):
        producers = [(n, m) for n, m in named if matches(smooth, n, m, aliases.get(n))]
        for pattern in [smooth, *balance]:
            if not any(matches(pattern, n, m, aliases.get(n)) for n, m in named):
                raise ValueError(
                    f"{who}: {pattern!r} matches no module of {arch}; fix the regex (module names look like "
                    f"{named[-2][0]!r}) or leave mappings unset to derive them from the traced graph"
                )
        for pname, pmod in producers:
            consumers = []
            for pattern in balance:
                hits = [n for n, m in named if matches(pattern, n, m, aliases.get(n)) and n != pname]
                best = max((common_depth(pname, n) for n in hits), default=0)
                consumers += [n for n in hits if common_depth(pname, n) == best and n not in consumers]
            out.append(_checked(model, pname, pmod, tuple(consumers), who))
    return out


def _checked(model: torch.nn.Module, pname: str, pmod: torch.nn.Module, consumers: tuple[str, ...],
             who: str) -> Mapping:  # fmt: skip
    arch = type(model).__name__
    widths = {c: model.get_submodule(c).weight.shape[-1] for c in consumers}
    if len(set(widths.values())) != 1:
        raise ValueError(
            f"{who}: the consumers of {pname} in {arch} read inputs of different widths ({widths}); one mapping "
            "must list Linears that read the same tensor, e.g. [q_proj, k_proj, v_proj] or [gate_proj, up_proj]"
        )
    if _is_norm(pmod):
        if reason := norm_fold_reason(pmod):
            raise ValueError(f"{who}: {pname} in {arch}: {reason}; remove this mapping")
        return Mapping(pname, consumers, "norm")
    if isinstance(pmod, torch.nn.Linear):
        return Mapping(pname, consumers, "linear")
    raise ValueError(
        f"{who}: smooth layer {pname} in {arch} is a {type(pmod).__name__}, neither a norm nor a Linear; "
        "point the smooth regex at the norm or Linear whose output the balance layers read"
    )
