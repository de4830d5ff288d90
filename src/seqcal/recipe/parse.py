"""Recipes: YAML <-> modifiers. llm-compressor's recipe files are accepted as they are.

A recipe is read in three steps: the text is loaded with line numbers (``seqcal.recipe.llmc_format``), the
modifiers are found in its stages and groups (``seqcal.recipe.layouts``, which lists the layouts accepted), and
each is built here from its class and arguments, an error pointing at the line it is about. Beyond the current
layout, llm-compressor's older forms are accepted: the renamed or deprecated arguments of LEGACY_ARGUMENTS, a
`GPTQModifier` without a scheme right after a `QuantizationModifier` of the same stage (GPTQ then uses that
scheme, and its `targets` name the layers to calibrate one by one, as in llm-compressor < 0.2), and an
`AWQModifier` without a scheme right before a `QuantizationModifier` (llm-compressor 0.14's AWQ form: one
AWQModifier with that scheme).

Recipes are read with PyYAML's safe loader only (DESIGN invariant 8): tags such as `!GPTQModifier` or
`!!python/...` are rejected, except the enum, tuple and device tags llm-compressor 0.14 writes into its
recipe.yaml, which are read as plain values (``llmc_format.LLMC_TAGS``), and `eval(...)` strings are refused,
never evaluated. llm-compressor's Modifier base fields (BASE_ARGUMENTS) are accepted and ignored. This module
re-exports `RecipeError` and `UNSUPPORTED_MODIFIERS`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
import yaml

from seqcal.modifiers import MODIFIERS, Modifier, QuantizationModifier
from seqcal.recipe.imports import entry_point_class, is_import_path, modifier_class, recipe_key
from seqcal.recipe.layouts import EXAMPLE, Entry, collect_entries
from seqcal.recipe.llmc_format import (
    BASE_ARGUMENTS,
    LEGACY_ARGUMENTS,
    UNSUPPORTED_MODIFIERS,
    RecipeError,
    _closest,
    _has_eval,
    _kind,
    _load,
    _Locator,
    _plain,
    bind_awq,
    is_bare_gptq,
)

_RECIPE_SUFFIXES = (".yaml", ".yml", ".json")

RecipeInput = Union[str, os.PathLike, Modifier, "Recipe", dict, Sequence[Any]]


@dataclass
class Recipe:
    """The modifiers of a recipe, in execution order, and where they were read from.

    Args:
        modifiers: the modifiers in execution order.
        source: the file the recipe came from, "<string>" / "<dict>", or None when built from objects.

    Example:
        >>> recipe = parse_recipe("GPTQModifier: {scheme: W4A16, ignore: [lm_head]}")  # doctest: +SKIP
        >>> recipe.save("out")  # writes out/recipe.yaml in llm-compressor's staged form  # doctest: +SKIP
    """

    modifiers: list[Modifier]
    source: str | None = None

    def __post_init__(self) -> None:
        self.modifiers = bind_awq(list(self.modifiers))
        where = self.source or "recipe"
        if not self.modifiers:
            raise RecipeError(f"{where}: a recipe needs at least one modifier ({', '.join(MODIFIERS)})")
        for i, modifier in enumerate(self.modifiers):
            if not isinstance(modifier, Modifier):
                raise RecipeError(
                    f"{where}: modifiers[{i}] is a {type(modifier).__name__}, not a seqcal Modifier "
                    f"({', '.join(MODIFIERS)} from seqcal.modifiers)"
                )

    def validate(self, model: torch.nn.Module) -> None:
        """Check every modifier against ``model``, then that no Linear is claimed by two modifiers.

        A module is quantized once: a second modifier targeting it would be skipped silently, so a recipe
        whose modifiers overlap is refused before any calibration.

        Args:
            model: the model the recipe is applied to.

        Raises:
            ValueError: a modifier's own check failed, or two modifiers target the same modules.

        Example:
            >>> parse_recipe("GPTQModifier: {scheme: W4A16, ignore: [lm_head]}").validate(model)  # doctest: +SKIP
        """
        claimed: dict[str, int] = {}  # module name -> index of the first modifier that quantizes it
        for i, modifier in enumerate(self.modifiers):
            modifier.validate(model)
            for name in modifier.quantizes():
                claimed.setdefault(name, i)
            shared = [n for n in modifier.quantizes() if claimed[n] != i]
            if shared:
                first = self.modifiers[claimed[shared[0]]]
                shown = ", ".join(shared[:3]) + (f" and {len(shared) - 3} more" if len(shared) > 3 else "")
                raise RecipeError(
                    f"{self.source or 'recipe'}: {first.name} (modifier {claimed[shared[0]] + 1}) and "
                    f"{modifier.name} (modifier {i + 1}) both target {len(shared)} Linear module(s) ({shown}); "
                    f"a module is quantized once: narrow the targets of one of them or add the shared modules "
                    f"to its ignore list"
                )

    def to_yaml(self) -> str:
        """The recipe in llm-compressor's staged form, with only the non-default arguments.

        Returns:
            YAML text that ``parse_recipe`` (and llm-compressor) read back to the same modifiers.

        Example:
            >>> print(parse_recipe("GPTQModifier: {scheme: W4A16}").to_yaml())  # doctest: +SKIP
            DEFAULT_stage:
              DEFAULT_modifiers:
                GPTQModifier: {scheme: W4A16}
        """
        groups: list[dict[str, Any]] = [{}]
        for modifier in self.modifiers:
            key = recipe_key(modifier)
            if key in groups[-1]:
                groups.append({})  # a group names each modifier once; a new group keeps the order
            groups[-1][key] = _plain(modifier.to_dict(), modifier.name)
        stage = {
            ("DEFAULT" if i == 0 else f"DEFAULT_{i + 1}") + "_modifiers": g for i, g in enumerate(groups)
        }
        return yaml.safe_dump({"DEFAULT_stage": stage}, sort_keys=False, default_flow_style=None)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``to_yaml()`` to ``path``: a .yaml/.yml file name as is, anything else is a directory that
        gets ``recipe.yaml`` (created if missing).

        Args:
            path: a directory (a checkpoint's output_dir) or a .yaml/.yml file path.

        Example:
            >>> parse_recipe("recipes/gptq_w4a16.yaml").save("out")  # out/recipe.yaml  # doctest: +SKIP
        """
        target = Path(path)
        if target.suffix.lower() not in (".yaml", ".yml") or target.is_dir():
            target = target / "recipe.yaml"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.to_yaml(), encoding="utf-8")


