"""Input builders of the tiny-model zoo: valid ``model(**kw)`` arguments for each kind of architecture.

Every builder has the signature ``make_inputs(model, batch=1, seq_len=12, left_pad=0)`` and is seeded by
its arguments, so the same call gives the same tensors. Token ids stay inside the zoo's vocab and away
from special tokens; row ``i`` of the attention mask has ``left_pad * i`` leading zeros; vision-language
rows carry their image placeholder block right after the padding. ``zoo.ARCHS`` pairs each architecture
with its builder (and re-exports ``left_pad_mask``, ``TOKEN_LOW`` and ``TOKEN_HIGH``).

Example:
    >>> text_inputs(model, batch=2, seq_len=4, left_pad=1)["attention_mask"].tolist()
    [[1, 1, 1, 1], [0, 1, 1, 1]]
"""

from __future__ import annotations

from typing import Any

import torch

# Text ids come from [TOKEN_LOW, TOKEN_HIGH); special and image tokens live at 250..255 so that
# random text never collides with them.
TOKEN_LOW, TOKEN_HIGH = 4, 240
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN, VIDEO_TOKEN = 250, 251, 252, 253

Inputs = dict[str, Any]


def _generator(batch: int, seq_len: int, left_pad: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * batch + 1_009 * seq_len + left_pad)


def left_pad_mask(batch: int, seq_len: int, left_pad: int) -> torch.Tensor:
    """Attention mask whose row ``i`` starts with ``left_pad * i`` zeros.

    Args:
        batch: number of rows.
        seq_len: number of columns.
        left_pad: padding step between consecutive rows.

    Returns:
        Long tensor ``[batch, seq_len]`` of ones and zeros; ``batch=2, left_pad=3`` gives one
        unpadded row and one row with three leading zeros.

    Example:
        >>> left_pad_mask(2, 4, 1).tolist()
        [[1, 1, 1, 1], [0, 1, 1, 1]]
    """
    if left_pad < 0 or left_pad * (batch - 1) >= seq_len:
        raise ValueError(
            f"left_pad_mask: left_pad={left_pad} pads the last of {batch} rows by {left_pad * (batch - 1)} "
            f"tokens, which must be >= 0 and < seq_len={seq_len}; lower left_pad or raise seq_len"
        )
    pads = torch.arange(batch)[:, None] * left_pad  # [batch, 1]
    return (torch.arange(seq_len)[None, :] >= pads).long()  # [batch, seq_len]


def _pad_id(model: torch.nn.Module) -> int:
    config = model.config.get_text_config()
    pad = getattr(config, "pad_token_id", None)
    return 0 if pad is None else int(pad)


def _tokens(g: torch.Generator, mask: torch.Tensor, pad_id: int) -> torch.Tensor:
    ids = torch.randint(TOKEN_LOW, TOKEN_HIGH, mask.shape, generator=g)  # [batch, seq]
    return ids.masked_fill(mask == 0, pad_id)


def text_inputs(model: torch.nn.Module, batch: int = 1, seq_len: int = 12, left_pad: int = 0) -> Inputs:
    """``input_ids`` + left-padded ``attention_mask`` for decoders and encoders."""
    mask = left_pad_mask(batch, seq_len, left_pad)
    return {
        "input_ids": _tokens(_generator(batch, seq_len, left_pad), mask, _pad_id(model)),
        "attention_mask": mask,
    }


def seq2seq_inputs(model: torch.nn.Module, batch: int = 1, seq_len: int = 12, left_pad: int = 0) -> Inputs:
    """Left-padded encoder ids and mask plus unpadded ``decoder_input_ids`` of the same length."""
    kw = text_inputs(model, batch, seq_len, left_pad)
    g = _generator(batch, seq_len, left_pad + 7)
    kw["decoder_input_ids"] = torch.randint(TOKEN_LOW, TOKEN_HIGH, (batch, seq_len), generator=g)
    return kw


def whisper_inputs(model: torch.nn.Module, batch: int = 1, seq_len: int = 12, left_pad: int = 0) -> Inputs:
    """Log-mel ``input_features`` of the exact length the encoder needs, decoder ids and mask."""
    cfg = model.config
    g = _generator(batch, seq_len, left_pad)
    mask = left_pad_mask(batch, seq_len, left_pad)
    features = torch.randn(batch, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g)
    return {
        "input_features": features,  # [batch, mel, 2 * max_source_positions]
        "decoder_input_ids": _tokens(g, mask, _pad_id(model)),
        "decoder_attention_mask": mask,
    }


