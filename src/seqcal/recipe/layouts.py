"""Where the modifiers are in a recipe's data: stages, groups and lists, in file order.

Accepted layouts, executed in file order:

    quant_stage:                 # any key ending in _stage; several stages run one after the other
      quant_modifiers:           # any key ending in _modifiers (or `modifiers`); several groups allowed
        GPTQModifier: {scheme: W4A16, ignore: [lm_head]}
    quant_modifiers: {...}       # a group without a stage
    GPTQModifier: {...}          # a modifier at top level

and the older forms that llm-compressor's examples and tests still use: `run_type: oneshot` and `args:` in a
stage, a modifier directly inside a stage, a group written as a list (`- GPTQModifier: {...}`), a `group:`
key among a modifier's arguments. `version`, `metadata` and `args` at top level are ignored.

``collect_entries`` returns one ``Entry`` per modifier as written (its name, its arguments, its line and its
stage); ``seqcal.recipe.parse`` builds the modifiers from them.

Example:
    >>> from seqcal.recipe.llmc_format import _load
    >>> data, lines = _load("quant_stage:\\n  quant_modifiers:\\n    GPTQModifier: {scheme: W4A16}\\n", "<string>")
    >>> [(e.name, e.where, e.stage) for e in collect_entries(data, _Locator("<string>", lines))]
    [('GPTQModifier', '<string>:3', 'quant_stage')]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from seqcal.modifiers import MODIFIERS
from seqcal.recipe.imports import is_import_path
from seqcal.recipe.llmc_format import (
    IGNORED_TOP_LEVEL_KEYS,
    RecipeError,
    _kind,
    _Locator,
    _looks_like_modifier,
)

EXAMPLE = "'quant_stage: {quant_modifiers: {GPTQModifier: {scheme: W4A16, ignore: [lm_head]}}}'"


@dataclass
class Entry:
    """One modifier as written: its name, its argument mapping, where it is and which stage holds it."""

    name: Any
    args: Any
    where: str
    stage: str


def collect_entries(data: Any, loc: _Locator) -> list[Entry]:
    """The modifiers of a loaded recipe, in file order.

    Args:
        data: the recipe as loaded from YAML (or a dict given from Python).
        loc: where its keys are, for messages.

    Returns:
        One Entry per modifier as written.

    Raises:
        RecipeError: an empty recipe, an unknown key, or a stage or group of the wrong shape (file:line).
    """
    if data is None or data == {}:
        raise RecipeError(f"{loc.source}: the recipe is empty; expected e.g. {EXAMPLE}")
    if not isinstance(data, dict):
        hint = "; if it was meant as a file path, no such file exists" if isinstance(data, str) else ""
        raise RecipeError(
            f"{loc.source}: a recipe must be a mapping such as {EXAMPLE}, got {_kind(data)}{hint}"
        )
    entries = _collect_level(data, loc, stage=None)
    if not entries:
        raise RecipeError(f"{loc.source}: the recipe has no modifiers; expected e.g. {EXAMPLE}")
    return entries


def _collect_level(mapping: dict, loc: _Locator, stage: str | None) -> list[Entry]:
    """The modifiers of the top level (stage None) or of one stage, in file order."""
    entries: list[Entry] = []
    for key, value in mapping.items():
        at = loc.at(mapping, key)
        if key in (IGNORED_TOP_LEVEL_KEYS if stage is None else ("args",)):
            continue  # stage args only feed eval(...) expressions, which seqcal refuses anyway
        if stage is not None and key == "run_type":
            if value != "oneshot":
                raise RecipeError(
                    f"{at}: run_type {value!r} is not supported: seqcal runs oneshot (post-training) "
                    "calibration only; use 'run_type: oneshot' or remove the stage"
                )
        elif stage is None and isinstance(key, str) and key.endswith("_stage"):
            if not isinstance(value, dict):
                raise RecipeError(
                    f"{at}: stage {key!r} must map '<name>_modifiers' groups, got {_kind(value)}"
                )
            entries += _collect_level(value, loc, stage=key)
        elif _is_group_key(key):
            entries += _collect_group(value, key, at, loc, stage or "")
        elif _looks_like_modifier(key) or is_import_path(key):
            entries.append(Entry(key, value, at, stage or ""))
        else:
            expected = (
                "a '<name>_stage' mapping (e.g. quant_stage), a '<name>_modifiers' mapping, a modifier "
                f"({', '.join(MODIFIERS)}) or one of {', '.join(IGNORED_TOP_LEVEL_KEYS)} (ignored)"
                if stage is None
                else f"'<name>_modifiers' groups, a modifier ({', '.join(MODIFIERS)}), run_type or args"
            )
            place = f"top-level key {key!r}" if stage is None else f"key {key!r} in stage {stage!r}"
            raise RecipeError(f"{at}: unknown {place}; expected {expected}")
    return entries


def _collect_group(group: Any, name: str, where: str, loc: _Locator, stage: str) -> list[Entry]:
    if isinstance(group, dict):
        return [Entry(key, value, loc.at(group, key), stage) for key, value in group.items()]
    if isinstance(group, list):
        return [_list_entry(item, where, loc, stage) for item in group]
    raise RecipeError(
        f"{where}: group {name!r} must map modifier names to their arguments, e.g. "
        f"'{name}: {{GPTQModifier: {{scheme: W4A16}}}}', got {_kind(group)}"
    )


def _list_entry(item: Any, where: str, loc: _Locator, stage: str) -> Entry:
    """One item of a group written as a list: `- GPTQModifier: {args}`, optionally with `group: name`."""
    names = [key for key in item if key != "group"] if isinstance(item, dict) else []
    if len(names) != 1:
        where = loc.at(item, names[1]) if len(names) > 1 else where
        raise RecipeError(
            f"{where}: each item of a modifier list holds exactly one modifier, like '- GPTQModifier: "
            f"{{scheme: W4A16}}'; got {names if names else _kind(item)}"
        )
    return Entry(names[0], item[names[0]], loc.at(item, names[0]), stage)


def _is_group_key(key: Any) -> bool:
    return isinstance(key, str) and (key == "modifiers" or key.endswith("_modifiers"))
