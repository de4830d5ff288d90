"""More zoo entries: architectures whose forwards need the tracer's rarer mechanisms.

OpenAI-GPT and XLNet end with an early ``return`` after code that cannot be traced; Reformer runs its layers
inside an autograd Function; xLSTM chooses between chunked and whole-sequence layer loops on the input length;
RoCBert's embedding tables outweigh its layers; GOT-OCR2 and Phi-4-multimodal are vision-language models with
their own image inputs; ``mllama_text`` is Mllama without images (its cross-attention layers are skipped).
``zoo.py`` merges ``MORE_SPECS`` into ``ARCHS``.
"""

from __future__ import annotations

import torch

from zoo import _BASE, _GPT, _SPECIAL, VOCAB, ArchSpec, _spec
from zoo_inputs import IMAGE_TOKEN, Inputs, _image_prompt


def got_ocr2_inputs(model: torch.nn.Module, batch: int = 1, seq_len: int = 12, left_pad: int = 0) -> Inputs:
    """One 64x64 image per row: 8x8 patches, two stride-2 convolutions -> 4 placeholder tokens."""
    g, mask, ids = _image_prompt(model, batch, seq_len, left_pad, [IMAGE_TOKEN] * 4)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": torch.randn(batch, 3, 64, 64, generator=g),
    }


def phi4mm_inputs(model: torch.nn.Module, batch: int = 1, seq_len: int = 12, left_pad: int = 0) -> Inputs:
    """One 16x16 image per row as a global crop plus one sub-crop, compressed to 5 placeholder tokens."""
    g, mask, ids = _image_prompt(model, batch, seq_len, left_pad, [IMAGE_TOKEN] * 5)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "image_pixel_values": torch.randn(batch, 2, 3, 16, 16, generator=g),  # [batch, crops, C, H, W]
        "image_sizes": torch.tensor([[16, 16]] * batch),
        "image_attention_mask": torch.ones(batch, 2, 2, 2, dtype=torch.long),  # [batch, crops, h, w]
    }


_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
_AUDIO = {"hidden_size": 32, "intermediate_size": 64, "num_blocks": 2, "num_attention_heads": 4,
          "nemo_conv_channels": 32, "depthwise_seperable_out_channel": 32, "ext_pw_out_channel": 32}  # fmt: skip

# fmt: off
MORE_SPECS: tuple[ArchSpec, ...] = (
    _spec("openai-gpt", "decoder", "OpenAIGPTLMHeadModel", "OpenAIGPTConfig", "Block",
          {**_GPT, "n_positions": 128}),
    _spec("xlnet", "decoder", "XLNetLMHeadModel", "XLNetConfig", "XLNetLayer",
          {"vocab_size": VOCAB, "d_model": 64, "n_layer": 3, "n_head": 4, "d_inner": 128, **_SPECIAL}),
    # Local, LSH, local attention; hash_seed makes the LSH buckets deterministic. Inputs are padded to 16.
    _spec("reformer", "decoder", "ReformerModelWithLMHead", "ReformerConfig", "ReformerLayer",
          {"vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4, "attention_head_size": 16,
           "attn_layers": ["local", "lsh", "local"], "feed_forward_size": 128, "axial_pos_shape": [4, 8],
           "axial_pos_embds_dim": [32, 32], "max_position_embeddings": 32, "local_attn_chunk_length": 4,
           "lsh_attn_chunk_length": 4, "num_buckets": 2, "hash_seed": 0, "is_decoder": True,
           "pad_token_id": 0, "eos_token_id": 2}),
    _spec("xlstm", "hybrid", "xLSTMForCausalLM", "xLSTMConfig", "xLSTMBlock",
          {"vocab_size": VOCAB, "hidden_size": 64, "embedding_dim": 64, "num_hidden_layers": 3, "num_blocks": 3,
           "num_heads": 4, "qk_dim_factor": 1.0, **_SPECIAL}),
    _spec("roc_bert", "encoder", "RoCBertForMaskedLM", "RoCBertConfig", "RoCBertLayer",
          {**_BASE, "shape_vocab_size": 512, "pronunciation_vocab_size": 512}),
    _spec("got_ocr2", "vlm", "GotOcr2ForConditionalGeneration", "GotOcr2Config", "Qwen2DecoderLayer",
          {"image_token_index": IMAGE_TOKEN, "text_config": {"model_type": "qwen2", **_BASE},
           "vision_config": {"hidden_size": 32, "output_channels": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "image_size": 64, "patch_size": 8,
                             "global_attn_indexes": [1], "mlp_dim": 64, "window_size": 4,
                             "initializer_range": 0.02}},
          inputs=got_ocr2_inputs),
    _spec("phi4_multimodal", "vlm", "Phi4MultimodalForCausalLM", "Phi4MultimodalConfig",
          "Phi4MultimodalDecoderLayer",
          {**_BASE, "vision_config": {**_VISION, "image_size": 16, "patch_size": 8, "crop_size": 16,
                                      "image_token_id": IMAGE_TOKEN},
           "audio_config": _AUDIO},
          inputs=phi4mm_inputs),
    # Text only: layer 1 is a cross-attention layer, skipped without images (so 3 targets are called).
    _spec("mllama_text", "decoder", "MllamaForCausalLM", "MllamaTextConfig", "MllamaSelfAttentionDecoderLayer",
          {**_BASE, "num_hidden_layers": 4, "cross_attention_layers": [1]}),
)
# fmt: on