def _image_prompt(
    model: torch.nn.Module, batch: int, seq_len: int, left_pad: int, block: list[int]
) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    """Text ids with ``block`` (image placeholders and markers) right after each row's padding."""
    g = _generator(batch, seq_len, left_pad)
    mask = left_pad_mask(batch, seq_len, left_pad)  # [batch, seq]
    ids = _tokens(g, mask, _pad_id(model))  # [batch, seq]
    for row in range(batch):
        start = left_pad * row
        if start + len(block) >= seq_len:
            raise ValueError(
                f"make_inputs for {type(model).__name__}: row {row} has {start} pads + {len(block)} image "
                f"tokens, leaving no text token in seq_len={seq_len}; raise seq_len or lower left_pad"
            )
        ids[row, start : start + len(block)] = torch.tensor(block)
    return g, mask, ids


def llava_inputs(model: torch.nn.Module, batch: int = 1, seq_len: int = 12, left_pad: int = 0) -> Inputs:
    """One 8x8 image per row: 4 patches -> 4 placeholder tokens (CLS dropped by the 'default' strategy)."""
    g, mask, ids = _image_prompt(model, batch, seq_len, left_pad, [IMAGE_TOKEN] * 4)
    pixels = torch.randn(batch, 3, 8, 8, generator=g)  # [batch, C, H, W]
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}


def qwen_vl_inputs(model: torch.nn.Module, batch: int = 1, seq_len: int = 12, left_pad: int = 0) -> Inputs:
    """One image per row on a 1x4x4 patch grid, merged 2x2 into 4 placeholder tokens."""
    block = [BOI_TOKEN] + [IMAGE_TOKEN] * 4  # <|vision_start|> then the image pads
    g, mask, ids = _image_prompt(model, batch, seq_len, left_pad, block)
    patch_dim = 3 * 2 * 2 * 2  # channels * temporal_patch * patch * patch
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "mm_token_type_ids": (ids == IMAGE_TOKEN).int(),  # 1 marks image tokens for M-RoPE
        "pixel_values": torch.randn(batch * 16, patch_dim, generator=g),  # [patches, patch_dim]
        "image_grid_thw": torch.tensor([[1, 4, 4]] * batch),
    }


def gemma3_inputs(model: torch.nn.Module, batch: int = 1, seq_len: int = 12, left_pad: int = 0) -> Inputs:
    """One 16x16 image per row: 4x4 patches pooled to 4 placeholder tokens."""
    block = [BOI_TOKEN] + [IMAGE_TOKEN] * 4
    g, mask, ids = _image_prompt(model, batch, seq_len, left_pad, block)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "token_type_ids": (ids == IMAGE_TOKEN).long(),  # image tokens attend bidirectionally
        "pixel_values": torch.randn(batch, 3, 16, 16, generator=g),
    }


def idefics3_inputs(model: torch.nn.Module, batch: int = 1, seq_len: int = 12, left_pad: int = 0) -> Inputs:
    """One 16x16 image per row: 4x4 patches pixel-shuffled (scale 2) into 4 placeholder tokens."""
    g, mask, ids = _image_prompt(model, batch, seq_len, left_pad, [IMAGE_TOKEN] * 4)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": torch.randn(batch, 1, 3, 16, 16, generator=g),  # [batch, images, C, H, W]
    }


def mllama_inputs(model: torch.nn.Module, batch: int = 1, seq_len: int = 12, left_pad: int = 0) -> Inputs:
    """One single-tile 8x8 image per row behind one <|image|> token, seen through cross-attention."""
    g, mask, ids = _image_prompt(model, batch, seq_len, left_pad, [IMAGE_TOKEN])
    # Text from the image token on attends to the image; padding and earlier tokens do not.
    seen = (torch.cumsum((ids == IMAGE_TOKEN).long(), dim=1) > 0) & (mask == 1)  # [batch, seq]
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": torch.randn(batch, 1, 1, 3, 8, 8, generator=g),  # [batch, images, tiles, C, H, W]
        "aspect_ratio_ids": torch.ones(batch, 1, dtype=torch.long),  # id 1 = aspect ratio [1, 1]
        "aspect_ratio_mask": torch.ones(batch, 1, 1, dtype=torch.long),
        "cross_attention_mask": seen.long()[:, :, None, None],  # [batch, seq, images, tiles]
    }
