"""Generic rules that shrink a transformers config dict to a tiny one (used by ``tests/autozoo.py``).

``shrink`` works on attribute names, not model names: sizes (hidden, FFN, heads, head dims, experts, vocab,
images), layer counts with the layer-type patterns and per-layer lists they index, special and modality
token ids, and the relations between sizes that models check (MHA/MQA key-value heads, MLA rope dims,
state-space heads, widths equal to the hidden size, M-RoPE sections), recursively into sub-configs.

Example:
    >>> shrink({"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 32000})
    {'hidden_size': 64, 'num_hidden_layers': 2, 'vocab_size': 256}
"""

from __future__ import annotations

import re
from typing import Any

VOCAB = 256
HIDDEN, FFN, MOE_FFN, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 32, 4, 2, 16
MAX_LAYERS = 8  # a layer-type pattern longer than this is compressed to its distinct types
# Ids 241..255 are free for modality and other non-text tokens: text ids come from [4, 240).
_FREE_IDS = tuple(range(241, 256))
# Sizes some defaults leave unset although their model reads them (head_dim: hidden / heads).
_UNSET = {
    "head_dim": HEAD_DIM,
    "num_experts_per_tok": 2,
    "num_key_value_heads": KV_HEADS,
    "sliding_window": 4,
}
_SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}


def _is_layer_count(key: str) -> bool:
    return key in (
        "depth",
        "n_layer",
        "n_layers",
        "num_layers",
        "num_blocks",
        "encoder_depth",
        "decoder_depth",
    ) or bool(re.fullmatch(r"(num_)?(\w+_)?(hidden_|encoder_|decoder_)?layers", key) and "index" not in key)


def _token_id(key: str, value: int, pool: list[int]) -> int:
    """Special ids go to 0..2; other token ids inside the text range or the vocab's end get a free id."""
    if key in _SPECIAL_IDS:
        return value if value < 4 else _SPECIAL_IDS[key]
    if 4 <= value < 241 or value >= VOCAB:
        return pool.pop(0) if pool else VOCAB - 1
    return value


def _size_rule(key: str, value: int) -> int | None:
    """The tiny value of one int attribute, or None to keep it. First matching rule wins."""
    k = key.lower()
    rules: tuple[tuple[bool, int], ...] = (
        (k.endswith("vocab_size") and "type_vocab" not in k, VOCAB),  # smaller ones too: see _size_rule
        (k in ("num_embeddings", "n_vocab"), VOCAB),
        ("rope_head_dim" in k or "nope_head_dim" in k or k in ("rotary_dim", "rotary_emb_dim"), 8),
        ("head_dim" in k or "d_head" in k or "headdim" in k or k in ("d_kv", "kv_channels", "attention_head_size"), HEAD_DIM),
        ("heads" in k or k in ("n_head", "num_head"), HEADS),
        ("experts_per_tok" in k or k in ("top_k", "moe_topk", "num_selected_experts", "moe_k"), 2),
        ("shared_expert" in k and "size" not in k, 1),
        ("experts" in k and "size" not in k and "dim" not in k, 4),
        (k == "n_group", 2),
        (k == "topk_group", 1),
        ("intermediate" in k and ("moe" in k or "expert" in k), MOE_FFN),
        ("intermediate" in k or "ffn" in k or k in ("d_ff", "n_inner", "inner_size", "dim_feedforward"), FFN),
        ("lora_rank" in k or k.endswith("dt_rank") or k == "time_step_rank", 16),
        ("d_state" in k or k == "state_size", 8),
        (k == "image_size", 16),
        (k == "patch_size", 4),
        (k in ("sliding_window", "local_attention"), 4),
        (
            "hidden_size" in k or "embed_dim" in k or "d_ssm" in k
            or k in ("d_model", "n_embd", "dim", "hidden_dim", "word_embed_proj_dim", "embedding_size",
                     "projection_dim", "d_embed", "vision_output_dim", "mm_hidden_size", "codebook_dim",
                     "embedding_dim"),
            HIDDEN,
        ),
    )  # fmt: skip
    for hit, tiny in rules:
        if hit:  # the vocab is always VOCAB: the zoo's token ids (up to 255) must fit a smaller one too
            return tiny if value > tiny or (tiny == VOCAB and value != VOCAB) else None
    return None


