"""Gemma 2 and Gemma 3 (text) in llama.cpp's conventions, as its converter (convert_hf_to_gguf.py) writes them.

- Norm weights are stored plus one: transformers' Gemma RMSNorm computes ``x * (1 + w)``, llama.cpp's ``x * w``.
  The sum is taken in float32 (the norms are F32 in the file), which is what transformers' float32 norm computes.
- Keys: the sliding window, the logit soft-capping (Gemma 2: attention and final; Gemma 3: final only, when set),
  and for Gemma 3 the sliding layers' own rotary base (``rope.freq_base_swa``) and the full layers' linear
  rotary scaling. Which layers slide llama.cpp takes from a pattern (every 2nd layer full for Gemma 2, every 6th
  for Gemma 3); a model whose ``layer_types`` differ gets the per-layer array instead.
- What llama.cpp fixes in code and cannot be told by a key is checked instead and refused in one sentence: the
  attention scale (``query_pre_attn_scalar``: llama.cpp uses the head size, or hidden / heads for the 27B
  shapes), Gemma 2's soft-capping and tied output projection (llama.cpp's Gemma 2 always has them),
  bidirectional attention (EmbeddingGemma) and rotary scaling llama.cpp does not apply per layer type.

Example:
    >>> norm_shifted("model.layers.0.post_feedforward_layernorm.weight"), norm_shifted("model.layers.0.mlp.up_proj.weight")
    (True, False)
"""

from __future__ import annotations

import math
from typing import Any

import gguf

GEMMA_ARCHES = ("gemma2", "gemma3")
_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's load_swa_pattern defaults: every n-th layer is full
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales queries by hidden / heads for these shapes


def norm_shifted(hf_name: str) -> bool:
    """Whether a Gemma parameter is a norm weight llama.cpp stores plus one (the converter's test)."""
    return hf_name.endswith("norm.weight")


def _layer_types(config: Any, arch: str) -> list[str]:
    n = _PATTERN[arch]
    return [
        "sliding_attention" if i % n < n - 1 else "full_attention" for i in range(config.num_hidden_layers)
    ]


def gemma_refusal(config: Any, arch: str) -> str | None:
    """What of a Gemma config llama.cpp would compute differently from transformers (the ``with ...`` part of a
    sentence), or None when the file can say everything."""
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    wide = config.num_hidden_layers == _LAYERS_27B[arch]
    expected = config.hidden_size / config.num_attention_heads if wide else head
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if scalar is not None and not math.isclose(float(scalar), float(expected)):
        return (f"query_pre_attn_scalar {scalar} (llama.cpp scales queries by 1/sqrt({expected:g}) for "
                f"{config.num_hidden_layers} layers)")  # fmt: skip
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (an embedding model)"
    attn_cap = getattr(config, "attn_logit_softcapping", None)
    if arch == "gemma2":
        if attn_cap is None or config.final_logit_softcapping is None or config.sliding_window is None:
            return "no attention or final logit soft-capping or no sliding window (llama.cpp's Gemma 2 always has them)"
        if not getattr(config, "tie_word_embeddings", True):
            return "an output projection of its own (llama.cpp's Gemma 2 reads the token embedding)"
        return None
    if attn_cap is not None:
        return f"attention logit soft-capping {attn_cap} (llama.cpp's Gemma 3 has none)"
    rope = getattr(config, "rope_parameters", None) or {}
    sliding, full = rope.get("sliding_attention", {}), rope.get("full_attention", rope)
    if sliding.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in (
        "default",
        "linear",
    ):
        return (f"rotary scaling {sliding.get('rope_type')!r} on sliding and {full.get('rope_type')!r} on full "
                "layers (llama.cpp scales the full layers linearly, the sliding ones not at all)")  # fmt: skip
    return None


def add_gemma_hparams(writer: gguf.GGUFWriter, config: Any, arch: str) -> None:
    """The keys llama.cpp's Gemma 2 / Gemma 3 read beyond the common ones (``families.add_hparams``)."""
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    elif config.final_logit_softcapping:
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    if config.sliding_window is not None:
        writer.add_sliding_window(int(config.sliding_window))
        types = list(getattr(config, "layer_types", None) or _layer_types(config, arch))
        if types != _layer_types(config, arch):
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    if arch == "gemma3":
        rope = getattr(config, "rope_parameters", None) or {}
        if (theta := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
            writer.add_rope_freq_base_swa(float(theta))
        full = rope.get("full_attention", {})
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(full["factor"]))
