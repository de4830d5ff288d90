"""A griffe extension for two headings of seqcal's house docstring style that griffe's Google-style parser
does not read as sections, so that they render as the sections they are:

- ``Example:`` (the doctests; Napoleon and the Google guide accept it, griffe knows only ``Examples:``);
- ``Args (a note):``, e.g. ``Args (llm-compressor's names):``, which says where the arguments come from: the
  note becomes a sentence before a plain ``Args:`` section.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)
_NOTED_ARGS = re.compile(r"^(\s*)Args \((.*?)\):\s*$", re.M | re.S)


def house_style(text: str) -> str:
    """The docstring with its ``Example:`` and ``Args (note):`` headings in griffe's spelling."""
    text = _EXAMPLE.sub(r"\1Examples:", text)
    return _NOTED_ARGS.sub(lambda m: f"{m[1]}Arguments ({' '.join(m[2].split())}):\n\n{m[1]}Args:", text)


class HouseDocstrings(griffe.Extension):
    """Rewrites each docstring's house headings before griffe parses it."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = house_style(obj.docstring.value)
