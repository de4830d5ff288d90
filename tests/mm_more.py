"""More tiny vision-language and speech models with processors, built offline: Idefics3, Mistral 3, Qwen3-VL,
Mllama, Qwen2-Audio (``mm_helpers.save_tiny`` and ``mm_helpers.processor`` dispatch here).

Processors that transformers builds only with torchvision (Pixtral's for Mistral 3, Qwen3-VL's video
processor) are ``Parts``: the PIL image processor and the tokenizer, with the image marker expanded into the
image's placeholder tokens as the real processor expands it.

Example:
    >>> proc = processor("idefics3")
    >>> model = build("mistral3")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import transformers

from zoo import ARCHS
from zoo_inputs import BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN

# model -> its special tokens (text, id).
SPECIALS: dict[str, dict[str, int]] = {
    "idefics3": {"<image>": IMAGE_TOKEN, "<fake_token_around_image>": BOI_TOKEN, "<global-img>": EOI_TOKEN},
    "mistral3": {"[IMG]": IMAGE_TOKEN, "[IMG_BREAK]": BOI_TOKEN, "[IMG_END]": EOI_TOKEN},
    "qwen3_vl": {"<|image_pad|>": IMAGE_TOKEN, "<|vision_start|>": BOI_TOKEN, "<|vision_end|>": EOI_TOKEN,
                 "<|video_pad|>": VIDEO_TOKEN},
    "mllama": {"<|image|>": IMAGE_TOKEN},
    "qwen2_audio": {"<|AUDIO|>": IMAGE_TOKEN, "<|audio_bos|>": BOI_TOKEN, "<|audio_eos|>": EOI_TOKEN},
}  # fmt: skip
# The marker a chat template writes for one image (or audio) item.
MARKERS = {"idefics3": "<image>", "mistral3": "[IMG]", "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
           "mllama": "<|image|>", "qwen2_audio": "<|audio_bos|><|AUDIO|><|audio_eos|>"}  # fmt: skip
IMAGE_SIDE = {"idefics3": 16, "mistral3": 16, "qwen3_vl": 8, "mllama": 8}
_TEXT = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip


def template(arch: str) -> str:
    """A chat template that writes ``MARKERS[arch]`` for each image or audio item, then the texts."""
    return (
        "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}"
        "{% for c in m['content'] %}{% if c['type'] in ('image', 'audio') %}" + MARKERS[arch] + " "
        "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}{% endfor %}"
    )


class Parts:
    """A processor made of its parts: a PIL image processor, the tokenizer, and ``expand(pixels, i)``, the
    placeholder text that image ``i``'s ``marker`` becomes (as the model's own processor writes it)."""

    def __init__(
        self, tok: Any, images: Any, marker: str, expand: Callable[[Any, int], str], chat: str
    ) -> None:
        self.tokenizer, self.image_processor, self.marker, self.expand = tok, images, marker, expand
        self.chat_template = chat

    def __call__(self, text: Any, images: Any = None, padding: bool = False, return_tensors: Any = None,
                 **_: Any) -> dict[str, Any]:  # fmt: skip
        texts = [text] if isinstance(text, str) else list(text)
        flat = images if isinstance(images, list) else [images]
        flat = [im for one in flat for im in (one if isinstance(one, list) else [one])]
        pixels = dict(self.image_processor(images=flat, return_tensors="pt"))
        counter = iter(range(len(flat)))
        texts = [
            "".join(p + (self.expand(pixels, next(counter)) if k < t.count(self.marker) else "")
                    for k, p in enumerate(t.split(self.marker)))
            for t in texts
        ]  # fmt: skip
        enc = dict(self.tokenizer(texts, padding=padding, return_tensors="pt"))
        if "image_grid_thw" in pixels:  # M-RoPE marks the image tokens
            enc["mm_token_type_ids"] = (enc["input_ids"] == IMAGE_TOKEN).int()
        out = {**enc, **pixels}
        return out if return_tensors == "pt" else {k: np.asarray(v) for k, v in out.items()}

    def apply_chat_template(self, messages: Any, tokenize: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=tokenize
        )

    def save_pretrained(self, path: str) -> None:
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)


def _qwen_pads(pixels: dict[str, Any], i: int) -> str:
    return "<|image_pad|>" * (int(pixels["image_grid_thw"][i].prod()) // 4)  # merge_size 2


def _pixtral_tokens(pixels: dict[str, Any], i: int) -> str:
    height, width = (int(v) for v in pixels["image_sizes"][i])
    rows = [["[IMG]"] * (width // 8) + ["[IMG_BREAK]"]] * (height // 8)  # patch 4 x spatial merge 2
    flat = [t for row in rows for t in row]
    return "".join(flat[:-1] + ["[IMG_END]"])


def processor(arch: str, tok: Any) -> Any:
    """The processor of ``arch`` around ``tok`` (PIL image processors; ``Parts`` where torchvision is needed)."""
    chat = template(arch)
    if arch == "idefics3":
        images = transformers.Idefics3ImageProcessorPil(
            size={"longest_edge": 16}, max_image_size={"longest_edge": 16}, do_image_splitting=False
        )
        return transformers.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4,
                                              chat_template=chat)  # fmt: skip
    if arch == "mllama":
        images = transformers.MllamaImageProcessorPil(size={"height": 8, "width": 8}, max_image_tiles=1)
        return transformers.MllamaProcessor(image_processor=images, tokenizer=tok, chat_template=chat)
    if arch == "qwen2_audio":
        features = transformers.WhisperFeatureExtractor(
            feature_size=8, sampling_rate=1600, hop_length=50, chunk_length=1, n_fft=100
        )
        return transformers.Qwen2AudioProcessor(feature_extractor=features, tokenizer=tok, chat_template=chat)
    if arch == "qwen3_vl":
        images = transformers.Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2,
                                                       min_pixels=64, max_pixels=256)  # fmt: skip
        return Parts(tok, images, "<|image_pad|>", _qwen_pads, chat)
    if arch == "mistral3":
        images = transformers.PixtralImageProcessorPil(size={"longest_edge": 16}, patch_size=8)
        return Parts(tok, images, "[IMG]", _pixtral_tokens, chat)
    raise KeyError(arch)


def build(arch: str) -> torch.nn.Module:
    """The tiny model of ``arch`` (the zoo's where it has one), fp32, seeded."""
    if arch in ARCHS:
        return ARCHS[arch].build()
    torch.manual_seed(0)
    if arch == "mistral3":
        vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "head_dim": 8, "image_size": 16, "patch_size": 4}  # fmt: skip
        config = transformers.Mistral3Config(
            text_config={"model_type": "mistral", **_TEXT, "head_dim": 16}, vision_config=vision,
            image_token_index=IMAGE_TOKEN, spatial_merge_size=2, vision_feature_layer=-1,
        )  # fmt: skip
        return transformers.Mistral3ForConditionalGeneration(config).eval()
    if arch == "qwen2_audio":
        audio = {"model_type": "qwen2_audio_encoder", "num_mel_bins": 8, "encoder_layers": 2, "d_model": 32,
                 "encoder_attention_heads": 4, "encoder_ffn_dim": 64, "max_source_positions": 16}  # fmt: skip
        config = transformers.Qwen2AudioConfig(
            audio_config=audio, text_config={"model_type": "qwen2", **_TEXT}, audio_token_index=IMAGE_TOKEN
        )
        return transformers.Qwen2AudioForConditionalGeneration(config).eval()
    if arch == "llama4":  # 16-pixel images in 4-pixel patches, pixel-shuffled by 0.5: 4 image tokens
        text = {**_TEXT, "intermediate_size_mlp": 128, "head_dim": 16, "num_local_experts": 2}
        vision = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                  "image_size": 16, "patch_size": 4, "pixel_shuffle_ratio": 0.5, "projector_input_dim": 64,
                  "projector_output_dim": 64, "vision_output_dim": 64}  # fmt: skip
        config = transformers.Llama4Config(
            text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN
        )
        return transformers.Llama4ForConditionalGeneration(config).eval()
    raise KeyError(arch)
