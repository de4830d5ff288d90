"""The model families the GGUF writer knows: llama.cpp's architecture, tensor names and hyperparameters.

Tensor names come from gguf-py's own map (``gguf.get_tensor_name_map``), the one llama.cpp's converter uses.
Llama-architecture models (llama, mistral) store ``q_proj`` / ``k_proj`` with the rows of each head reordered
for llama.cpp's rotary embedding (pairs of adjacent rows instead of the two halves, ``permute``, as
convert_hf_to_gguf.py does; transformers' GGUF loader undoes it); Qwen2, Qwen3 and Phi-3 keep them as they are
(their llama.cpp rotary embedding takes the halves; Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` are llama.cpp's
``attn_qkv`` and ``ffn_up``). Gemma 2 and Gemma 3 (text) store their norms plus one and have keys and checks of
their own (``seqcal.gguf.gemma``). Families outside ``FAMILIES`` are refused before calibration.

Example:
    >>> from transformers import LlamaConfig
    >>> family_of(LlamaConfig()).arch
    'llama'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from seqcal.gguf.gemma import GEMMA_ARCHES, add_gemma_hparams, gemma_refusal


@dataclass(frozen=True)
class Family:
    """How one transformers ``model_type`` is written.

    Attributes:
        arch: llama.cpp's architecture name ("llama", "qwen2", "qwen3").
        permute_qk: q/k rows reordered for llama.cpp's rotary embedding (llama architecture).
    """

    arch: str
    permute_qk: bool
    norm_shift: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", permute_qk=True),
    "mistral": Family("llama", permute_qk=True),  # llama.cpp runs Mistral as the llama architecture
    "qwen2": Family("qwen2", permute_qk=False),
    "qwen3": Family("qwen3", permute_qk=False),
    "phi3": Family(
        "phi3", permute_qk=False
    ),  # fused qkv_proj and gate_up_proj: llama.cpp's attn_qkv and ffn_up
    # norms stored plus one, keys and checks of their own: seqcal.gguf.gemma
    "gemma2": Family("gemma2", permute_qk=False, norm_shift=True),
    "gemma3_text": Family("gemma3", permute_qk=False, norm_shift=True),
}


class GGUFFamilyError(ValueError):
    """The model's family is one the GGUF writer does not write."""


def text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def family_of(config: Any) -> Family:
    """The family of a transformers config; refuses what the writer cannot write faithfully (one sentence).

    Raises:
        GGUFFamilyError: an unknown family, or rotary scaling llama.cpp would need extra tensors for.
    """
    config = text_config(config)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        raise GGUFFamilyError(
            f"output_format='gguf' writes the {', '.join(sorted(FAMILIES))} families, not {kind!r}; save this model "
            "as a compressed-tensors checkpoint (the default output_format) instead"
        )
    if FAMILIES[kind].arch in GEMMA_ARCHES:  # keys of their own, and what llama.cpp fixes in code checked
        if why := gemma_refusal(config, FAMILIES[kind].arch):
            raise GGUFFamilyError(f"output_format='gguf': {kind} with {why}; save a compressed-tensors checkpoint "
                                  "instead")  # fmt: skip
        return FAMILIES[kind]
    rope = _rope(config)
    if rope.get("rope_type", "default") not in ("default", None):
        raise GGUFFamilyError(
            f"output_format='gguf': {kind} with rotary scaling {rope.get('rope_type')!r} is not written yet (llama.cpp "
            "needs its scaling keys and tensors); save a compressed-tensors checkpoint instead"
        )
    return FAMILIES[kind]


def _rope(config: Any) -> dict:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(rope.get("full_attention", rope))  # per layer type (Gemma 3): the full layers' own


def tied_output(model: Any) -> bool:
    """Whether the output projection is the token embedding: the same parameter, or the config says so (a model
    whose weights are read from disk per subgraph has its parameters on meta, untied)."""
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or emb is None:
        return False
    return out.weight is emb.weight or bool(getattr(text_config(model.config), "tie_word_embeddings", False))


def head_dim(config: Any) -> int:
    config = text_config(config)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def add_hparams(writer: gguf.GGUFWriter, config: Any, name: str) -> None:
    """The hyperparameter keys llama.cpp reads for the family (``{arch}.block_count``, ...)."""
    config = text_config(config)
    heads, kv = (
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    )
    theta = _rope(config).get("rope_theta", getattr(config, "rope_theta", 10000.0))
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(head_dim(config))
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_vocab_size(config.vocab_size)
    if writer.arch in GEMMA_ARCHES:
        add_gemma_hparams(writer, config, writer.arch)


def tensor_namer(family: Family, config: Any) -> Callable[[str], str | None]:
    """HF parameter name -> GGUF tensor name (None: not stored, e.g. rotary buffers)."""
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.arch)
    names = gguf.get_tensor_name_map(arch, text_config(config).num_hidden_layers)

    def namer(hf_name: str) -> str | None:
        found = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        # gguf-py's Gemma 2 map has no output tensor (llama.cpp reads the tied token embedding): the tied lm_head
        if found is None and hf_name == "lm_head.weight" and family.arch == "gemma2":
            return "output.weight"
        return found

    return namer


def permutation(family: Family, config: Any, gguf_name: str, rows: int) -> np.ndarray | None:
    """The row order llama.cpp's rotary embedding needs for ``gguf_name`` (None: as it is).

    Within each head the rows ``[0 .. d/2)`` and ``[d/2 .. d)`` (the halves transformers rotates together) are
    interleaved: new row ``2 i`` is old row ``i`` and ``2 i + 1`` is ``d/2 + i``.
    """
    if not family.permute_qk or not gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
        return None
    config = text_config(config)
    heads = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
    d = rows // heads
    order = np.arange(rows).reshape(heads, 2, d // 2).swapaxes(1, 2).reshape(rows)
    return order
