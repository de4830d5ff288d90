"""GGUF's weight types as grids: block layout, code range and how each block's scales are stored.

Every type llama.cpp dequantizes as ``x = s * c + b`` per sub-block, computed in float32, where ``c`` is an
integer code, ``s`` a scale and ``b`` an offset (0 for the symmetric types):

    type   block  sub  codes       s                  b                 stored per block
    Q4_0     32    32  -8..7       d                  0                 d fp16
    Q5_0     32    32  -16..15     d                  0                 d fp16
    Q8_0     32    32  -128..127   d                  0                 d fp16
    Q4_1     32    32  0..15       d                  m                 d, m fp16
    Q5_1     32    32  0..31       d                  m                 d, m fp16
    Q2_K    256    16  0..3        d * sc (sc 0..15)  -dmin * m (0..15) d, dmin fp16; sc, m 4-bit
    Q3_K    256    16  -4..3       d * sc (-32..31)   0                 d fp16; sc 6-bit
    Q4_K    256    32  0..15       d * sc (0..63)     -dmin * m (0..63) d, dmin fp16; sc, m 6-bit
    Q5_K    256    32  0..31       d * sc (0..63)     -dmin * m (0..63) d, dmin fp16; sc, m 6-bit
    Q6_K    256    16  -32..31     d * sc (int8)      0                 d fp16; sc 8-bit

(gguf-py's ``dequantize_blocks`` and ggml's ``dequantize_row_*`` compute exactly these products.) seqcal keeps a
weight's parameters as two float32 tensors ``[out, blocks, 1 + subs]``: ``scale`` holds each block's ``d`` then
its integer sub-block scales, ``zero`` each block's ``dmin`` (or ``m``) then its integer sub-block minimums
(None for the symmetric types); the legacy types have no sub-block part (``subs`` 0). Every value is exact in
float32, so ``s`` and ``b`` are too.

Example:
    >>> GGUF_TYPES["Q4_K"].block, GGUF_TYPES["Q4_K"].sub, GGUF_TYPES["Q4_K"].qmax
    (256, 32, 15)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGUFType:
    """One GGUF weight type.

    Attributes:
        name: llama.cpp's name ("Q4_K").
        block: weights per block (32, or 256 for the k-quants).
        sub: weights per sub-block sharing one ``s`` and ``b``.
        qmin, qmax: the integer codes.
        bits: code width.
        has_min: the type has an offset ``b`` (asymmetric).
        sub_bits: width of the integer sub-block scales (0: legacy type, ``s = d``).
        sub_signed: the sub-block scales are signed (Q3_K, Q6_K).
    """

    name: str
    block: int
    sub: int
    qmin: int
    qmax: int
    bits: int
    has_min: bool = False
    sub_bits: int = 0
    sub_signed: bool = False

    @property
    def subs(self) -> int:
        """Sub-blocks per block that carry their own integer scale (0 for the legacy types)."""
        return self.block // self.sub if self.sub_bits else 0

    @property
    def ggml_type(self) -> int:
        """The ``gguf.GGMLQuantizationType`` value."""
        import gguf

        return int(gguf.GGMLQuantizationType[self.name])


GGUF_TYPES: dict[str, GGUFType] = {
    "Q4_0": GGUFType("Q4_0", 32, 32, -8, 7, 4),
    "Q5_0": GGUFType("Q5_0", 32, 32, -16, 15, 5),
    "Q8_0": GGUFType("Q8_0", 32, 32, -128, 127, 8),
    "Q4_1": GGUFType("Q4_1", 32, 32, 0, 15, 4, has_min=True),
    "Q5_1": GGUFType("Q5_1", 32, 32, 0, 31, 5, has_min=True),
    "Q2_K": GGUFType("Q2_K", 256, 16, 0, 3, 2, has_min=True, sub_bits=4),
    "Q3_K": GGUFType("Q3_K", 256, 16, -4, 3, 3, sub_bits=6, sub_signed=True),
    "Q4_K": GGUFType("Q4_K", 256, 32, 0, 15, 4, has_min=True, sub_bits=6),
    "Q5_K": GGUFType("Q5_K", 256, 32, 0, 31, 5, has_min=True, sub_bits=6),
    "Q6_K": GGUFType("Q6_K", 256, 16, -32, 31, 6, sub_bits=8, sub_signed=True),
}

# llama.cpp's type for a tensor whose width its block does not divide (llama-quant.cpp, tensor_type_fallback)
FALLBACK: dict[str, str] = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def gguf_type(name: str) -> GGUFType:
    """The type named ``name`` (case-insensitive).

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    key = name.upper()
    if key not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {name!r}; seqcal writes {', '.join(GGUF_TYPES)}")
    return GGUF_TYPES[key]


def type_for_width(name: str, width: int) -> str | None:
    """The type llama.cpp stores a ``width``-column tensor in when asked for ``name``: ``name`` itself, its
    fallback when the block does not divide the width, or None when no 32-block type does either (llama.cpp
    then keeps the tensor in F16).

    Example:
        >>> type_for_width("Q4_K", 576), type_for_width("Q4_K", 1536), type_for_width("Q4_0", 40)
        ('Q5_0', 'Q4_K', None)
    """
    if width % GGUF_TYPES[name].block == 0:
        return name
    fallback = FALLBACK.get(name, name)
    return fallback if width % GGUF_TYPES[fallback].block == 0 else None
