"""llm-compressor's ``oneshot`` keywords, translated for seqcal's ``oneshot`` in one table.

llm-compressor 0.14's ``oneshot`` takes the fields of its ModelArguments, DatasetArguments and RecipeArguments
plus ``output_dir`` and ``log_dir``. Most have the same name in seqcal and reach ``oneshot`` directly. The
others are listed here, each with what seqcal does with it:

- ``ALIASES``: the same meaning under seqcal's name (``concatenate_data`` is ``concatenate``).
- ``VALUE_ALIASES``: a value of a shared keyword that seqcal spells differently (``pipeline="independent"``).
- ``RULES``: keywords seqcal has no parameter for. ``accepts`` lists the values that describe what seqcal
  does anyway (None: every value): those are accepted and the ``note`` says why in a log record; any other
  value is refused with ``refusal``, which says why seqcal lacks it and what to use instead. A rule with an
  empty ``accepts`` tuple refuses every value.

Example:
    >>> from seqcal.entrypoint import oneshot
    >>> args = {**{n: p.default for n, p in inspect.signature(oneshot).parameters.items()}, "model": "m"}
    >>> translate(oneshot, {**args, "unknown": {"concatenate_data": True}})["concatenate"]
    True
"""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("seqcal")


@dataclass(frozen=True)
class Rule:
    """seqcal's answer to an llm-compressor keyword it has no parameter for.

    Args:
        accepts: values that match seqcal's own behaviour (None: every value; ``()``: none).
        note: why an accepted value changes nothing in seqcal; logged once per call.
        refusal: why other values are refused and what to use instead.
    """

    accepts: tuple[Any, ...] | None
    note: str = ""
    refusal: str = ""


# llm-compressor name -> seqcal name, same meaning.
ALIASES: dict[str, str] = {
    "trust_remote_code_model": "trust_remote_code",
    "concatenate_data": "concatenate",
    # a tokenizer or processor object (its tokenizer batches text, the processor is saved with the checkpoint),
    # or a directory or Hub id to load the tokenizer from (its processor files are copied beside the checkpoint)
    "processor": "tokenizer",
    "precision": "dtype",  # "auto", "float32", "bfloat16", "float16"
    "dataset_path": "dataset",  # a local json/csv/... file; seqcal's dataset takes paths too
    # earlier releases: True replaced MoE blocks by ones that send every token to every expert
    "calibrate_moe_context": "moe_calibrate_all_experts",
    # where the activations between subgraphs wait: "cpu", or a device such as "cuda:1" (seqcal also has "disk",
    # and "device" for the execution device)
    "sequential_offload_device": "offload",
}

# keyword -> {llm-compressor value: seqcal value}
VALUE_ALIASES: dict[str, dict[Any, Any]] = {
    # llm-compressor's default: each modifier picks its pipeline. seqcal's sequential pipeline runs every
    # modifier, data-free ones included, one subgraph at a time.
    "pipeline": {"independent": "sequential"},
}

_PADDING = "seqcal pads each batch to its longest sample and masks the padding"
RULES: dict[str, Rule] = {
    # ---- model arguments
    "save_compressed": Rule(
        (True,),
        "seqcal always writes the compressed compressed-tensors checkpoint",
        "seqcal writes only compressed checkpoints; for dense fake-quantized weights, call "
        "save_pretrained on the model oneshot returns",
    ),
    "tie_word_embeddings": Rule(
        (True,),
        "seqcal keeps tied embeddings tied",
        "seqcal keeps tied embeddings tied; to quantize lm_head on its own, give it its "
        "own weight and set config.tie_word_embeddings=False on the model you pass",
    ),
    "config_name": Rule(
        (None,),
        refusal="seqcal reads config.json from the model's directory; put the config "
        "there or load the model yourself and pass it",
    ),
    "use_auth_token": Rule(None, "huggingface_hub reads the token from HF_TOKEN or `hf auth login` itself"),
    "oneshot_device": Rule(
        None,
        "seqcal picks the execution device itself (the first CUDA GPU when available, "
        "else the CPU); choose the GPU with CUDA_VISIBLE_DEVICES",
    ),
    "distill_teacher": Rule((None,), refusal="distillation is training; seqcal only calibrates"),
    # ---- recipe arguments
    "clear_sparse_session": Rule(None, "seqcal keeps no session between runs"),
    "recipe_args": Rule(
        (None, [], {}), refusal="seqcal recipes have no variables; write the values into the recipe"
    ),
    "stage": Rule(
        (None,),
        refusal="seqcal runs every stage of a recipe in order; pass a recipe holding only the stage to run",
    ),
    # ---- dataset arguments
    "pad_to_max_length": Rule(
        (False,), _PADDING, f"{_PADDING}: padding to max_seq_length adds only masked tokens"
    ),
    "streaming": Rule(
        (False,),
        "seqcal reads the split it calibrates on",
        "seqcal selects and shuffles samples from a whole split; load it without streaming "
        "(e.g. splits='train[:512]') or pass a list of rows",
    ),
    "overwrite_cache": Rule(None, "seqcal keeps no cache of preprocessed datasets"),
    "preprocessing_num_workers": Rule(None, "seqcal tokenizes the calibration samples in this process"),
    "dataloader_num_workers": Rule(None, "seqcal tokenizes the calibration samples in this process"),
    "remove_columns": Rule(
        None,
        "seqcal reads only text_column, 'messages' or 'input_ids' from a text row; rows with images or audio "
        "must hold model inputs only (a column the forward does not take is an error naming it)",
    ),
    "raw_kwargs": Rule(
        (None, {}),
        refusal="load the dataset yourself with datasets.load_dataset(..., **kwargs) and pass the Dataset",
    ),
    "dvc_data_repository": Rule(
        (None,), refusal="seqcal does not read DVC repositories; pass a local file or a Dataset"
    ),
    "min_tokens_per_module": Rule(
        None, "in llm-compressor it only sets when to warn about rarely routed MoE experts"
    ),
    # ---- pipeline arguments (DatasetArguments in llm-compressor)
    "sequential_targets_per_subgraph": Rule(
        (1,),
        "seqcal gives each sequential target its own subgraph",
        "seqcal gives each target its own subgraph; to calibrate coarser "
        "pieces, name a larger module class in sequential_targets",
    ),
    "sequential_prefetch": Rule(
        None, "a speed option; seqcal's executor moves each subgraph's weights itself"
    ),
    "quantization_aware_calibration": Rule(
        None, "deprecated in llm-compressor, where it has no effect either"
    ),
    "propagate_error": Rule(
        (True,),
        "seqcal feeds each subgraph the outputs of the quantized earlier ones",
        "seqcal always feeds each subgraph the outputs of the quantized earlier ones",
    ),
    "use_loss_mask": Rule(
        (False,),
        "seqcal weighs every unpadded token",
        "seqcal weighs every unpadded token; drop the tokens to ignore from the samples",
    ),
    # ---- miscellaneous
    "log_dir": Rule(
        None,
        "seqcal writes no log files: its records go to the 'seqcal' logger (add a "
        "logging.FileHandler), and profile= writes a trace of the run",
    ),
}