def _is_type_pattern(key: Any, value: Any) -> bool:
    """A list of layer kinds (``layer_types``, ``layers_block_type``, ``block_types`` ...)."""
    return (
        isinstance(key, str) and "type" in key and isinstance(value, list) and len(value) > 1
        and all(isinstance(v, str) for v in value)
    )  # fmt: skip


def _layer_pattern(config: dict[str, Any], key: str, layers: int) -> int:
    """How many layers keep the pattern of ``config``: every layer type, and the layer index patterns."""
    needed = 2
    for types in (v for k, v in config.items() if _is_type_pattern(k, v)):
        distinct = list(dict.fromkeys(types))
        prefix = max(types.index(t) for t in distinct) + 1
        needed = max(needed, prefix if prefix <= MAX_LAYERS else len(distinct))
    for name, value in config.items():
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, int) or name == key:
            continue
        if (
            re.search(r"period|interval|offset|first_k_dense|dense_replace|pattern", name)
            and 0 < value < layers
        ):
            needed = max(needed, min(value + 1, MAX_LAYERS))
    return needed


def _fit_lists(config: dict[str, Any], layers: int, tiny: int) -> None:
    """Cut per-layer lists to ``tiny`` layers; keep the layer-index lists' indices below ``tiny``."""
    for name, value in list(config.items()):
        if not isinstance(name, str) or not isinstance(value, list) or not value:
            continue
        if _is_type_pattern(name, value) and len(value) == layers:
            distinct = list(dict.fromkeys(value))
            prefix = max(value.index(t) for t in distinct) + 1
            kept = value[:tiny] if prefix <= tiny else (distinct * tiny)[:tiny]
            config[name] = kept
        elif len(value) == layers:
            config[name] = value[:tiny]
        elif re.search(r"layers|index|indices|block", name) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            kept = [v for v in value if -tiny <= v < tiny]
            config[name] = kept or [min(value[0], tiny - 1)]


def shrink(config: dict[str, Any], pool: list[int] | None = None) -> dict[str, Any]:
    """Shrink a config dict (``PretrainedConfig.to_dict()``) in place, sub-configs included.

    Args:
        config: the config's dict; nested dicts (``text_config``, ``vision_config`` ...) are shrunk too.
        pool: free token ids handed to non-special token id attributes (shared by sub-configs).

    Returns:
        ``config``, for chaining.

    Example:
        >>> shrink({"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 32000})
        {'hidden_size': 64, 'num_hidden_layers': 2, 'vocab_size': 256}
    """
    pool = list(_FREE_IDS) if pool is None else pool
    original = dict(config)
    layer_keys = [
        k
        for k, v in config.items()
        if isinstance(k, str) and _is_layer_count(k) and isinstance(v, int) and v > 2
    ]
    for key in layer_keys:
        layers = config[key]
        tiny = _layer_pattern(config, key, layers)
        config[key] = min(layers, tiny)
        _fit_lists(config, layers, config[key])
    for key, value in config.items():
        if not isinstance(key, str):
            continue  # id2label and other int-keyed tables
        if isinstance(value, dict):
            shrink(value, pool)  # a sub-config, or a dict such as rope_parameters
        elif key.endswith(("token_id", "token_index", "token_ids")) and not isinstance(value, bool):
            if isinstance(value, int):
                config[key] = _token_id(key, value, pool)
            elif isinstance(value, list) and all(isinstance(v, int) for v in value):
                config[key] = [_token_id(key, v, pool) for v in value]
        elif value is None and key in _UNSET:
            config[key] = _UNSET[key]
        elif isinstance(value, int) and not isinstance(value, bool) and key not in layer_keys:
            tiny = _size_rule(key, value)
            if tiny is not None:
                config[key] = tiny
        elif isinstance(value, list) and value and all(type(v) is int for v in value):  # per-layer sizes
            config[key] = [v if _size_rule(key, v) is None else _size_rule(key, v) for v in value]
    _keep_relations(original, config)
    _fit_per_layer_tables(config)
    _fit_rope(config)
    return config


