"""Reading recipe text: PyYAML's safe loader with the line of every key, and the recipe error helpers.

``_load`` parses YAML with ``yaml.SafeLoader`` only (DESIGN invariant 8) and records where each mapping key
is, so ``_Locator`` can point messages at "file:line"; repeated keys are refused instead of silently
overwritten. The Python tags llm-compressor's ``recipe.yaml`` holds (``yaml.dump`` of its modifiers: an enum
such as ``!!python/object/apply:compressed_tensors.quantization.quant_args.ActivationOrdering [weight]``, a
``!!python/tuple``, a ``torch.device``) are read as the plain values they stand for by constructors for exactly
those tags (``LLMC_TAGS``); nothing is imported or called, and every other tag is still refused. ``RecipeError``, ``UNSUPPORTED_MODIFIERS`` and the message helpers (``_kind``, ``_closest``,
``_looks_like_modifier``, ``_has_eval``, ``_plain``) live here too; ``seqcal.recipe.parse`` turns the
loaded data into modifiers and re-exports the public names.

Example:
    >>> data, lines = _load("GPTQModifier:\\n  scheme: W4A16\\n", "<string>")
    >>> _Locator("<string>", lines).at(data["GPTQModifier"], "scheme")
    '<string>:2'
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from seqcal.errors import SeqcalError
from seqcal.modifiers import MODIFIERS, AWQModifier, QuantizationModifier

# llm-compressor modifiers seqcal does not implement yet: naming one is "not supported", not "unknown".
# fmt: off
UNSUPPORTED_MODIFIERS: tuple[str, ...] = (
    "OutputDistillationModifier",
)
# fmt: on
IGNORED_TOP_LEVEL_KEYS: tuple[str, ...] = ("version", "metadata", "args")
# Older llm-compressor argument names: modifier -> old name -> current name, or None (accepted, ignored:
# it never changed the result).
LEGACY_ARGUMENTS: dict[str, dict[str, str | None]] = {
    "GPTQModifier": {"percdamp": "dampening_frac"},
    "QuantizationModifier": {"sequential_update": None},
}
# llm-compressor's Modifier base fields, which its recipe.yaml writes for every modifier: accepted and ignored
# by the modifiers that do not take them as arguments. A one-shot run has no training steps for start, end and
# update to schedule, index and group only order modifiers (seqcal runs them in file order), and
# requires_calibration_data states what the modifier's class needs (seqcal decides from its arguments).
BASE_ARGUMENTS: tuple[str, ...] = ("index", "group", "start", "end", "update", "requires_calibration_data")
_APPLY = "tag:yaml.org,2002:python/object/apply:"
# The enums llm-compressor 0.14's recipe.yaml writes as Python tags -> the values each may hold (read as strings).
# fmt: off
LLMC_TAGS: dict[str, tuple[str, ...]] = {
    "compressed_tensors.quantization.quant_args.ActivationOrdering": ("weight", "static", "group", "dynamic"),
    "compressed_tensors.quantization.quant_args.QuantizationStrategy": (
        "tensor", "channel", "group", "block", "token", "tensor_group", "attn_head"),
    "compressed_tensors.quantization.quant_args.QuantizationType": ("int", "float"),
    "compressed_tensors.quantization.quant_args.DynamicType": ("local",),
    "llmcompressor.modifiers.transform.spinquant.base.SpinquantRotation": ("R1", "R2", "R3", "R4"),
}
# fmt: on
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "npu", "meta")


class RecipeError(SeqcalError, ValueError):
    """A recipe cannot be read; the message names the file (or "<string>"), the line and the valid choices."""


# --- reading text with line numbers ---------------------------------------------------------------------


class _LineLoader(yaml.SafeLoader):
    """PyYAML's safe loader that records the line of every mapping key and rejects repeated keys."""

    def __init__(self, text: str, source: str) -> None:
        super().__init__(text)
        self.source = source
        self.key_lines: dict[int, dict[Any, int]] = {}  # id(dict) -> key -> 1-based line

    def construct_lined_map(self, node: yaml.MappingNode) -> Iterator[dict]:
        data: dict = {}
        yield data
        lines: dict[Any, int] = {}  # keys brought in by `<<: *anchor` get no line; they may be overridden
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            if not _hashable(key):
                continue  # construct_mapping below reports unhashable keys with their line
            if key in lines:
                raise RecipeError(_repeated_key_message(self.source, key, lines[key], line))
            lines[key] = line
        self.key_lines[id(data)] = lines
        data.update(self.construct_mapping(node))  # also resolves `<<` merge keys


