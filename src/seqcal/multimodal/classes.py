"""Which transformers class a checkpoint is loaded with: the one it was saved from, else the task's.

A vision-language model (Llava, Qwen2.5-VL, Gemma 3, Mistral 3, Idefics3, Llama 4) has no entry in
``AutoModelForCausalLM`` or one that drops its vision tower (Llama 4, Gemma 3: the text model only); a
speech model's causal-LM entry is its decoder alone (``WhisperForCausalLM``). So the class comes from the
config: the class named in ``config.architectures`` when transformers has it, else the first task in
``TASKS`` whose auto mapping holds the config's type. The checkpoint then reloads with the same class.

Example:
    >>> from transformers import LlavaConfig
    >>> model_class(LlavaConfig()).__name__
    'LlavaForConditionalGeneration'
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("seqcal")

# task -> (auto class, the name of its model-type mapping in transformers.models.auto.modeling_auto), in the
# order tried: a config in several mappings gets the first (Whisper: speech-to-text, not its decoder alone).
TASKS: dict[str, tuple[str, str]] = {
    "image-text-to-text": ("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
    "speech-to-text": ("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    "seq2seq": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
}


def model_task(config: Any) -> str:
    """The first of ``TASKS`` whose auto mapping has ``config``'s model type ("causal-lm" if none does).

    Example:
        >>> from transformers import WhisperConfig
        >>> model_task(WhisperConfig())
        'speech-to-text'
    """
    from transformers.models.auto import modeling_auto

    model_type = getattr(config, "model_type", None)
    for task, (_, mapping) in TASKS.items():
        if model_type in getattr(modeling_auto, mapping, {}):
            return task
    return "causal-lm"


def model_class(config: Any, trust_remote_code: bool = False) -> Any:
    """The class to build a model of ``config`` with: a concrete transformers class or an auto class.

    Args:
        config: a transformers ``PretrainedConfig``.
        trust_remote_code: whether the checkpoint's own code may be used (then its ``auto_map`` decides).

    Returns:
        ``config.architectures[0]``'s class when transformers has it and it is a model of one of ``TASKS``,
        else the auto class of ``model_task(config)``; both have ``from_pretrained`` (``build`` makes one
        from the config alone).
    """
    import transformers
    from transformers.models.auto import modeling_auto

    task_auto = getattr(transformers, TASKS[model_task(config)][0])
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and auto_map:  # the checkpoint's code: the first task its auto_map names
        for auto_name, _ in TASKS.values():
            if auto_name in auto_map:
                return getattr(transformers, auto_name)
        return task_auto
    named = (getattr(config, "architectures", None) or [None])[0]
    known = {
        cls for _, mapping in TASKS.values() for cls in getattr(modeling_auto, mapping, {}).values()
    }  # class names; a mapping value may also be a tuple of names
    known = {c for v in known for c in ((v,) if isinstance(v, str) else v)}
    if named in known and hasattr(transformers, named):
        return getattr(transformers, named)
    return task_auto


def build(config: Any, dtype: torch.dtype, trust_remote_code: bool = False) -> torch.nn.Module:
    """A model of ``config`` with ``model_class``'s class, weights initialised (call under meta to skip that).

    Example:
        >>> build(LlavaConfig(), torch.float32)  # doctest: +SKIP
    """
    cls = model_class(config, trust_remote_code)
    if cls.__name__.startswith("AutoModel"):
        return fix_forward(cls.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code))
    return fix_forward(cls._from_config(config, dtype=dtype))


def from_pretrained(source: str, dtype: Any, trust_remote_code: bool = False) -> torch.nn.Module:
    """``from_pretrained`` of ``model_class``'s class for the checkpoint in ``source`` (weights in RAM).

    Example:
        >>> from_pretrained("llava-dir", "auto")  # doctest: +SKIP
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    cls = model_class(config, trust_remote_code)
    return fix_forward(cls.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code))


def _llama4_image_outputs(model: torch.nn.Module) -> None:
    """transformers 5.24's ``Llama4ForConditionalGeneration.forward`` reads ``image_outputs`` from its language
    model's output, which has no such field, so every call fails after the last layer; a forward hook gives the
    language model's output ``image_outputs=None`` (the model's output then carries None there, as for text
    alone). A traced graph runs without module hooks, so its partition check falls back to layer-by-layer."""
    language = getattr(model, "language_model", None)
    if language is not None and not any(h is _no_image_outputs for h in language._forward_hooks.values()):
        language.register_forward_hook(_no_image_outputs)


def _no_image_outputs(module: torch.nn.Module, args: Any, output: Any) -> Any:
    if not isinstance(output, tuple) and "image_outputs" not in getattr(
        type(output), "__dataclass_fields__", {}
    ):
        output.image_outputs = None  # a ModelOutput keeps an attribute outside its fields as it is
    return output


# model class -> the fix for a transformers bug in its forward (each a no-op where transformers has none).
FORWARD_FIXES: dict[str, Callable[[torch.nn.Module], Any]] = {
    "Llama4ForConditionalGeneration": _llama4_image_outputs,
}


def fix_forward(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with ``FORWARD_FIXES``' fix for its class applied once (kept for the model's life: its own
    forward then runs, for calibration's checks and for the caller); ``model`` as it is for other classes."""
    fix = FORWARD_FIXES.get(type(model).__name__)
    if fix is not None:
        fix(model)
    return model
