"""When a quantized source may be quantized again: only to fewer bits, unless the user asks.

Dequantizing an FP8 or MXFP8 checkpoint and quantizing it to 4 bits loses little beyond the 4-bit rounding:
the recipe's grid is much coarser than the source's. A source at or below the recipe's precision (NVFP4 to
W4A16, int4 to int4, FP8 to W8A16) rounds values already rounded to a grid of the same size onto another one:
the two errors compound. Such a run happens only with ``requantize=True`` (``--requantize``), and says so.

Example:
    >>> check_requantize(SourceFormat("fp8", "fp8-block", 8, "float"), modifiers, requantize=False)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from seqcal.sources.format import SourceFormat, SourceFormatError

logger = logging.getLogger("seqcal")


def target_bits(modifiers: Iterable[Any]) -> dict[str, int]:
    """Each "<Modifier> <group>" -> its weights' bits, over every quantizing modifier of the recipe."""
    out = {}
    for modifier in modifiers:
        groups = modifier.scheme_groups() if hasattr(modifier, "scheme_groups") else {}
        for name, scheme in groups.items():
            if getattr(scheme, "weights", None) is not None:
                out[f"{type(modifier).__name__} {name}"] = int(scheme.weights.num_bits)
    return out


def check_requantize(source: SourceFormat | None, modifiers: Iterable[Any], requantize: bool,
                     model: object = "the model") -> list[str]:  # fmt: skip
    """Refuse a source at or below the recipe's precision without ``requantize``; log what runs.

    Args:
        source: the checkpoint's stored format (None: full precision, nothing to check).
        modifiers: the recipe's modifiers (their ``scheme_groups()``).
        requantize: the user's ``requantize`` (``--requantize``).
        model: the model as the user named it, for the messages.

    Returns:
        The log lines (also logged): empty for a full-precision source.

    Raises:
        SourceFormatError: a scheme quantizes to as many bits as the source has, or more, and ``requantize``
            is False.
    """
    if source is None:
        return []
    stored = f"{source.name} ({source.weight_bits}-bit {source.weight_type})"
    lines = [f"{model}: weights stored as {stored}, each dequantized as its subgraph reads it"]
    at_or_above = {name: bits for name, bits in target_bits(modifiers).items() if bits >= source.weight_bits}
    if at_or_above:
        name, bits = next(iter(at_or_above.items()))
        if not requantize:
            raise SourceFormatError(f"{model}: its weights are stored as {stored}, at or below the precision of "
                                    f"the recipe's {name} ({bits}-bit weights); quantizing them again compounds "
                                    "the two rounding errors: pass requantize=True (--requantize) to run it "
                                    "anyway, or start from the unquantized model")  # fmt: skip
        lines.append(f"requantizing {stored} weights to {name} ({bits}-bit): the errors of the two roundings "
                     "compound (requantize=True)")  # fmt: skip
    for line in lines:
        (logger.warning if "compound" in line else logger.info)("seqcal: %s", line)
    return lines


def check_source(model_args: Any, modifiers: Iterable[Any], requantize: bool) -> dict[str, Any]:
    """The model directory's stored format checked against the recipe (``check_requantize``), before loading.

    Returns:
        ``{"source_format": {...}}`` for the report and the output's quantization_config (the format, its
        bits, whether it was requantized), or ``{}`` for a full-precision model, or one given in memory that
        does not name a quantized checkpoint directory (``name_or_path``) as where it came from.
    """
    from seqcal.models import resolve_model
    from seqcal.sources.checkpoint import source_format

    model = model_args.model
    if isinstance(model, str) or hasattr(model, "__fspath__"):
        path = resolve_model(model, model_args.revision, model_args.trust_remote_code)
    else:  # a model in memory: the directory it was loaded from, if it says (the CLI's --eval loads it first)
        path = getattr(model, "name_or_path", None)
        if not path or not Path(path, "config.json").is_file():
            return {}
        model = path
    source = source_format(path)
    lines = check_requantize(source, modifiers, requantize, model)
    if source is None:
        return {}
    return {"source_format": source.record() | {"requantized": any("compound" in line for line in lines)}}
