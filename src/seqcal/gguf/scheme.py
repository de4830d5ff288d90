"""GGUF schemes: a recipe's ``scheme: Q4_K`` or ``scheme: Q4_K_M``, resolved to one GGUF type per module.

A plain type name (Q4_0, Q5_0, Q8_0, Q4_1, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) gives every targeted Linear that
type. A mix name is one of llama.cpp's file types, whose types vary by tensor (``llama_tensor_get_type`` in
llama-quant.cpp): Q4_K_M keeps Q4_K for most Linears and gives ``v_proj`` and ``down_proj`` Q6_K in the layers
``use_more_bits`` picks. llama.cpp's Q2_K file type is ``Q2_K_MIX`` here, since Q2_K names the type; its Q4_0 and
Q5_0 file types, as ``llama-quantize`` writes them with an importance matrix (the calibrating algorithms always
have one: the inputs' E[x^2]), are ``Q4_0_MIX`` and ``Q5_0_MIX``: ``down_proj`` in the first eighth of the layers
gets Q4_1 / Q5_1, llama.cpp's guard against those layers' outliers. A module whose width the type's block does not
divide gets llama.cpp's fallback type (Q4_K -> Q5_0, ...; said in the log);
a width no 32-block type divides is refused (llama.cpp would keep it in F16), with the ``ignore`` fix.

The scheme is a compressed-tensors ``QuantizationScheme`` whose weights describe the grid (bits, sub-block as
group size, symmetric or not) and which names the type, so that it travels with each module's result like
any other scheme (``seqcal.records``).

Example:
    >>> gguf_preset("Q4_K_M", ["Linear"]).gguf_type
    'Q4_K'
"""

from __future__ import annotations

import logging
import re

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from seqcal.gguf.types import GGUF_TYPES, gguf_type, type_for_width

logger = logging.getLogger("seqcal")

# llama.cpp's mixes (file types) -> the type most tensors get
MIXES: dict[str, str] = {
    "Q2_K_MIX": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
    "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q4_0_MIX": "Q4_0", "Q5_0_MIX": "Q5_0",
}  # fmt: skip
GGUF_SCHEMES: tuple[str, ...] = (*GGUF_TYPES, *MIXES)


class GGUFScheme(QuantizationScheme):
    """A compressed-tensors scheme on a GGUF type's grid.

    Attributes:
        gguf_type: the GGUF type of the module's weight ("Q4_K").
        gguf_mix: the llama.cpp mix it was chosen by ("Q4_K_M"), or None for a plain type.
    """

    gguf_type: str
    gguf_mix: str | None = None


def is_gguf(name: object) -> bool:
    """Whether ``name`` is a GGUF scheme name (a type or a mix)."""
    return isinstance(name, str) and name.upper() in GGUF_SCHEMES


def _scheme(targets: list[str], name: str, mix: str | None) -> GGUFScheme:
    t = gguf_type(name)
    weights = QuantizationArgs(num_bits=t.bits, type="int", symmetric=not t.has_min, strategy="group",
                               group_size=t.sub)  # fmt: skip
    return GGUFScheme(targets=targets, weights=weights, gguf_type=t.name, gguf_mix=mix)


def gguf_preset(name: str, targets: list[str]) -> GGUFScheme:
    """The scheme of a recipe's GGUF name; a mix resolves per module in :func:`per_module`."""
    key = name.upper()
    mix = key if key in MIXES else None
    return _scheme(targets, MIXES.get(key, key), mix)