def parse_recipe(recipe: RecipeInput) -> Recipe:
    """Read a recipe given in any of the forms ``oneshot(recipe=...)`` accepts.

    Args:
        recipe: a path to a .yaml/.yml/.json file (or to a directory holding recipe.yaml), a YAML string, a
            Modifier, a Recipe, a dict already loaded, or a list of any of these (concatenated in order).

    Returns:
        The Recipe, modifiers in execution order.

    Raises:
        RecipeError: the recipe cannot be read; the message gives file:line, the problem and the choices.

    Example:
        >>> parse_recipe("quant_stage: {quant_modifiers: {GPTQModifier: {scheme: W4A16}}}")  # doctest: +SKIP
        >>> parse_recipe([GPTQModifier(scheme="W8A16"), "recipes/rtn_w8a8.yaml"])  # doctest: +SKIP
    """
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, Modifier):
        return Recipe([recipe], None)
    if isinstance(recipe, dict):
        return _from_data(recipe, _Locator("<dict>"))
    if isinstance(recipe, (str, os.PathLike)):
        return _from_text_or_path(recipe)
    if isinstance(recipe, Sequence) and not isinstance(recipe, bytes):
        if not recipe:
            raise RecipeError(
                f"the recipe list is empty; give at least one modifier or recipe, e.g. {EXAMPLE}"
            )
        parts = [parse_recipe(item) for item in recipe]
        sources = list(dict.fromkeys(p.source for p in parts if p.source))
        return Recipe([m for p in parts for m in p.modifiers], ", ".join(sources) or None)
    raise RecipeError(
        f"a recipe is a path to a .yaml file, a YAML string, a Modifier, a dict or a list of those; "
        f"got {type(recipe).__name__}"
    )


def _from_text_or_path(recipe: str | os.PathLike) -> Recipe:
    text = recipe if isinstance(recipe, str) else None
    if text is not None and ("\n" in text or not (os.path.exists(text) or text.endswith(_RECIPE_SUFFIXES))):
        data, lines = _load(text, "<string>")
        return _from_data(data, _Locator("<string>", lines))
    path = Path(recipe)
    if path.is_dir() and (path / "recipe.yaml").is_file():
        path = path / "recipe.yaml"  # a checkpoint directory written by seqcal or llm-compressor
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found (working directory: {os.getcwd()})")
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read the recipe file: {exc}") from exc
    data, lines = _load(content, str(path))
    return _from_data(data, _Locator(str(path), lines))


# --- from loaded data to modifiers ----------------------------------------------------------------------


