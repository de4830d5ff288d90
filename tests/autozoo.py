"""The full architecture zoo: every model type of transformers' auto mappings, built from a tiny config.

``candidates()`` enumerates transformers' own auto mappings (not a hand list) and picks, per
``model_type``, the class a user would quantize: the image-text-to-text class of a vision-language
model, else the seq2seq LM, else the masked LM of an encoder, else the causal LM. ``tiny_config``
shrinks the config class's defaults by the generic rules of ``tests/autozoo_rules.py`` (sizes, layer
counts with their layer-type patterns, heads, experts, vocab and special token ids, image sizes),
recursively into sub-configs; ``OVERRIDES`` holds the few per-model fixes a generic rule cannot make. ``build`` returns
the seeded fp32 model in eval mode and ``make_inputs`` valid text inputs (``tests/zoo_inputs.py``).

Only the standard library, torch and transformers are imported, so benchmark workers can load it.

Example:
    >>> arch = candidates()["llama"]
    >>> arch.class_name, arch.family
    ('LlamaForCausalLM', 'decoder')
    >>> model = build(arch)
    >>> model.config.num_hidden_layers, model.config.vocab_size
    (2, 256)
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autozoo_rules import HEAD_DIM, HIDDEN, VOCAB, shrink
from zoo_inputs import Inputs, seq2seq_inputs, text_inputs

__all__ = [
    "HEAD_DIM",
    "HIDDEN",
    "VOCAB",
    "AutoArch",
    "build",
    "candidates",
    "family",
    "make_inputs",
    "shrink",
    "tiny_config",
]

# Priority of the mappings: the first one holding a model type gives its class and family.
MAPPINGS = (
    ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "vlm"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "encoder-decoder"),
    # An encoder with both heads (BERT's LMHeadModel is the same stack run causally) is quantized as an encoder.
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "encoder"),
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "decoder"),
)


@dataclass(frozen=True)
class AutoArch:
    """One model type of the auto mappings.

    Args:
        model_type: the config's ``model_type`` (key of ``CONFIG_MAPPING``).
        class_name: the model class chosen from the mappings (``"LlamaForCausalLM"``).
        family: ``"decoder"``, ``"moe"``, ``"hybrid"``, ``"encoder"``, ``"encoder-decoder"`` or ``"vlm"``.
        mapping: the auto mapping the class came from.
    """

    model_type: str
    class_name: str
    family: str
    mapping: str


def candidates() -> dict[str, AutoArch]:
    """Every model type of the four auto mappings, with the class a user would quantize.

    Returns:
        model_type -> AutoArch, sorted by model type.

    Example:
        >>> candidates()["t5"].family
        'encoder-decoder'
    """
    from transformers.models.auto import modeling_auto

    found: dict[str, AutoArch] = {}
    for mapping, family in MAPPINGS:
        for model_type, class_name in getattr(modeling_auto, mapping).items():
            if isinstance(class_name, (tuple, list)):  # several classes: the first is the default
                class_name = class_name[0]
            found.setdefault(model_type, AutoArch(model_type, class_name, family, mapping))
    return dict(sorted(found.items()))


# Per-model fixes a generic rule cannot make: model_type -> function editing the shrunk dict.
OVERRIDES: dict[str, Callable[[dict[str, Any]], None]] = {
    # The default configs have no attention layer at all, and a cache without one cannot tell its length.
    "bamba": lambda c: c.update(attn_layer_indices=[1]),
    "granitemoehybrid": lambda c: c.update(layer_types=["linear_attention", "full_attention"]),
    # Gemma-3n: the last num_kv_shared_layers layers reuse the caches of the earlier ones, so both parts
    # must hold every layer type: two rounds of the 4-sliding-1-full pattern, the second one sharing.
    "gemma3n_text": lambda c: _gemma3n(c),
    "gemma3n": lambda c: _gemma3n(c["text_config"]),
    # Input, recurrent and output layers must add up to the layer count (their defaults: 16 + 40 + 16).
    "dory": lambda c: c.update(
        num_hidden_layers=6,
        n_input_layers=2,
        n_recurrent_layers=2,
        n_output_layers=2,
        layer_types=["sliding_attention", "mlp"] * 3,
    ),
    # xLSTM's native kernels size the recurrent state with the value head dim for the keys too, so the
    # default qk_dim_factor 0.5 fails eagerly ("matC_old has wrong shape").
    "xlstm": lambda c: c.update(qk_dim_factor=1.0),
    # Axial position embeddings: a pair of widths that must sum to hidden_size.
    "reformer": lambda c: c.update(axial_pos_embds_dim=[HIDDEN // 2, HIDDEN // 2]),
}


def _gemma3n(text: dict[str, Any]) -> None:
    pattern = (["sliding_attention"] * 4 + ["full_attention"]) * 2
    text.update(num_hidden_layers=10, num_kv_shared_layers=5, layer_types=pattern)
    for key in ("intermediate_size", "activation_sparsity_pattern"):
        if isinstance(text.get(key), list):
            text[key] = (text[key] * 10)[:10]


def tiny_config(model_type: str) -> Any:
    """The config class's defaults shrunk by ``shrink`` (and ``OVERRIDES``), as a config object.

    Args:
        model_type: a key of transformers' ``CONFIG_MAPPING``.

    Returns:
        The tiny ``PretrainedConfig``.

    Example:
        >>> tiny_config("llama").hidden_size
        64
    """
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    default = config_cls().to_dict()
    config = shrink(copy.deepcopy(default))
    if model_type in OVERRIDES:
        OVERRIDES[model_type](config)
    # Only the changed values are passed: the class derives the rest from them as it does by default.
    return config_cls(**_changes(default, config))


def _changes(default: dict[str, Any], tiny: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``tiny`` that differ from ``default``; a sub-config keeps its ``model_type``."""
    changed: dict[str, Any] = {}
    for key, value in tiny.items():
        old = default.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and "model_type" in value:
            sub = _changes(old, value)
            if sub:
                changed[key] = {"model_type": value["model_type"], **sub}
        elif value != old:
            changed[key] = value
    return changed


def build(arch: AutoArch) -> torch.nn.Module:
    """The tiny model of ``arch``: fp32, ``eval()``, weights seeded (the caller's RNG untouched).

    Example:
        >>> build(candidates()["gpt2"]).config.n_layer
        2
    """
    import transformers

    config = tiny_config(arch.model_type)
    model_cls = getattr(transformers, arch.class_name)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        model = model_cls(config)
    return model.float().eval()


def family(arch: AutoArch, model: torch.nn.Module) -> str:
    """``arch.family``, with decoders split into ``moe`` (experts) and ``hybrid`` (several layer types)."""
    if arch.family != "decoder":
        return arch.family
    config = model.config.get_text_config().to_dict()
    types = set(config.get("layer_types") or ())
    if len(types - {"sliding_attention", "full_attention", "chunked_attention"}) > 0 or "mamba" in str(
        config
    ):
        return "hybrid"
    return "moe" if any("expert" in k for k in config) else "decoder"


def make_inputs(model: torch.nn.Module, batch: int = 1, seq_len: int = 12, left_pad: int = 0) -> Inputs:
    """Text inputs for ``model``: with ``decoder_input_ids`` when its forward takes them (seq2seq).

    Example:
        >>> sorted(make_inputs(model, batch=2, seq_len=9, left_pad=3))  # doctest: +SKIP
        ['attention_mask', 'input_ids']
    """
    params = inspect.signature(model.forward).parameters
    maker = seq2seq_inputs if "decoder_input_ids" in params else text_inputs
    return maker(model, batch, seq_len, left_pad)