def _kv_heads_key(key: str) -> bool:
    return "key_value_heads" in key or "kv_heads" in key or key in ("multi_query_group_num", "num_key_heads")


def _keep_relations(original: dict[str, Any], config: dict[str, Any]) -> None:
    """Keep the relations between sizes that models check or assume.

    Key/value heads: as many as the query heads when they were (MHA), one when there was one (MQA),
    else ``KV_HEADS``. A head dim equal to the rope part of an MLA head stays equal to it. A state-space
    block's heads times head dim equals ``expand * hidden_size``.
    """
    heads = next((config[k] for k in ("num_attention_heads", "n_head", "num_heads") if k in config), HEADS)
    old_heads = next(
        (original[k] for k in ("num_attention_heads", "n_head", "num_heads") if k in original), 0
    )
    for key, value in original.items():
        if (
            isinstance(key, str)
            and _kv_heads_key(key)
            and isinstance(value, int)
            and not isinstance(value, bool)
        ):
            config[key] = heads if value == old_heads else 1 if value == 1 else min(value, KV_HEADS)
    hidden = original.get("hidden_size")
    for key, value in original.items():  # widths named otherwise that must equal hidden_size
        if not isinstance(hidden, int) or not isinstance(key, str) or type(value) is not int:
            continue
        if key.endswith(("_dim", "_size")) and value == hidden and key in config:
            config[key] = config["hidden_size"]
    rope_keys = [k for k in original if isinstance(k, str) and "rope_head_dim" in k]
    for key, value in original.items():
        if isinstance(key, str) and key.endswith("head_dim") and any(original[r] == value for r in rope_keys):
            config[key] = config[next(r for r in rope_keys if original[r] == value)]
    expand = next((k for k in config if isinstance(k, str) and k.endswith("expand")), None)
    ssm_heads = next((k for k in ("mamba_n_heads", "n_mamba_heads", "num_heads") if k in config), None)
    ssm_dim = next((k for k in ("mamba_d_head", "mamba_headdim", "head_dim") if k in config), None)
    if expand and ssm_heads and ssm_dim and isinstance(config[expand], int) and "hidden_size" in config:
        config[ssm_heads] = max(1, config[expand] * config["hidden_size"] // config[ssm_dim])
        for key in ("mamba_d_ssm", "mamba_n_groups", "n_groups"):
            if key == "mamba_d_ssm" and config.get(key):
                config[key] = config[ssm_heads] * config[ssm_dim]
            elif isinstance(config.get(key), int) and config[key] > 1:
                config[key] = 1


def _fit_per_layer_tables(config: dict[str, Any]) -> None:
    """Tables keyed by layer index (``per_layer_config``) keep the keys of the layers that remain."""
    layers = next((config[k] for k in config if isinstance(k, str) and _is_layer_count(k)), None)
    for key, value in config.items():
        if isinstance(key, str) and "per_layer" in key and isinstance(value, dict) and layers:
            config[key] = {i: v for i, v in value.items() if str(i).lstrip("-").isdigit() and int(i) < layers}


def _fit_rope(config: dict[str, Any]) -> None:
    """M-RoPE sections must sum to the rotary half of the tiny head dim.

    A text config next to a vision config gets sections even when it has none: its model then reads a
    default sized for the full head dim (``rope_parameters.get("mrope_section", [16, 24, 24])``).
    """
    for sub in config.values():
        rope = sub.get("rope_parameters") if isinstance(sub, dict) else None
        flat = isinstance(rope, dict) and "rope_type" in rope  # not one dict per layer type
        if flat and "vision_config" in config and "mrope_section" not in rope:
            rope["mrope_section"] = [1, 1, 1]  # rescaled below
            _fit_rope(sub)
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
        factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0
        half = int((config.get("head_dim") or HEAD_DIM) * factor) // 2
        sections = rope["mrope_section"]
        scaled = [max(1, round(s * half / sum(sections))) for s in sections]
        scaled[0] += half - sum(scaled)
        rope["mrope_section"] = scaled