_LineLoader.add_constructor("tag:yaml.org,2002:map", _LineLoader.construct_lined_map)


def _tag_arguments(loader: _LineLoader, node: yaml.Node, what: str, sizes: tuple[int, ...]) -> list[Any]:
    """The scalar arguments of an ``apply:`` tag, checked: a list of ``sizes`` plain values, nothing nested."""
    line = f"{loader.source}:{node.start_mark.line + 1}"
    if not isinstance(node, yaml.SequenceNode) or len(node.value) not in sizes:
        raise RecipeError(f"{line}: {what} must hold a list of {' or '.join(map(str, sizes))} value(s), like "
                          f"llm-compressor writes it; write the plain value instead of the tag")  # fmt: skip
    if not all(isinstance(item, yaml.ScalarNode) for item in node.value):
        raise RecipeError(f"{line}: {what} holds nested values; write the plain value instead of the tag")
    return [loader.construct_scalar(item) for item in node.value]


def _construct_enum(loader: _LineLoader, suffix: str, node: yaml.Node) -> str:
    """An enum of ``LLMC_TAGS``, read as its value (``ActivationOrdering [weight]`` -> "weight")."""
    where = f"{loader.source}:{node.start_mark.line + 1}"
    if suffix not in LLMC_TAGS:
        raise RecipeError(
            f"{where}: invalid YAML: the tag '!!python/object/apply:{suffix}' would run Python code; recipes are "
            "read with YAML's safe loader, which reads only the enums llm-compressor writes (as plain values): "
            "write the plain value instead (nothing in a recipe is executed)"
        )
    (value,) = _tag_arguments(loader, node, suffix.rsplit(".", 1)[-1], (1,))
    if value not in LLMC_TAGS[suffix]:
        raise RecipeError(f"{where}: {value!r} is not a value of {suffix.rsplit('.', 1)[-1]}; one of "
                          f"{', '.join(LLMC_TAGS[suffix])}")  # fmt: skip
    return str(value)


def _construct_device(loader: _LineLoader, node: yaml.Node) -> str:
    """``!!python/object/apply:torch.device [cuda, 0]`` read as "cuda:0" (the string torch.device takes)."""
    args = _tag_arguments(loader, node, "torch.device", (1, 2))
    kind, index = str(args[0]), args[1] if len(args) > 1 else None
    if kind.split(":")[0] not in _DEVICE_TYPES or (index is not None and not str(index).isdigit()):
        raise RecipeError(
            f"{loader.source}:{node.start_mark.line + 1}: {args} is not a device; write e.g. 'cpu'"
        )
    return kind if index is None else f"{kind}:{index}"


def _construct_apply(loader: _LineLoader, suffix: str, node: yaml.Node) -> str:
    return (
        _construct_device(loader, node) if suffix == "torch.device" else _construct_enum(loader, suffix, node)
    )


