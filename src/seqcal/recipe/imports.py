"""Modifiers written outside seqcal, named in a recipe or on the command line.

A recipe names a modifier by its registry name (``GPTQModifier``, ``MODIFIERS``), by an import path
(``my_pkg.my_module:MyModifier``, or ``my_pkg.my_module.MyModifier``) or by the name an installed package
registers in the ``seqcal.modifiers`` entry-point group (``[project.entry-points."seqcal.modifiers"]
MyModifier = "my_pkg.my_module:MyModifier"`` in its pyproject.toml). Either way the class is checked and its
arguments validated as a built-in modifier's are.

Importing a module runs its code, so only modules already on the user's own Python path are imported (installed
packages, ``PYTHONPATH``): nothing is fetched, and the recipe's own directory is not searched.

Example:
    >>> modifier_class("seqcal.modifiers.gptq:GPTQModifier", "<recipe>").__name__
    'GPTQModifier'
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re

from seqcal.modifiers import MODIFIERS, Modifier
from seqcal.recipe.llmc_format import RecipeError

ENTRY_POINT_GROUP = "seqcal.modifiers"
# module.path:Name, or module.path.Name (a dotted path whose last part is the class)
_PATH = re.compile(r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?::|\.)(?P<name>[A-Za-z_]\w*)$")


def is_import_path(name: object) -> bool:
    """Whether ``name`` is written as an import path (``pkg.module:Class`` or ``pkg.module.Class``)."""
    return isinstance(name, str) and bool(_PATH.match(name)) and ("." in name or ":" in name)


def entry_point_class(name: str, where: str) -> type[Modifier] | None:
    """The modifier an installed package registers as ``name`` (entry-point group ``seqcal.modifiers``)."""
    found = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        return None
    return _checked(found[0].load(), f"{found[0].value} (entry point {name!r})", where)


def modifier_class(path: str, where: str) -> type[Modifier]:
    """The Modifier subclass at ``path`` (``pkg.module:Class`` or ``pkg.module.Class``).

    Raises:
        RecipeError: the module cannot be imported, has no such class, or the class is no Modifier.
    """
    match = _PATH.match(path)
    if match is None:
        raise RecipeError(f"{where}: {path!r} is no import path; write it as 'my_pkg.my_module:MyModifier'")
    module_name, class_name = match["module"], match["name"]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RecipeError(
            f"{where}: cannot import {module_name!r} for the modifier {path!r} ({exc}); install the package "
            "that defines it, or add its directory to PYTHONPATH"
        ) from exc
    if not hasattr(module, class_name):
        raise RecipeError(f"{where}: module {module_name!r} has no {class_name!r} (the modifier {path!r})")
    return _checked(getattr(module, class_name), path, where)


def _checked(obj: object, path: str, where: str) -> type[Modifier]:
    if not (isinstance(obj, type) and issubclass(obj, Modifier)):
        raise RecipeError(
            f"{where}: {path} is {obj!r}, not a seqcal modifier class; a modifier derives from "
            "seqcal.modifiers.Modifier (or one of its subclasses, such as QuantizationModifier)"
        )
    return obj


def user_modifier_logger(name: str) -> bool:
    """Whether logger ``name`` belongs to a package that defines a modifier outside seqcal (a recipe's import path
    or entry point): the package of a loaded Modifier subclass, its modules and their loggers' children. The
    command line shows these loggers as seqcal's own (``console.console_logging(shown=...)``)."""
    top = name.partition(".")[0]
    pending, packages = list(Modifier.__subclasses__()), set()
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        packages.add(cls.__module__.partition(".")[0])
    return top != "seqcal" and top in packages


def recipe_key(modifier: Modifier) -> str:
    """How a recipe names ``modifier``: its registry name, else its class's import path (``pkg.module:Class``),
    so that the recipe.yaml written beside a checkpoint runs again (a class defined in ``__main__`` cannot be
    imported by another process: its name is written, and naming it again needs the same script)."""
    cls = type(modifier)
    if MODIFIERS.get(modifier.name) is cls or cls.__module__ == "__main__":
        return modifier.name
    return f"{cls.__module__}:{cls.__qualname__}"