def needs_translation(bound: dict[str, Any]) -> bool:
    """Whether a call's arguments hold an unknown keyword or an llm-compressor value (``VALUE_ALIASES``).

    Example:
        >>> needs_translation({"pipeline": "independent", "unknown": {}})
        True
    """
    return bool(bound.get("unknown")) or any(
        isinstance(bound.get(name), str) and bound[name] in values for name, values in VALUE_ALIASES.items()
    )


def translate(func: Callable[..., Any], bound: dict[str, Any]) -> dict[str, Any]:
    """Rewrite llm-compressor keywords into ``func``'s own, dropping the no-ops with a logged note.

    Args:
        func: seqcal's ``oneshot`` (its signature gives the valid names and their defaults).
        bound: the call's arguments by name, plus ``"unknown"``: the keywords ``func`` has no parameter for.

    Returns:
        Keyword arguments for ``func`` with no unknown keyword left.

    Raises:
        TypeError: a keyword neither seqcal nor llm-compressor 0.14 knows, an alias given together with
            seqcal's name for it, or a value seqcal cannot honour; the message names the keyword.

    Example:
        >>> from seqcal.entrypoint import oneshot
        >>> defaults = {n: p.default for n, p in inspect.signature(oneshot).parameters.items()}
        >>> kwargs = translate(oneshot, {**defaults, "model": "m", "unknown": {"trust_remote_code_model": True}})
        >>> kwargs["trust_remote_code"]
        True
    """
    params = inspect.signature(func).parameters
    defaults = {n: p.default for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    kwargs = {name: bound[name] for name in defaults}
    unknown = dict(bound.get("unknown") or {})
    _refuse_unknown(unknown, list(defaults))
    for name, value in unknown.items():
        if name in ALIASES:
            target = ALIASES[name]
            if _same(value, defaults[target]):  # llm-compressor's default is seqcal's: nothing given
                continue
            if kwargs[target] is not defaults[target] and not _same(kwargs[target], value):
                raise TypeError(
                    f"oneshot(): {name}={value!r} is llm-compressor's name for {target}, which is also "
                    f"given ({target}={kwargs[target]!r}); pass only one of them"
                )
            kwargs[target] = value
            continue
        rule = RULES[name]
        if rule.accepts is not None and not any(_same(value, ok) for ok in rule.accepts):
            raise TypeError(f"oneshot(): {name}={value!r} is not supported: {rule.refusal}")
        logger.warning("seqcal: oneshot(%s=%r) changes nothing: %s", name, value, rule.note)
    for name, values in VALUE_ALIASES.items():
        if isinstance(kwargs[name], str) and kwargs[name] in values:
            logger.info("seqcal: %s=%r runs as %s=%r", name, kwargs[name], name, values[kwargs[name]])
            kwargs[name] = values[kwargs[name]]
    return kwargs


def _same(value: Any, ok: Any) -> bool:
    """``value == ok`` for plain values; type matters (1 is not True), and other objects never match."""
    plain = (bool, int, float, str, type(None), list, dict)
    return type(value) is type(ok) and isinstance(ok, plain) and value == ok


def _refuse_unknown(unknown: dict[str, Any], valid: list[str]) -> None:
    """Raise for keywords that neither seqcal nor llm-compressor has, with a close name when there is one."""
    strangers = [k for k in unknown if k not in ALIASES and k not in RULES]
    if not strangers:
        return
    names = valid + sorted(ALIASES) + sorted(RULES)
    hints = {k: difflib.get_close_matches(k, names, n=1) for k in strangers}
    raise TypeError(
        "oneshot() got unknown argument(s): "
        + ", ".join(f"{k}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
        + f"; valid arguments: {', '.join(valid)}, and llm-compressor's {', '.join(sorted(ALIASES))}"
    )