_LineLoader.add_multi_constructor(_APPLY, _construct_apply)
_LineLoader.add_constructor(  # llm-compressor writes SmoothQuant's mappings as tuples: read as lists
    "tag:yaml.org,2002:python/tuple", lambda loader, node: loader.construct_sequence(node, deep=True)
)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _repeated_key_message(source: str, key: Any, first: int, line: int) -> str:
    if _looks_like_modifier(key):
        return (
            f"{source}:{line}: modifier {key!r} is given twice in one group (lines {first} and {line}); "
            "YAML would silently keep only the last. Put the second one in its own '<name>_modifiers' group "
            "or '<name>_stage' (they run in file order)"
        )
    return f"{source}:{line}: key {key!r} is given twice in one mapping (lines {first} and {line}); keep one"


def _load(text: str, source: str) -> tuple[Any, dict[int, dict[Any, int]]]:
    loader = _LineLoader(text, source)
    try:
        return loader.get_single_data(), loader.key_lines
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = ": ".join(str(p) for p in (exc.context, exc.problem) if p)
        hint = ""
        if "constructor for the tag" in problem:
            hint = (
                "; recipes are read with YAML's safe loader, so tags are not allowed: write "
                "'GPTQModifier: {scheme: W4A16}' instead of '!GPTQModifier' (nothing in a recipe is executed)"
            )
        raise RecipeError(f"{where}: invalid YAML: {problem}{hint}") from exc
    except yaml.YAMLError as exc:
        raise RecipeError(f"{source}: invalid YAML: {exc}") from exc
    finally:
        loader.dispose()


# --- where a key is, for messages -----------------------------------------------------------------------


@dataclass
class _Locator:
    """Turns (mapping, key) into "file:line" for messages; dicts given by the caller have no lines."""

    source: str
    key_lines: dict[int, dict[Any, int]] = field(default_factory=dict)

    def at(self, mapping: dict, key: Any) -> str:
        line = self.key_lines.get(id(mapping), {}).get(key)
        return f"{self.source}:{line}" if line else self.source


# --- message helpers ------------------------------------------------------------------------------------


def _looks_like_modifier(key: Any) -> bool:
    if not isinstance(key, str):
        return False
    known = [*MODIFIERS, *UNSUPPORTED_MODIFIERS]
    return (
        key in known
        or key.endswith("Modifier")
        or bool(difflib.get_close_matches(key, known, n=1, cutoff=0.8))
    )


def _closest(name: str, choices: Sequence[str]) -> str:
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (an empty value)"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _has_eval(value: Any) -> bool:
    if isinstance(value, str):
        return "eval(" in value
    if isinstance(value, dict):
        return any(_has_eval(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_eval(v) for v in value)
    return False


def _plain(value: Any, where: str) -> Any:
    """``value`` as plain YAML types (tuples -> lists, enums and pydantic models -> their values)."""
    if isinstance(value, enum.Enum):
        return _plain(value.value, where)
    if hasattr(value, "model_dump"):  # e.g. a QuantizationScheme given in config_groups from Python
        return _plain(value.model_dump(mode="json", exclude_none=True), where)
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if value is None or type(value) in (bool, int, float, str):
        return value
    raise RecipeError(
        f"{where}: cannot write a {type(value).__name__} to a recipe; use YAML values (str, number, list, dict)"
    )


def bind_awq(modifiers: list[Any]) -> list[Any]:
    """llm-compressor 0.14's AWQ form: a bare AWQModifier (no scheme) followed by a QuantizationModifier is one
    AWQModifier with that modifier's scheme, targets and ignore (AWQ needs the scheme to search its scales)."""
    out: list[Any] = []
    for modifier in modifiers:
        previous = out[-1] if out else None
        if type(modifier) is QuantizationModifier and isinstance(previous, AWQModifier) and previous.bare:
            out[-1] = previous.bind(modifier)
        else:
            out.append(modifier)
    return out


def is_bare_gptq(entry: Any) -> bool:
    """A GPTQModifier without its own scheme (the legacy form that uses the QuantizationModifier before it)."""
    if entry.name != "GPTQModifier":
        return False
    return entry.args is None or (
        isinstance(entry.args, dict) and not {"scheme", "config_groups"} & set(entry.args)
    )
