"""Quantized checkpoints as calibration sources: FP8 blocks, MXFP4, compressed-tensors, AutoAWQ and GPTQ.

The models most quantized today are published only quantized (DeepSeek-V3/R1 and Kimi-K2 in FP8 blocks,
gpt-oss with MXFP4 experts, NVFP4 and FP8 compressed-tensors releases). seqcal reads them as any checkpoint:
each weight is dequantized to the run's dtype when its subgraph onloads it, never the whole model, with the
values transformers' own dequantizing load gives.

    format.py      SourceFormat, SourceFormatError, and how a family stores a weight (Part, Family)
    detect.py      the format named by config.json's quantization_config; unknown ones refused
    checkpoint.py  QuantizedCheckpoint: which stored tensors make each weight (checked from the headers),
                   one weight read and dequantized at a time; dequantize_weight() for a single weight
    fp8.py         weight + weight_scale_inv (FP8 blocks, ue8m0 scales, per tensor)
    fp8_bits.py    FP8 blocks times their scales from the float8 bits (the cast's values, faster)
    mxfp4.py       gpt-oss's *_blocks + *_scales experts, one expert at a time
    compressed.py  compressed-tensors formats, through its decompressors
    int_packed.py  AutoAWQ (through compressed-tensors' converter) and GPTQ int packing
    policy.py      a source at or below the recipe's precision runs only with requantize=True

Example:
    >>> from seqcal.sources import dequantize_weight
    >>> dequantize_weight("DeepSeek-V3", "model.layers.0.mlp.down_proj.weight")  # doctest: +SKIP
"""

from seqcal.sources.checkpoint import QuantizedCheckpoint, dequantize_weight
from seqcal.sources.detect import detect_source
from seqcal.sources.format import SourceFormat, SourceFormatError

__all__ = ["QuantizedCheckpoint", "SourceFormat", "SourceFormatError", "dequantize_weight", "detect_source"]
