"""A griffe extension for what seqcal's house style writes and griffe's Google-style parser reads otherwise.

- ``Example:`` heads the doctests (Napoleon and the Google guide accept it; griffe knows only ``Examples:``).
- ``Args (a note):``, e.g. ``Args (llm-compressor's names):``, says where the arguments come from: the note
  becomes a sentence before a plain ``Args:`` section.
- ``a, b, c: what they do`` documents several arguments at once; each gets its own entry, so the reference's
  table gives each its type and default (a parenthetical after a name moves into the description).
- A dataclass field's ``field(default_factory=lambda: [...])`` (or ``=list``) shows as its value, ``[...]``
  (``[]``), in signatures.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)
_NOTED_ARGS = re.compile(r"^([ \t]*)Args \((.*?)\):[ \t]*$", re.M | re.S)
_ITEM = re.compile(r"^(\s+)([^:]+?):(\s.*|)$")
_NAME = re.compile(r"^(\**\w+)\s*(\(.*\))?$")


def _names(head: str) -> list[tuple[str, str]] | None:
    """``(name, note)`` of each argument a grouped entry names, or None when it is no group of names."""
    parts = [p.strip() for p in re.split(r"\s*[,/]\s*", head)]
    found = [_NAME.match(p) for p in parts]
    if len(parts) < 2 or not all(found):
        return None
    return [(m[1], m[2] or "") for m in found if m]


def _split_groups(lines: list[str]) -> list[str]:
    """The lines of an ``Args:`` section with each grouped entry written once per argument."""
    out: list[str] = []
    indent = None
    i = 0
    while i < len(lines):
        match = _ITEM.match(lines[i])
        if indent is None and match:
            indent = len(match[1])
        if not match or len(match[1]) != indent or (names := _names(match[2])) is None:
            out.append(lines[i])
            i += 1
            continue
        rest = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            rest.append(lines[i])
            i += 1
        blank = 0  # the blank lines after the entry stay after the last name's
        while blank < len(rest) and not rest[-1 - blank].strip():
            blank += 1
        for name, note in names:
            out += [f"{match[1]}{name}:{(' ' + note) if note else ''}{match[3]}", *rest[: len(rest) - blank]]
        out += rest[len(rest) - blank :]
    return out


def house_style(text: str) -> str:
    """The docstring in griffe's spelling of the house headings, grouped arguments one entry each."""
    text = _EXAMPLE.sub(r"\1Examples:", text)
    text = _NOTED_ARGS.sub(lambda m: f"{m[1]}Arguments ({' '.join(m[2].split())}):\n\n{m[1]}Args:", text)
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        header = re.match(r"^(\s*)Args:\s*$", lines[i])
        i += 1
        if header:
            start = i
            while i < len(lines) and (
                not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(header[1])
            ):
                i += 1
            out += _split_groups(lines[start:i])
    return "\n".join(out)


class HouseDocstrings(griffe.Extension):
    """Rewrites each docstring before griffe parses it, and each field's factory default."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = house_style(obj.docstring.value)

    def on_attribute_instance(self, *, node: Any, attr: griffe.Attribute, agent: Any, **kwargs: Any) -> None:
        # field(default_factory=lambda: X) -> field(default=X), before the dataclasses extension reads it
        value = attr.value
        if not (isinstance(value, griffe.ExprCall) and str(value.function).endswith("field")):
            return
        for i, arg in enumerate(value.arguments):
            lam = arg.value if isinstance(arg, griffe.ExprKeyword) and arg.name == "default_factory" else None
            if isinstance(lam, griffe.ExprLambda) and not lam.parameters:
                value.arguments[i] = griffe.ExprKeyword("default", lam.body, arg.function)
            elif lam is not None:
                empty = {"list": "[]", "dict": "{}", "set": "set()", "tuple": "()"}.get(str(arg.value))
                if empty is not None:
                    value.arguments[i] = griffe.ExprKeyword("default", empty, arg.function)
