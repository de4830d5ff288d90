"""The check sample: another batch made from the trace sample, shaped unlike it (other length and batch size,
left padding), so that code the tracer specialised to the trace sample's shapes gives it wrong values.

``seqcal.execution.verify`` runs the partition and the model's own forward on it and compares them.

Example:
    >>> other, what = check_sample({"input_ids": torch.ones(1, 40, dtype=torch.long)})
    >>> what, other["input_ids"].shape
    ('batch 2 x 35 tokens', torch.Size([2, 35]))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# Tokens of the check sample per row (before its extra left padding): enough for masks, positions and
# windows to differ from the trace sample's, short enough to cost little next to calibration.
CHECK_TOKENS = 32
# Extra left-padded positions in every row; the added row gets a third of the length more.
EXTRA_PAD = 3
# Inputs laid out [batch, sequence, ...] whose sequence axis can be padded; the value padded positions take.
SEQUENCE_INPUTS = (
    "input_ids", "inputs_embeds", "token_type_ids", "mm_token_type_ids", "position_ids", "labels", "attention_mask"
)  # fmt: skip
PAD_LABEL = -100


def check_sample(
    sample: Mapping[str, Any], pad_id: int | None = None, max_tokens: int = CHECK_TOKENS
) -> tuple[dict[str, Any], str] | None:
    """Another sample shaped unlike ``sample``: other length, left padding, one more row when only text is given.

    Sequence inputs (``SEQUENCE_INPUTS``, also with a ``decoder_`` prefix) are cut to their last ``max_tokens``
    positions (text-only samples) and get ``EXTRA_PAD`` masked positions in front: mask and token types 0,
    labels -100, ids ``pad_id`` (None: each row's last id, an ordinary token where the first may be an image
    placeholder), other values a copy of the first position. Other tensors (pixels, audio) are kept, and then
    so is the batch size.

    Returns:
        (sample, description), or None when ``sample`` has no sequence input to reshape.

    Example:
        >>> other, what = check_sample({"input_ids": ids, "attention_mask": mask})  # doctest: +SKIP
        >>> what  # doctest: +SKIP
        'batch 2 x 15 tokens, left padding'
    """
    tensors = {k: v for k, v in sample.items() if isinstance(v, torch.Tensor)}
    sequences = {k: v for k, v in tensors.items() if _is_sequence(k, v)}
    if not sequences:
        return None
    batch = next(iter(sequences.values())).shape[0]
    if any(v.shape[0] != batch for v in sequences.values()):
        return None
    text_only = len(sequences) == len(tensors)
    out = dict(sample)
    lengths = set()
    for key, value in sequences.items():
        if text_only:
            value = value[:, -max_tokens:]
        value = _left_pad(key, value, EXTRA_PAD, pad_id)
        if text_only:  # one more row: the first one, with a third of its length more padding
            extra = _left_pad(key, value[:1, value.shape[1] // 3 :], value.shape[1] // 3, pad_id)
            value = torch.cat([value, extra])
        out[key] = value
        lengths.add(value.shape[1])
    rows = batch + 1 if text_only else batch
    masked = any(k.endswith("attention_mask") for k in sequences)
    size = "/".join(str(n) for n in sorted(lengths))
    return out, f"batch {rows} x {size} tokens" + (", left padding" if masked else "")


def _is_sequence(key: str, value: torch.Tensor) -> bool:
    return key.removeprefix("decoder_") in SEQUENCE_INPUTS and value.dim() >= 2


def _left_pad(key: str, value: torch.Tensor, count: int, pad_id: int | None) -> torch.Tensor:
    """``value`` with ``count`` positions in front (see ``check_sample`` for their values)."""
    if count <= 0:
        return value
    first = value[:, :1]
    if key.endswith(("attention_mask", "token_type_ids")):
        front = torch.zeros_like(first)
    elif key.endswith("labels"):
        front = torch.full_like(first, PAD_LABEL)
    elif key.endswith("input_ids"):
        front = torch.full_like(first, pad_id) if pad_id is not None else value[:, -1:]
    else:
        front = first
    return torch.cat([front.expand(-1, count, *value.shape[2:]), value], dim=1)


def pad_id_of(model: torch.nn.Module) -> int | None:
    """The text model's pad token id when it names a token of its vocabulary."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    pad, vocab = getattr(text, "pad_token_id", None), getattr(text, "vocab_size", None)
    return pad if isinstance(pad, int) and isinstance(vocab, int) and 0 <= pad < vocab else None