def _from_data(data: Any, loc: _Locator) -> Recipe:
    built: list[tuple[Modifier, Entry]] = []
    for entry in collect_entries(data, loc):
        inherited = None
        if is_bare_gptq(entry) and built and type(built[-1][0]) is QuantizationModifier:
            if built[-1][1].stage == entry.stage:  # legacy pair: GPTQ takes the scheme of the modifier before
                inherited = built.pop()[0]
        built.append((_build(entry, loc, inherited), entry))
    return Recipe([m for m, _ in built], loc.source)


def _build(entry: Entry, loc: _Locator, inherited: Modifier | None = None) -> Modifier:
    cls = _modifier_class(entry)
    args = _arguments(entry, cls, loc)
    if inherited is not None:
        if "targets" in args:  # in llm-compressor < 0.2 a bare GPTQModifier's targets were its layers
            args.setdefault("sequential_targets", args.pop("targets"))
        args = {**inherited.to_dict(), **args}
    try:
        return cls(**args)
    except (ValueError, TypeError) as exc:
        message = str(exc) if str(exc).startswith(cls.name) else f"{cls.name}: {exc}"
        raise RecipeError(f"{_line_of(exc, args, entry, loc)}: {message}") from exc


def _line_of(exc: Exception, args: dict[str, Any], entry: Entry, loc: _Locator) -> str:
    """The line a constructor's error is about: the nested setting it quotes as ``key value`` (a config group's
    ``num_bits 16``), else the one argument written that it names, else the modifier's line."""
    quoted = _quoted_setting(entry.args, str(exc), loc)
    if quoted is not None:
        return quoted
    named = [k for k in args if k in (entry.args or {}) and re.search(rf"\b{re.escape(k)}\b", str(exc))]
    return loc.at(entry.args, named[0]) if len(named) == 1 else entry.where


def _quoted_setting(value: Any, message: str, loc: _Locator) -> str | None:
    """``file:line`` of the first key, in file order, whose ``key value`` the message quotes (nested mappings
    and lists searched); None when there is none or the recipe has no lines."""
    if isinstance(value, list):
        return next((w for item in value if (w := _quoted_setting(item, message, loc)) is not None), None)
    if not isinstance(value, dict):
        return None
    for key, item in value.items():
        if isinstance(item, (dict, list)):
            if (found := _quoted_setting(item, message, loc)) is not None:
                return found
        elif isinstance(key, str) and re.search(rf"\b{re.escape(f'{key} {item}')}\b", message):
            where = loc.at(value, key)
            return where if where != loc.source else None
    return None


def _modifier_class(entry: Entry) -> type[Modifier]:
    name = entry.name
    if isinstance(name, str) and name in MODIFIERS:
        return MODIFIERS[name]
    if is_import_path(name):
        return modifier_class(name, entry.where)
    if isinstance(name, str) and (registered := entry_point_class(name, entry.where)) is not None:
        return registered
    supported = ", ".join(MODIFIERS)
    if name in UNSUPPORTED_MODIFIERS:
        raise RecipeError(
            f"{entry.where}: {name} is an llm-compressor modifier that is not supported by seqcal yet; "
            f"supported: {supported}. Remove it from the recipe, or run this recipe with llm-compressor"
        )
    hint = _closest(str(name), [*MODIFIERS, *UNSUPPORTED_MODIFIERS])
    raise RecipeError(
        f"{entry.where}: unknown modifier {name!r}{hint}; seqcal's modifiers are: {supported}, or a modifier of "
        "your own by import path ('my_pkg.my_module:MyModifier')"
    )


def _arguments(entry: Entry, cls: type[Modifier], loc: _Locator) -> dict[str, Any]:
    if entry.args is None:
        return {}
    if not isinstance(entry.args, dict):
        raise RecipeError(
            f"{entry.where}: the arguments of {cls.name} must be a mapping (argument: value), "
            f"got {_kind(entry.args)}"
        )
    valid, legacy = cls.argument_names(), LEGACY_ARGUMENTS.get(cls.name, {})
    out: dict[str, Any] = {}
    for key, value in entry.args.items():
        at = loc.at(entry.args, key)
        if key in BASE_ARGUMENTS and key not in valid:
            continue
        if key in legacy:
            if legacy[key] is None:
                continue
            if legacy[key] in entry.args:
                raise RecipeError(
                    f"{at}: {key!r} is the old name of {legacy[key]!r}; give only {legacy[key]!r}"
                )
            key = legacy[key]
        if key not in valid:
            raise RecipeError(
                f"{at}: unknown argument {key!r} for {cls.name}{_closest(str(key), valid)}; "
                f"its arguments are: {', '.join(valid)}"
            )
        if _has_eval(value):
            raise RecipeError(
                f"{at}: {cls.name}.{key} holds an 'eval(...)' expression; seqcal never evaluates recipe "
                "content (nothing untrusted is executed): write the value itself"
            )
        out[key] = value
    return out
