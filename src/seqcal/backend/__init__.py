"""Vendor-specific kernels and process settings, apart from the math that uses them.

    onednn.py       oneDNN's float32 products and attention on the CPU (torch's private
                    ``torch.ops.mkldnn._linear_pointwise``, checked before use), chosen by ``SEQCAL_CPU_MATMUL``
    cuda_graphs.py  a block of GPTQ's column loop captured once per shape as a CUDA graph and replayed
                    (``CUDA_GRAPHS``), the cache of those graphs
    host.py         the native libraries' host memory: glibc's heap (mallopt, malloc_trim), MKL's buffer
                    pool, oneDNN's cache capacities; ``process_settings`` applies and restores them

``seqcal.algorithms`` stays pure tensor math and reaches the kernels through the names below; nothing here
imports the rest of seqcal.

Example:
    >>> import torch
    >>> x, w = torch.randn(64, 8), torch.randn(4, 8)
    >>> torch.allclose(linear(x, w), x @ w.T, atol=1e-5)
    True
"""

from seqcal.backend.onednn import linear, linears_on_onednn, matmul_nt, onednn_applies, onednn_for

__all__ = ["linear", "linears_on_onednn", "matmul_nt", "onednn_applies", "onednn_for"]
