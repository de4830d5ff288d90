"""Block scales refitted to GPTQ's codes: Q4_0, Q5_0 and Q8_0 (``x = d * q``, one fp16 ``d`` per 32 weights).

GPTQ fixes each block's scale first (llama.cpp's rule, weighted by the inputs' E[x^2]) and then chooses the codes,
each column's rounding error spread over the columns after it. Once the codes are chosen, the scale is no longer
the best one for them: with the codes ``q`` fixed, the output error of a row ``w``,
``(w - sum_b d_b q_b)^T H (w - sum_b d_b q_b)`` (``q_b``: the row's codes in block ``b``, zero elsewhere), is a
quadratic in the row's block scales ``d``, least at ``A d = c`` with ``A_bc = q_b^T H q_c`` and ``c_b = q_b^T H w``.
The solution is rounded to fp16 (what the file stores); a row keeps its old scales where the rounded ones do not
lower its error. The file stays what llama.cpp reads (any fp16 ``d`` is a valid block), only its ``d`` change.

On SmolLM2-135M's Q4_0 file it took llama.cpp's perplexity from 20.183 to 20.149 (benchmarks/RESULTS.md, "GGUF
for llama.cpp").
The cost is a product with H per row (``out * in^2``, as GPTQ's own), taken in chunks of rows so that the
``[rows, blocks, in]`` intermediate stays near ``CHUNK_BYTES``. The k-quants are not refitted: their scales are
integers under a super-block's fp16 scale, which a least-squares solution does not respect.

Example:
    >>> scale = refit_scales(W, codes, scale, H)  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_BYTES = 64 << 20
# the solve's ridge, relative to a row's mean diagonal of A: it pulls a block whose codes are all zero (A's row and
# column are zero there) to its old scale, and changes the others' solution by about this fraction
RIDGE = 1e-6


def refit_scales(W: Tensor, codes: Tensor, scale: Tensor, H: Tensor, block: int = 32) -> Tensor:
    """Each row's block scales that minimise its output error for the given codes, rounded to fp16.

    Args:
        W: ``[out, in]`` the weight the codes quantize (any float dtype).
        codes: ``[out, in]`` integer codes, original column order.
        scale: ``[out, in // block, 1]`` float32 scales (fp16 values) the codes were chosen with.
        H: ``[in, in]`` the inputs' Hessian (``2 X^T X / n``), undampened.
        block: weights per scale.

    Returns:
        ``[out, in // block, 1]`` float32 (fp16 values): per row, the refitted scales, or the old ones where
        those give the lower error.
    """
    out, n = W.shape
    nb = n // block
    Hf = H.to(device=W.device, dtype=torch.float32).reshape(nb, block, n)
    result = scale.clone()
    step = max(1, CHUNK_BYTES // (nb * n * 4))
    for r0 in range(0, out, step):
        rows = slice(r0, min(out, r0 + step))
        q = codes[rows].float().reshape(-1, nb, block)  # [R, nb, block]
        w = W[rows].float()  # [R, n]
        G = torch.einsum("rbi,bij->rbj", q, Hf)  # [R, nb, n]: q_b^T H
        A = (G.reshape(-1, nb, nb, block) * q[:, None]).sum(-1)  # [R, nb, nb]
        c = (G * w[:, None, :]).sum(-1)  # [R, nb]
        old = scale[rows].reshape(-1, nb).float()
        mean_diagonal = torch.diagonal(A, dim1=1, dim2=2).mean(-1, keepdim=True)
        ridge = RIDGE * mean_diagonal.clamp_min(torch.finfo(torch.float32).tiny)
        lhs = A + torch.diag_embed(ridge.expand(-1, nb))
        new = torch.linalg.solve(lhs, (c + ridge * old).unsqueeze(-1)).squeeze(-1)
        new = new.to(torch.float16).float()
        new = torch.where(torch.isfinite(new), new, old)
        better = _error(A, c, new) < _error(A, c, old)  # [R]
        result[rows] = torch.where(better[:, None], new, old).reshape(-1, nb, 1)
    return result


def _error(A: Tensor, c: Tensor, d: Tensor) -> Tensor:
    """A row's output error for scales ``d``, less the constant ``w^T H w``: ``d^T A d - 2 c^T d``."""
    return (d * (A @ d.unsqueeze(-1)).squeeze(-1)).sum(-1) - 2 * (c * d).sum(-1)