def check_gguf(scheme: GGUFScheme, where: str) -> None:
    """Refuse settings a GGUF type cannot have: its qparams are llama.cpp's rule, its inputs unquantized."""
    if scheme.weights.observer not in (None, "minmax") or scheme.weights.observer_kwargs:
        raise ValueError(f"{where}: GGUF scheme {scheme.gguf_type} computes its scales by llama.cpp's rule; "
                         f"remove the weight observer {scheme.weights.observer!r}")  # fmt: skip
    if scheme.input_activations is not None or scheme.output_activations is not None:
        raise ValueError(f"{where}: GGUF scheme {scheme.gguf_type} quantizes weights only; remove the "
                         "activation quantization")  # fmt: skip


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mix_type(mix: str, leaf: str, layer: int, layers: int, gqa: float) -> str:
    """The type llama.cpp's mix gives the Linear ``leaf`` of decoder layer ``layer`` of ``layers`` (dense models).

    Example:
        >>> mix_type("Q4_K_M", "v_proj", 0, 30, 3.0), mix_type("Q4_K_M", "q_proj", 0, 30, 3.0)
        ('Q6_K', 'Q4_K')
    """
    base = MIXES[mix]
    if leaf in ("v_proj", "value"):
        rules = {"Q2_K_MIX": "Q4_K" if gqa >= 4 else "Q3_K", "Q3_K_M": "Q5_K" if layer < 2 else "Q4_K",
                 "Q3_K_L": "Q5_K", "Q4_K_S": "Q5_K" if layer < 4 else base}  # fmt: skip
        more = _use_more_bits(layer, layers) and mix in ("Q4_K_M", "Q5_K_M")
        return "Q6_K" if more else rules.get(mix, base)
    if leaf in ("down_proj", "w2", "fc2"):
        rules = {"Q2_K_MIX": "Q3_K", "Q3_K_M": "Q5_K" if layer < layers // 16 else "Q4_K", "Q3_K_L": "Q5_K",
                 "Q4_K_S": "Q5_K" if layer < layers // 8 else base,
                 "Q4_0_MIX": "Q4_1" if layer < layers // 8 else base,
                 "Q5_0_MIX": "Q5_1" if layer < layers // 8 else base}  # fmt: skip
        more = _use_more_bits(layer, layers) and mix in ("Q4_K_M", "Q5_K_M")
        return "Q6_K" if more else rules.get(mix, base)
    if leaf in ("o_proj", "dense", "out_proj"):
        return {"Q2_K_MIX": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(mix, base)
    if leaf in ("qkv_proj", "query_key_value", "Wqkv"):
        return {"Q3_K_M": "Q4_K", "Q3_K_L": "Q4_K", "Q4_K_M": "Q5_K", "Q5_K_M": "Q6_K"}.get(mix, base)
    return base


def _shape(model: torch.nn.Module) -> tuple[int, float]:
    """Decoder layers and query heads per key/value head, from the (text) config."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_attention_heads", 1) or 1
    return int(getattr(config, "num_hidden_layers", 1)), heads / (
        getattr(config, "num_key_value_heads", None) or heads
    )


def per_module(
    model: torch.nn.Module, found: dict[str, QuantizationScheme], where: str
) -> dict[str, QuantizationScheme]:
    """Each GGUF module's own type: its mix's choice, then llama.cpp's fallback for its width (logged).

    Raises:
        ValueError: a width no 32-block GGUF type divides (llama.cpp would keep the tensor in F16).
    """
    if not any(isinstance(s, GGUFScheme) for s in found.values()):
        return found
    layers, gqa = _shape(model)
    made: dict[tuple, GGUFScheme] = {}
    fallbacks: dict[tuple[str, str], list[str]] = {}
    out = dict(found)
    for name, scheme in found.items():
        if not isinstance(scheme, GGUFScheme):
            continue
        width = model.get_submodule(name).weight.shape[-1]
        index = re.search(r"\.(\d+)\.", name)
        wanted = mix_type(scheme.gguf_mix, name.rsplit(".", 1)[-1], int(index.group(1)) if index else 0,
                          layers, gqa) if scheme.gguf_mix else scheme.gguf_type  # fmt: skip
        chosen = type_for_width(wanted, width)
        if chosen is None:
            raise ValueError(f"{where}: {name} has {width} inputs, which no GGUF block (32 or 256) divides; "
                             f"llama.cpp would keep it in F16: add it to ignore")  # fmt: skip
        if chosen != wanted:
            fallbacks.setdefault((wanted, chosen), []).append(f"{name} ({width} inputs)")
        key = (tuple(scheme.targets), chosen, scheme.gguf_mix)
        out[name] = made.setdefault(key, _scheme(list(scheme.targets), chosen, scheme.gguf_mix))
    for (wanted, chosen), names in fallbacks.items():
        logger.warning("seqcal: %s: %s needs widths that are multiples of %d; %d module(s) use llama.cpp's "
                       "fallback %s instead, e.g. %s", where, wanted, GGUF_TYPES[wanted].block, len(names),
                       chosen, names[0])  # fmt: skip
    return out
