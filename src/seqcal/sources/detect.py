"""What a checkpoint's weights are stored as, from its ``config.json``'s ``quantization_config``.

A model published only in a quantized form (DeepSeek-V3's FP8 blocks, gpt-oss's MXFP4 experts, NVFP4 or
W4A16 compressed-tensors releases, AutoAWQ and GPTQ int4) is calibrated from its weights dequantized one
tensor at a time (``seqcal.sources.checkpoint``). ``detect_source`` names the format once, before any weight
is read; the policy (``seqcal.sources.policy``) compares its precision with the recipe's.

Example:
    >>> detect_source({"quant_method": "fp8", "weight_block_size": [128, 128]}).name
    'fp8-block'
"""

from __future__ import annotations

from typing import Any

from seqcal.sources.compressed import compressed_format
from seqcal.sources.format import SourceFormat, SourceFormatError

# quant_method -> what it stores (the error for any other names these)
KNOWN_METHODS = {
    "fp8": "FP8 e4m3 weights with float32 weight_scale_inv (DeepSeek-V3/R1, Kimi-K2, Qwen3 FP8)",
    "mxfp4": "MXFP4 experts as *_blocks and *_scales (gpt-oss)",
    "compressed-tensors": "compressed-tensors checkpoints (W4A16, W8A8, NVFP4, FP8, MXFP4/MXFP8)",
    "awq": "AutoAWQ GEMM int4 (qweight, qzeros, scales)",
    "gptq": "GPTQ int4/int8 (qweight, qzeros, scales, g_idx)",
}


def detect_source(quant: Any, where: str = "config.json") -> SourceFormat | None:
    """The stored format named by a ``quantization_config`` block (None for no block: a full-precision model).

    Args:
        quant: the ``quantization_config`` value of config.json (a dict, or None).
        where: the file it was read from, for the error.

    Returns:
        The SourceFormat, or None.

    Raises:
        SourceFormatError: an unknown ``quant_method``, or a block seqcal cannot dequantize.

    Example:
        >>> detect_source({"quant_method": "mxfp4"}).weight_bits
        4
    """
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise SourceFormatError(f"{where}: quantization_config is {type(quant).__name__}, not a mapping; "
                                "restore the model's config.json")  # fmt: skip
    method = quant.get("quant_method")
    if method == "fp8":
        return _fp8(quant, where)
    if method == "mxfp4":
        return SourceFormat("mxfp4", "mxfp4", 4, "float", quant)
    if method == "compressed-tensors":
        return compressed_format(quant, where)
    if method in ("awq", "gptq"):
        return _int_packed(method, quant, where)
    known = ", ".join(f"{k!r} ({v})" for k, v in KNOWN_METHODS.items())
    raise SourceFormatError(f"{where}: quantization_config has quant_method {method!r}, which seqcal cannot "
                            f"dequantize; it reads {known}: pass the model in one of them or unquantized")  # fmt: skip


def _fp8(quant: dict[str, Any], where: str) -> SourceFormat:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise SourceFormatError(f"{where}: quant_method 'fp8' with fmt {fmt!r}; seqcal reads e4m3 FP8 weights "
                                "only (DeepSeek's and transformers' FineGrainedFP8 layout)")  # fmt: skip
    block = quant.get("weight_block_size")
    if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
        raise SourceFormatError(f"{where}: weight_block_size {block!r} is not two positive integers "
                                "(rows, columns), as [128, 128]")  # fmt: skip
    name = "fp8-block" if block is not None else "fp8-tensor"
    if quant.get("scale_fmt") == "ue8m0":
        name += "-ue8m0"
    return SourceFormat("fp8", name, 8, "float", quant)


def _int_packed(method: str, quant: dict[str, Any], where: str) -> SourceFormat:
    bits = quant.get("bits", quant.get("w_bit", 4))
    if method == "awq" and (bits != 4 or quant.get("version", "gemm").lower() != "gemm"):
        raise SourceFormatError(f"{where}: AutoAWQ with {bits} bits, version {quant.get('version')!r}; seqcal "
                                "reads AutoAWQ's 4-bit GEMM layout only")  # fmt: skip
    if method == "gptq" and bits not in (2, 4, 8):
        raise SourceFormatError(f"{where}: GPTQ with {bits} bits; seqcal reads 2, 4 and 8 bit GPTQ weights")
    return SourceFormat(method, f"{method}-int{bits}", int(bits), "int", quant)
