"""Checks of what the user passed as the model, before any weight is read.

Each check raises a one-sentence error (what is wrong, where, the fix) or logs a warning; ``oneshot`` calls
them between its stages so that nothing is calibrated or written for input that cannot give a valid model.

Example:
    >>> check_model_dir(Path("out/llama-hqq"))  # doctest: +SKIP
    SourceFormatError: out/llama-hqq/config.json: quantization_config has quant_method 'hqq', which ...
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from seqcal.data.args import DataArgs
from seqcal.data.batches import needs_tokenizer
from seqcal.sources.detect import detect_source

logger = logging.getLogger("seqcal")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: str | Path) -> None:
    """Refuse a model directory without config.json, or one quantized in a format seqcal cannot dequantize.

    Args:
        path: the local model directory (after aliases are resolved).

    Raises:
        ValueError: no readable config.json, or a ``quantization_config`` of an unknown ``quant_method``.

    Example:
        >>> check_model_dir(default_model_dir())  # doctest: +SKIP
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        held = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
        shown = ", ".join(held[:8]) + (f" and {len(held) - 8} more" if len(held) > 8 else "") or "nothing"
        nested = sorted(str(p.parent) for p in path.glob("*/config.json"))
        fix = f"pass {nested[0]!r}, which has one" if nested else "pass the directory save_pretrained wrote"
        raise ValueError(f"model directory {str(path)!r} has no config.json (it holds: {shown}); a model "
                         f"directory holds config.json and *.safetensors weights: {fix}")  # fmt: skip
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{config_file}: cannot read it as JSON ({err}); restore the model's config.json"
        ) from err
    # a quantized checkpoint is read dequantized (seqcal.sources); one in a format seqcal cannot read is refused
    detect_source(config.get("quantization_config") if isinstance(config, dict) else None, str(config_file))


def check_tokenizer(tokenizer: Any, data_args: DataArgs | None, model: Any) -> None:
    """Refuse text calibration data when no tokenizer was given or found next to the model.

    Args:
        tokenizer: the tokenizer in use (None when neither given nor found).
        data_args: the calibration data (None: the pipeline needs no data).
        model: the ``model`` argument as given (a directory, an alias or a loaded model).

    Raises:
        ValueError: the data is text and there is no tokenizer; names where the tokenizer was looked for.

    Example:
        >>> check_tokenizer(None, DataArgs(torch.ones(4, 16).long()), "my-model")  # token ids: fine
    """
    if tokenizer is not None or data_args is None or not needs_tokenizer(data_args):
        return
    where = (
        f"the model directory {str(model)!r} has no tokenizer ({', '.join(TOKENIZER_FILES)})"
        if isinstance(model, (str, Path))
        else f"no tokenizer was given with the loaded {type(model).__name__}"
    )
    raise ValueError(f"the calibration data is text, but {where}; pass tokenizer= (a tokenizer or the "
                     "directory that holds one), or token-id data such as dataset={'input_ids': ids}")  # fmt: skip


def check_max_seq_length(model: torch.nn.Module, data_args: DataArgs | None) -> None:
    """Compare ``max_seq_length`` with the positions the model was trained on.

    Positions past ``max_position_embeddings`` give activations the model never produced in training, so
    calibrating on them fits the quantization to meaningless statistics. With ``concatenate=True`` every
    sample is exactly ``max_seq_length`` tokens long, so that is refused; otherwise only samples longer
    than the limit are affected, and a warning says so.

    Args:
        model: the model (its ``config`` or text config holds ``max_position_embeddings``).
        data_args: the calibration data (None: no data).

    Raises:
        ValueError: ``concatenate=True`` with ``max_seq_length`` beyond the model's positions.

    Example:
        >>> check_max_seq_length(model, DataArgs("default", max_seq_length=512))  # doctest: +SKIP
    """
    config = getattr(model, "config", None)
    if data_args is None or config is None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or data_args.max_seq_length <= limit:
        return
    what = (f"max_seq_length={data_args.max_seq_length} is beyond the {limit} positions the model was trained "
            f"on (config.max_position_embeddings)")  # fmt: skip
    if data_args.concatenate:
        raise ValueError(f"{what}, and concatenate=True makes every sample that long; set "
                         f"max_seq_length={limit} or less")  # fmt: skip
    logger.warning("seqcal: %s; samples longer than %d tokens calibrate on positions the model never saw: "
                   "set max_seq_length=%d or less", what, limit, limit)  # fmt: skip


def check_data_for_model(
    model: torch.nn.Module, tokenizer: Any, data_args: DataArgs | None, given: Any
) -> None:
    """``check_tokenizer`` and ``check_max_seq_length``, as ``oneshot`` calls them before calibrating.

    Args:
        model: the loaded model.
        tokenizer: its tokenizer, or None.
        data_args: the calibration data (None: no data).
        given: the ``model`` argument as the user gave it, for messages.

    Example:
        >>> check_data_for_model(model, tokenizer, DataArgs("default"), "default")  # doctest: +SKIP
    """
    check_tokenizer(tokenizer, data_args, given)
    check_max_seq_length(model, data_args)
