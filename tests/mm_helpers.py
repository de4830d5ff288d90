"""Tiny vision-language and speech checkpoints with their processors, built offline (no download).

Each builder writes a directory that holds what a Hub checkpoint holds: config, safetensors weights, a
word-level tokenizer whose special tokens have the ids the zoo's configs use (image 250, begin/end of image
251/252), and the processor's files (a PIL image processor or a Whisper feature extractor, built in code).
Rows are made as llm-compressor's examples make them: text and an image through the processor.

Example:
    >>> path, processor = save_tiny("llava", tmp_path)
    >>> rows = image_rows(processor, "llava", n=2)
"""

from __future__ import annotations

import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import mm_more
from zoo_inputs import BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN

WORDS = "the a an image picture photo shows cat dog red blue green what does this is of on in it".split()
# model -> its special tokens (text, id), as its processor names them.
SPECIALS: dict[str, dict[str, int]] = {
    "llava": {"<image>": IMAGE_TOKEN},
    "qwen2_5_vl": {"<|image_pad|>": IMAGE_TOKEN, "<|vision_start|>": BOI_TOKEN, "<|vision_end|>": EOI_TOKEN,
                   "<|video_pad|>": VIDEO_TOKEN},
    "gemma3": {"<image_soft_token>": IMAGE_TOKEN, "<start_of_image>": BOI_TOKEN, "<end_of_image>": EOI_TOKEN},
    "whisper": {"<|startoftranscript|>": 3},
    **mm_more.SPECIALS,
}  # fmt: skip
IMAGE_SIDE = {"llava": 8, "qwen2_5_vl": 8, "gemma3": 16}
PROMPT = "what does this image shows"
# A chat template that renders an image item as Gemma 3's image marker (the processor expands it).
GEMMA3_TEMPLATE = (
    "{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image> "
    "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}"
)
# The same for Llava: an image item becomes its <image> marker; a plain-string content is the text.
LLAVA_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} {% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
)


def tokenizer(arch: str) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: <pad>=0, <bos>=1, <eos>=2, [UNK]=3, words from 4, ``SPECIALS[arch]`` at their ids."""
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "[UNK]": 3}
    vocab.update({w: 4 + i for i, w in enumerate(WORDS)})
    vocab.update(SPECIALS[arch])
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {"gemma3": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                        "image_token": "<image_soft_token>"}}.get(arch, {})  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="<pad>",
                                  bos_token="<bos>", eos_token="<eos>", extra_special_tokens=extra)  # fmt: skip
    tok.add_special_tokens({"additional_special_tokens": list(SPECIALS[arch])})
    return tok


def processor(arch: str) -> Any:
    """The processor of ``arch`` built in code (PIL image processors; no torchvision)."""
    tok = tokenizer(arch)
    if arch == "llava":
        images = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8}
        )
        return transformers.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=4,
                                           vision_feature_select_strategy="default",
                                           num_additional_image_tokens=1, image_token="<image>",
                                           chat_template=LLAVA_TEMPLATE)  # fmt: skip
    if arch == "gemma3":
        images = transformers.Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
        return transformers.Gemma3Processor(
            image_processor=images, tokenizer=tok, image_seq_length=4, chat_template=GEMMA3_TEMPLATE
        )
    if arch == "qwen2_5_vl":  # its processor needs a torchvision video processor: the image processor alone
        return QwenParts(tok, transformers.Qwen2VLImageProcessorPil(
            patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=64))  # fmt: skip
    if arch == "whisper":
        features = transformers.WhisperFeatureExtractor(
            feature_size=8, sampling_rate=1600, hop_length=50, chunk_length=1, n_fft=100
        )  # 1 s of audio at 1600 Hz -> 32 frames = 2 * max_source_positions
        return transformers.WhisperProcessor(feature_extractor=features, tokenizer=tok)
    return mm_more.processor(arch, tok)


class QwenParts:
    """Qwen2.5-VL's image processor and tokenizer, used as its processor uses them (one image per text)."""

    def __init__(self, tok: PreTrainedTokenizerFast, images: Any) -> None:
        self.tokenizer, self.image_processor = tok, images

    def __call__(self, text: str, images: Any) -> dict[str, Any]:
        pixels = self.image_processor(images=images, return_tensors="np")
        grid = pixels["image_grid_thw"]  # [images, 3]
        pads = int(grid.prod()) // self.image_processor.merge_size**2
        text = text.replace("<|image_pad|>", " ".join(["<|image_pad|>"] * pads))
        enc = self.tokenizer([text])
        return {**enc, "pixel_values": pixels["pixel_values"], "image_grid_thw": grid}

    def save_pretrained(self, path: str) -> None:
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)


def save_tiny(arch: str, root: Path, with_processor: bool = True) -> tuple[Path, Any]:
    """Write the zoo's tiny ``arch`` model and its processor into ``root / arch``; return (path, processor)."""
    model = mm_more.build(arch)
    if arch == "gemma3":  # as Gemma 3's own configs: SigLIP without its pooling head (unused by the model)
        model.config.vision_config.vision_use_head = False
        torch.manual_seed(0)
        model = type(model)(model.config).eval()
        with torch.no_grad():  # initialised to zeros, which would hide the images from the text model
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    if arch == "whisper":
        model.config.forced_decoder_ids = None
    path = root / arch
    model.save_pretrained(path)
    proc = processor(arch)
    if with_processor:
        proc.save_pretrained(str(path))
    else:
        proc.tokenizer.save_pretrained(str(path))
    return path, proc


def image(seed: int, side: int, blank: bool = False) -> Image.Image:
    """A random RGB image (``blank``: all black)."""
    if blank:
        return Image.new("RGB", (side, side))
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_rows(proc: Any, arch: str, n: int, blank: bool = False) -> list[dict[str, Any]]:
    """``n`` rows mapped through the processor as llm-compressor's examples map them (lists, batch dim kept)."""
    marker = {"llava": "<image>", "gemma3": "<start_of_image>",
              "qwen2_5_vl": "<|vision_start|> <|image_pad|> <|vision_end|>"}[arch]  # fmt: skip
    rows = []
    for i in range(n):
        words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 3))
        out = proc(text=f"{marker} {PROMPT} {words}", images=image(i, IMAGE_SIDE[arch], blank))
        rows.append({k: np.asarray(v).tolist() for k, v in out.items()})
    return rows


def audio_rows(proc: Any, model_config: Any, n: int, silent: bool = False) -> list[dict[str, Any]]:
    """``n`` Whisper rows: log-mel features of 1 s of noise (``silent``: zeros) and decoder start ids."""
    rows = []
    for i in range(n):
        wave = (
            np.zeros(1600, np.float32) if silent else np.random.default_rng(i).normal(size=1600).astype("f4")
        )
        feats = proc.feature_extractor(wave, sampling_rate=1600, return_tensors="np").input_features
        ids = [[model_config.decoder_start_token_id] + [4 + (i + k) % len(WORDS) for k in range(5)]]
        rows.append({"input_features": feats.tolist(), "decoder_input_ids": ids})
    return rows


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    """``samples`` (floats in [-1, 1], mono) as a 16-bit WAV file at ``rate`` Hz."""
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(rate)
        f.writeframes((samples * 32767).astype("<i2").tobytes())


def collate_one(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """llm-compressor's multimodal collator: one row per batch, each value as a tensor."""
    assert len(rows) == 1
    return {key: torch.tensor(value) for key, value in rows[0].items()}
