"""llm-compressor's ``transform_config`` in a rotation modifier's arguments: read back into the arguments it stands for.

llm-compressor 0.14's QuIPModifier and SpinQuantModifier build a compressed-tensors ``TransformConfig`` from their
arguments when they start, and the recipe.yaml it saves holds it beside them (``transform_config``), where it
overrides the arguments. seqcal applies rotations from its own plan of the arguments (``modifiers/rotations.py``),
so a given ``transform_config`` is honoured by reading the arguments back out of it (``arguments_from``: the
rotations, targets, transform type, block size, precision, SpinQuant's mappings) and checking that those arguments
build the same config again (``check_same``). What seqcal's plan cannot express (another location, an ``inverse``
flag flipped, different targets on the two halves of a rotation, a head size other than the model's) is refused
with a sentence naming the field. A recipe saved by llm-compressor replays; seqcal writes the config its run
applied into the checkpoint's ``quantization_config`` as llm-compressor does.

Example:
    >>> groups = normalized_groups({"config_groups": {"v": {"type": "hadamard", "apply": []}}}, "QuIPModifier")
    >>> groups["v"]["precision"], groups["v"]["head_dim"]
    ('torch.float32', None)
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# Fields of every scheme that map onto the modifier's arguments: the scheme's field -> the argument
COMMON_FIELDS = {"type": "transform_type", "precision": "precision"}


def normalized_groups(config: Any, who: str) -> dict[str, dict[str, Any]]:
    """``config`` as compressed-tensors serialises a TransformConfig: its ``config_groups``, every field filled.

    Args:
        config: the ``transform_config`` argument (a mapping, or a compressed-tensors TransformConfig).
        who: the modifier's name, for messages.

    Returns:
        Group name -> the group's TransformScheme as JSON (``model_dump(mode="json")``).

    Raises:
        ValueError: it is not a TransformConfig (compressed-tensors' own message, naming the field).
    """
    from compressed_tensors.transform import TransformConfig

    try:
        parsed = TransformConfig.model_validate(config)
    except Exception as exc:  # pydantic's ValidationError names the bad fields
        raise ValueError(
            f"{who}: transform_config is not a compressed-tensors TransformConfig ({exc}); write it as "
            "llm-compressor saves it, {config_groups: {NAME: {type, apply: [...], head_dim, precision}}}"
        ) from exc
    return parsed.model_dump(mode="json")["config_groups"]


def common_arguments(groups: dict[str, dict[str, Any]], who: str) -> dict[str, Any]:
    """The arguments every group shares (transform_type, precision), refusing what seqcal does not implement.

    Raises:
        ValueError: a group randomizes or learns its rotation, or two groups disagree on a shared field.
    """
    out: dict[str, Any] = {}
    for name, scheme in groups.items():
        for field in ("randomize", "requires_grad"):
            if scheme.get(field):
                raise ValueError(f"{who}: transform_config.config_groups.{name}.{field} is true, which seqcal does "
                                 f"not implement; set it to false")  # fmt: skip
        for field, argument in COMMON_FIELDS.items():
            value = scheme.get(field)
            if out.setdefault(argument, value) != value:
                raise ValueError(f"{who}: transform_config.config_groups.{name}.{field} is {value!r} while another "
                                 f"group has {out[argument]!r}; seqcal's {argument} is one value for every rotation of "
                                 "the modifier: make them equal")  # fmt: skip
    return out


def apply_arguments(modifier: Any, arguments: dict[str, Any]) -> None:
    """Set ``arguments`` (read from the transform_config) on ``modifier``; each one that differs from what the
    recipe gave is logged: the config wins, as in llm-compressor, where it overrides the arguments."""
    for name, value in arguments.items():
        given = getattr(modifier, name)
        if isinstance(given, str) and isinstance(value, list):
            given = [given]  # targets: "Linear" is ["Linear"]
        if _plain(given) != _plain(value):
            logger.warning("%s: transform_config gives %s=%r where the arguments give %r; the transform_config "
                           "is applied, as llm-compressor applies it", modifier.name, name, value, given)  # fmt: skip
        setattr(modifier, name, value)


def check_same(given: dict[str, Any], ours: dict[str, Any], who: str) -> None:
    """Refuse a transform_config that differs from the one seqcal builds from the arguments read out of it.

    Args:
        given: the normalized ``config_groups`` of the recipe.
        ours: ``modifier.transform_groups(model)``, what seqcal applies and writes to the checkpoint.
        who: the modifier's name.

    Raises:
        ValueError: one sentence naming the first field that differs, its value and seqcal's.
    """
    found = _difference(given, ours, "config_groups")
    if found is None:
        return
    path, theirs, mine = found
    raise ValueError(
        f"{who}: transform_config.{path} is {theirs!r} where seqcal's {who} builds {mine!r} from the same "
        f"arguments; seqcal applies only the rotations its arguments describe, so it cannot honour this "
        f"transform_config: remove it and give the modifier's arguments, or run the recipe with llm-compressor"
    )


def _difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first path (in a's order) where ``a`` and ``b`` differ, with both values; None when equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            if key not in a or key not in b:
                return f"{path}.{key}", a.get(key, "(absent)"), b.get(key, "(absent)")
            if (found := _difference(a[key], b[key], f"{path}.{key}")) is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if (found := _difference(x, y, f"{path}[{i}]")) is not None:
                return found
        return None
    return None if _plain(a) == _plain(b) else (path, a, b)


def _plain(value: Any) -> Any:
    """Lists and tuples alike; a dtype and its name alike (``torch.float64``, "float64")."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is not None and not isinstance(value, (bool, int, float, dict)):
        return str(value).removeprefix("torch.")
    return value
