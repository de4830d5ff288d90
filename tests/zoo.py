"""A zoo of tiny transformers models with random weights, built offline from config classes.

The tracer's equivalence tests and the benchmarks parametrize over ``ARCHS``. Every entry builds a
3-layer-ish fp32 model in eval mode (seeded, default attention implementation kept) and makes inputs
that are valid for it: token ids inside the vocab and away from special tokens, a left-padded
attention mask, decoder ids for encoder-decoders, and pixel values plus the matching number of
image placeholder tokens for vision-language models.

Every architecture asked for builds with the installed transformers 5.24, so none is left out;
``tests/test_zoo.py`` checks each entry (shapes, finiteness, target calls, padding, image paths).

Input builders live in ``tests/zoo_inputs.py``; this module holds the architecture table.

Example:
    >>> spec = ARCHS["llama"]
    >>> model = spec.build()
    >>> out = model(**spec.make_inputs(model, batch=2, seq_len=9, left_pad=3))
    >>> out.logits.shape
    torch.Size([2, 9, 256])
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from zoo_inputs import (
    BOI_TOKEN,
    EOI_TOKEN,
    IMAGE_TOKEN,
    TOKEN_HIGH,
    TOKEN_LOW,
    VIDEO_TOKEN,
    Inputs,
    gemma3_inputs,
    idefics3_inputs,
    left_pad_mask,
    llava_inputs,
    mllama_inputs,
    qwen_vl_inputs,
    seq2seq_inputs,
    text_inputs,
    whisper_inputs,
)

__all__ = ["ARCHS", "FAMILIES", "TOKEN_HIGH", "TOKEN_LOW", "VOCAB", "ArchSpec", "MakeInputs", "left_pad_mask"]

FAMILIES = ("decoder", "moe", "hybrid", "encoder", "encoder-decoder", "vlm")
VOCAB = 256

MakeInputs = Callable[..., Inputs]


@dataclass(frozen=True)
class ArchSpec:
    """One tiny architecture of the zoo.

    Args:
        name: short key, the transformers ``model_type`` where there is one (``"llama"``).
        family: one of ``FAMILIES``.
        build: returns the tiny model, fp32, ``eval()``, weights seeded inside.
        make_inputs: ``make_inputs(model, batch=1, seq_len=12, left_pad=0)`` -> kwargs for
            ``model(**kw)``; row ``i`` of the attention mask has ``left_pad * i`` leading zeros.
            ``seq_len`` is the length of the (decoder) token sequence, image placeholders included;
            VLM rows need room for their image block (5 tokens at most) plus one text token.
        target_class: class name of the repeated layer that should be the sequential target.
        num_targets: how many ``target_class`` instances one forward of the model calls.
        other_targets: further repeated layer classes a user would also target (the other layer
            kind of a hybrid, encoder layers of an encoder-decoder); each is called at least once.
    """

    name: str
    family: str
    build: Callable[[], torch.nn.Module]
    make_inputs: MakeInputs
    target_class: str
    num_targets: int
    other_targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"ArchSpec {self.name!r}: family {self.family!r} is not one of {FAMILIES}")
        if self.num_targets < 1:
            raise ValueError(f"ArchSpec {self.name!r}: num_targets must be >= 1, got {self.num_targets}")


# ----------------------------------------------------------------------------------------- building


def _builder(
    model_cls: str, config_cls: str, config_kw: dict[str, Any], reinit: tuple[str, ...] = ()
) -> Callable[[], torch.nn.Module]:
    """Return a zero-argument builder of ``transformers.<model_cls>(<config_cls>(**config_kw))``.

    Parameters whose name ends with one of ``reinit`` are redrawn from N(0, 0.2): some classes
    zero-initialize a projection or a tanh gate, which would leave an input path dead.
    """

    def build() -> torch.nn.Module:
        # Config classes may edit nested dicts (rope_parameters, text_config) in place: copy them.
        config = getattr(transformers, config_cls)(**copy.deepcopy(config_kw))
        # fork_rng keeps the caller's global RNG untouched while making the weights reproducible.
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(0)
            model = getattr(transformers, model_cls)(config)
            for name, param in model.named_parameters():
                if name.endswith(reinit):
                    param.normal_(0.0, 0.2)
        return model.float().eval()

    build.__qualname__ = f"build_{model_cls}"
    return build


# -------------------------------------------------------------------------------------------- table

_SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# Llama-style config names; head_dim 16 everywhere it is a separate field.
_BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    **_SPECIAL,
}
_HD = {"head_dim": 16}
# A window smaller than the test sequences, so sliding-window masking changes the result.
_SW = {"sliding_window": 4}
_GPT = {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 3, "n_head": 4, **_SPECIAL}
_MOE4 = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _spec(
    name: str,
    family: str,
    model_cls: str,
    config_cls: str,
    target: str,
    config: dict[str, Any],
    num: int = 3,
    other: tuple[str, ...] = (),
    inputs: MakeInputs = text_inputs,
    reinit: tuple[str, ...] = (),
) -> ArchSpec:
    return ArchSpec(name, family, _builder(model_cls, config_cls, config, reinit), inputs, target, num, other)


def _dense(name: str, prefix: str, config: dict[str, Any], target: str = "", model_cls: str = "") -> ArchSpec:
    """A dense decoder ``<prefix>ForCausalLM`` built from ``<prefix>Config``."""
    return _spec(
        name,
        "decoder",
        model_cls or f"{prefix}ForCausalLM",
        f"{prefix}Config",
        target or f"{prefix}DecoderLayer",
        config,
    )


_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # sums to head_dim / 2
_QWEN_VL_IDS = {"image_token_id": IMAGE_TOKEN, "video_token_id": VIDEO_TOKEN,
                "vision_start_token_id": BOI_TOKEN, "vision_end_token_id": EOI_TOKEN}  # fmt: skip
_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
_LLAMA_TEXT = {"model_type": "llama", **_BASE}

_GEMMA3_TEXT = {**_BASE, **_HD, **_SW, "query_pre_attn_scalar": 16,
                "layer_types": ["sliding_attention"] * 2 + ["full_attention"]}  # fmt: skip
_PLE = {**_BASE, **_HD, **_SW, "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB,
        "num_kv_shared_layers": 2}  # fmt: skip
_BLT = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
        "max_position_embeddings": 128}  # fmt: skip
_LFM_TYPES = ["conv", "full_attention", "conv"]
_SEQ2SEQ = {"vocab_size": VOCAB, "d_model": 64, "encoder_layers": 3, "decoder_layers": 3,
            "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128, **_SPECIAL}  # fmt: skip

# One line of config per entry reads better as a table than formatter-exploded dicts.
# fmt: off
_SPECS = (
    # Dense decoders.
    _dense("llama", "Llama", _BASE),
    _dense("mistral", "Mistral", {**_BASE, **_HD, **_SW}),
    _dense("qwen2", "Qwen2", {**_BASE, **_SW, "use_sliding_window": True, "max_window_layers": 1}),
    _dense("qwen3", "Qwen3", {**_BASE, **_HD, **_SW, "use_sliding_window": True, "max_window_layers": 1}),
    _dense("gemma", "Gemma", {**_BASE, **_HD}),
    _dense("gemma2", "Gemma2", {**_BASE, **_HD, **_SW, "query_pre_attn_scalar": 16}),
    _dense("gemma3_text", "Gemma3Text", _GEMMA3_TEXT, "Gemma3DecoderLayer", "Gemma3ForCausalLM"),
    _dense("phi", "Phi", _BASE),
    _dense("phi3", "Phi3", {**_BASE, **_SW}),
    _dense("gpt2", "GPT2", {**_GPT, "n_positions": 128}, "GPT2Block", "GPT2LMHeadModel"),
    _dense("gpt_neox", "GPTNeoX", _BASE, "GPTNeoXLayer"),
    _dense("gptj", "GPTJ", {**_GPT, "n_positions": 128, "rotary_dim": 8}, "GPTJBlock"),
    _dense("falcon", "Falcon", {**_BASE, "num_kv_heads": 2, "new_decoder_architecture": True}),
    _dense("opt", "OPT", {**_BASE, "ffn_dim": 128, "word_embed_proj_dim": 64}),
    _dense("bloom", "Bloom", {"vocab_size": VOCAB, "hidden_size": 64, "n_layer": 3, "n_head": 4, **_SPECIAL},
           "BloomBlock"),
    _dense("starcoder2", "Starcoder2", {**_BASE, **_SW}),
    _dense("olmo", "Olmo", _BASE),
    _dense("olmo2", "Olmo2", _BASE),
    _dense("cohere", "Cohere", _BASE),
    _dense("granite", "Granite", _BASE),
    _dense("stablelm", "StableLm", _BASE),
    _dense("mpt", "Mpt", {"vocab_size": VOCAB, "d_model": 64, "n_heads": 4, "n_layers": 3, "max_seq_len": 128,
                          **_SPECIAL}, "MptBlock"),
    _dense("codegen", "CodeGen", {**_GPT, "n_positions": 128, "n_ctx": 128, "rotary_dim": 8}, "CodeGenBlock"),
    # Gemma-3n and Gemma 4: per-layer input embeddings, the last 2 of 4 layers reuse the keys and values of
    # earlier ones (shared through a dict the layers fill); Gemma-3n also mixes 2 AltUp streams.
    _spec("gemma3n_text", "decoder", "Gemma3nForCausalLM", "Gemma3nTextConfig", "Gemma3nTextDecoderLayer",
          {**_PLE, "laurel_rank": 8, "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0], "altup_num_inputs": 2},
          num=4),
    _spec("gemma4_text", "decoder", "Gemma4ForCausalLM", "Gemma4TextConfig", "Gemma4TextDecoderLayer",
          {**_PLE, "global_head_dim": 32}, num=4),
    # BLT: an entropy patcher (2 layers), byte-level local encoder (1) and decoder (2) with cross-attention to
    # the patches, around a global transformer (2). Its cache cannot be built from its config (no
    # num_hidden_layers), so use_cache is off.
    _spec("blt", "decoder", "BltForCausalLM", "BltConfig", "BltTransformerLayer",
          {"vocab_size": VOCAB, "max_position_embeddings": 128, "local_attention_window_len": 8,
           "encoder_hash_byte_group_size": [3, 4], "encoder_hash_byte_group_vocab": 64, "use_cache": False,
           "patcher_config": {**_BLT, "num_hidden_layers": 2},
           "encoder_config": {**_BLT, "num_hidden_layers": 1, "hidden_size_global": 64},
           "decoder_config": {**_BLT, "num_hidden_layers": 2, "hidden_size_global": 64},
           "global_config": {**_BLT, "hidden_size": 64, "num_hidden_layers": 2}},
          num=7, other=("BltCrossAttention",)),
    # Mixture of experts: 4 small experts, top-2.
    _spec("mixtral", "moe", "MixtralForCausalLM", "MixtralConfig", "MixtralDecoderLayer",
          {**_BASE, **_HD, **_SW, "num_local_experts": 4, "num_experts_per_tok": 2}),
    _spec("qwen2_moe", "moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", "Qwen2MoeDecoderLayer",
          {**_BASE, **_MOE4, "num_experts": 4, "shared_expert_intermediate_size": 64}),
    _spec("qwen3_moe", "moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "Qwen3MoeDecoderLayer",
          {**_BASE, **_HD, **_MOE4, "num_experts": 4}),
    # Layer 0 dense (first_k_dense_replace), layers 1-2 MoE with grouped routing and MLA attention.
    _spec("deepseek_v3", "moe", "DeepseekV3ForCausalLM", "DeepseekV3Config", "DeepseekV3DecoderLayer",
          {**_BASE, **_MOE4, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
           "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
           "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}),
    _spec("olmoe", "moe", "OlmoeForCausalLM", "OlmoeConfig", "OlmoeDecoderLayer",
          {**_BASE, "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}),
    # The default YaRN rope expects 32x its 4096-token original context, hence max_position_embeddings.
    _spec("gpt_oss", "moe", "GptOssForCausalLM", "GptOssConfig", "GptOssDecoderLayer",
          {**_BASE, **_HD, **_SW, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
           "max_position_embeddings": 131072}),
    _spec("granitemoe", "moe", "GraniteMoeForCausalLM", "GraniteMoeConfig", "GraniteMoeDecoderLayer",
          {**_BASE, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2}),
    # Hybrids and state-space models (pure-torch fallbacks, no CUDA kernels needed).
    # Jamba: mamba, attention(+MoE), mamba.
    _spec("jamba", "hybrid", "JambaForCausalLM", "JambaConfig", "JambaMambaDecoderLayer",
          {**_BASE, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
           "expert_layer_offset": 1, "num_experts": 4, "mamba_d_state": 8, "mamba_dt_rank": 8},
          num=2, other=("JambaAttentionDecoderLayer",)),
    # Falcon-H1: attention and mamba2 in parallel inside every layer; chunk 8 < seq_len exercises chunking.
    _spec("falcon_h1", "hybrid", "FalconH1ForCausalLM", "FalconH1Config", "FalconH1DecoderLayer",
          {**_BASE, **_HD, "mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_state": 16,
           "mamba_chunk_size": 8}),
    # Qwen3-Next: gated delta-net, gated delta-net, full attention; MoE everywhere.
    _spec("qwen3_next", "hybrid", "Qwen3NextForCausalLM", "Qwen3NextConfig", "Qwen3NextDecoderLayer",
          {**_BASE, **_HD, **_MOE4, "num_experts": 4, "shared_expert_intermediate_size": 32,
           "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "layer_types": ["linear_attention"] * 2 + ["full_attention"]}),
    # LFM2: short convolutions, attention, convolution; the MoE variant has a dense first layer.
    _spec("lfm2", "hybrid", "Lfm2ForCausalLM", "Lfm2Config", "Lfm2DecoderLayer",
          {**_BASE, "layer_types": _LFM_TYPES, "block_multiple_of": 16}),
    _spec("lfm2_moe", "hybrid", "Lfm2MoeForCausalLM", "Lfm2MoeConfig", "Lfm2MoeDecoderLayer",
          {**_BASE, **_MOE4, "layer_types": _LFM_TYPES, "num_dense_layers": 1, "num_experts": 4}),
    _spec("mamba", "hybrid", "MambaForCausalLM", "MambaConfig", "MambaBlock",
          {"vocab_size": VOCAB, "hidden_size": 64, "state_size": 8, "num_hidden_layers": 3,
           "time_step_rank": 8, **_SPECIAL}),
    # Encoders (masked-LM heads, so the output is logits over the vocab).
    _spec("bert", "encoder", "BertForMaskedLM", "BertConfig", "BertLayer", _BASE),
    _spec("roberta", "encoder", "RobertaForMaskedLM", "RobertaConfig", "RobertaLayer",
          {**_BASE, "pad_token_id": 1}),
    # ModernBERT: layer 0 global, layers 1-2 local attention with a 4-token window.
    _spec("modernbert", "encoder", "ModernBertForMaskedLM", "ModernBertConfig", "ModernBertEncoderLayer",
          {**_BASE, "local_attention": 4, "cls_token_id": 1, "sep_token_id": 2}),
    # Encoder-decoders: T5 uses one block class for both stacks, 3 + 3 calls.
    _spec("t5", "encoder-decoder", "T5ForConditionalGeneration", "T5Config", "T5Block",
          {"vocab_size": VOCAB, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 3, "num_heads": 4,
           "relative_attention_num_buckets": 8, "decoder_start_token_id": 0, **_SPECIAL},
          num=6, inputs=seq2seq_inputs),
    _spec("bart", "encoder-decoder", "BartForConditionalGeneration", "BartConfig", "BartDecoderLayer",
          {**_SEQ2SEQ, "max_position_embeddings": 128, "decoder_start_token_id": 2},
          other=("BartEncoderLayer",), inputs=seq2seq_inputs),
    # Whisper: the encoder needs exactly 2 * max_source_positions mel frames.
    _spec("whisper", "encoder-decoder", "WhisperForConditionalGeneration", "WhisperConfig",
          "WhisperDecoderLayer",
          {**_SEQ2SEQ, "num_mel_bins": 8, "max_source_positions": 16, "max_target_positions": 128,
           "decoder_start_token_id": 3, "begin_suppress_tokens": None},
          other=("WhisperEncoderLayer",), inputs=whisper_inputs),
    # Vision-language models: the text decoder layers are the targets.
    _spec("llava", "vlm", "LlavaForConditionalGeneration", "LlavaConfig", "LlamaDecoderLayer",
          {"text_config": _LLAMA_TEXT, "image_token_index": IMAGE_TOKEN, "image_seq_length": 4,
           "vision_config": {"model_type": "clip_vision_model", **_VISION, "image_size": 8, "patch_size": 4}},
          inputs=llava_inputs),
    _spec("qwen2_vl", "vlm", "Qwen2VLForConditionalGeneration", "Qwen2VLConfig", "Qwen2VLDecoderLayer",
          {**_QWEN_VL_IDS, "text_config": {**_BASE, "rope_parameters": _MROPE},
           "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 2,
                             "patch_size": 2}},
          inputs=qwen_vl_inputs),
    # Qwen2.5-VL: vision window 4 px = one merged token, so block 0 attends within 4 windows.
    _spec("qwen2_5_vl", "vlm", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig",
          "Qwen2_5_VLDecoderLayer",
          {**_QWEN_VL_IDS, "text_config": {**_BASE, "rope_parameters": _MROPE},
           "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                             "out_hidden_size": 64, "patch_size": 2, "window_size": 4,
                             "fullatt_block_indexes": [1]}},
          inputs=qwen_vl_inputs),
    # Qwen3-VL: interleaved M-RoPE, vision features of block 0 added to the first text layer's input (deepstack).
    _spec("qwen3_vl", "vlm", "Qwen3VLForConditionalGeneration", "Qwen3VLConfig", "Qwen3VLTextDecoderLayer",
          {**_QWEN_VL_IDS, "text_config": {**_BASE, **_HD, "rope_parameters": {**_MROPE, "mrope_interleaved": True}},
           "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                             "out_hidden_size": 64, "patch_size": 2, "num_position_embeddings": 16,
                             "deepstack_visual_indexes": [0]}},
          inputs=qwen_vl_inputs),
    _spec("gemma3", "vlm", "Gemma3ForConditionalGeneration", "Gemma3Config", "Gemma3DecoderLayer",
          {"image_token_index": IMAGE_TOKEN, "boi_token_index": BOI_TOKEN, "eoi_token_index": EOI_TOKEN,
           "mm_tokens_per_image": 4, "text_config": _GEMMA3_TEXT,
           "vision_config": {"model_type": "siglip_vision_model", **_VISION, "image_size": 16,
                             "patch_size": 4}},
          inputs=gemma3_inputs, reinit=("mm_input_projection_weight",)),
    # Mllama: 4 text layers, layer 1 is a cross-attention layer, so 3 self-attention targets.
    _spec("mllama", "vlm", "MllamaForConditionalGeneration", "MllamaConfig",
          "MllamaSelfAttentionDecoderLayer",
          {"image_token_index": IMAGE_TOKEN,
           "text_config": {**_BASE, "num_hidden_layers": 4, "cross_attention_layers": [1]},
           "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                             "num_global_layers": 1, "attention_heads": 4, "image_size": 8, "patch_size": 4,
                             "max_num_tiles": 1, "supported_aspect_ratios": [[1, 1]],
                             "intermediate_layers_indices": [0], "vision_output_dim": 64}},
          other=("MllamaCrossAttentionDecoderLayer",), inputs=mllama_inputs, reinit=("gate",)),
    _spec("idefics3", "vlm", "Idefics3ForConditionalGeneration", "Idefics3Config", "LlamaDecoderLayer",
          {"image_token_id": IMAGE_TOKEN, "scale_factor": 2, "text_config": _LLAMA_TEXT,
           "vision_config": {**_VISION, "image_size": 16, "patch_size": 4}},
          inputs=idefics3_inputs),
)
# fmt: on

ARCHS: dict[str, ArchSpec] = {spec.name: spec for spec in _SPECS}

from zoo_more import MORE_SPECS  # noqa: E402 - the second table builds on the helpers above

ARCHS.update({spec.name: spec for spec in MORE_SPECS})
