"""Pure tensor math for post-training quantization (no hooks, no modules, no config).

``quant``: qparams and (fake-)quantization, in the compressed-tensors convention. ``observe``: weight
observers (min-max, MSE and importance-weighted MSE range searches).
``packing``: int32 packing of low-bit codes. ``hessian``: the layer Hessian; ``output_error``: errors
measured with it.
``gptq``: the GPTQ solver. ``formats`` (with ``fp4``, ``blocks``): block fp8, NVFP4 and MX weight formats.
"""

from seqcal.algorithms import formats
from seqcal.algorithms.gptq import ACTORDER, GPTQNumericalError, GPTQResult, gptq_quantize
from seqcal.algorithms.hessian import UPPER_BLOCK, accumulate_hessian, symmetrize_upper
from seqcal.algorithms.observe import (
    OBSERVERS,
    check_importance,
    importance_from_hessian,
    observe_imatrix_mse,
    observe_minmax,
    observe_mse,
    observe_weight,
    weight_qparams,
)
from seqcal.algorithms.output_error import quadratic_forms, relative_output_error
from seqcal.algorithms.packing import pack_int32, unpack_int32
from seqcal.algorithms.quant import (
    FP8_DTYPE,
    STRATEGIES,
    code_dtype,
    compute_qparams,
    dequantize,
    fake_quantize,
    fake_quantize_per_token,
    quant_range,
    quantize,
)

__all__ = [
    "ACTORDER",
    "FP8_DTYPE",
    "OBSERVERS",
    "STRATEGIES",
    "UPPER_BLOCK",
    "GPTQNumericalError",
    "GPTQResult",
    "accumulate_hessian",
    "check_importance",
    "importance_from_hessian",
    "observe_imatrix_mse",
    "observe_weight",
    "code_dtype",
    "compute_qparams",
    "dequantize",
    "fake_quantize",
    "fake_quantize_per_token",
    "formats",
    "gptq_quantize",
    "observe_minmax",
    "quadratic_forms",
    "relative_output_error",
    "symmetrize_upper",
    "observe_mse",
    "pack_int32",
    "quant_range",
    "quantize",
    "unpack_int32",
    "weight_qparams",
]
