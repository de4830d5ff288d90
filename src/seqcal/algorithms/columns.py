"""GPTQ's column loop (paper Alg. 1, with lazy batch updates, Sec. 3.4) on the transposed weight.

Kept apart from ``gptq.py`` because it is the hot loop: thousands of tiny tensor ops per module. On a CPU
their cost is Python and dispatch; on a GPU it is kernel launches (the GPU idles between them). Each column
is 7 kernels writing in place (11 before). On CUDA, :class:`BlockGraph` captures a full block's loop as a CUDA
graph once per shape and replays it for every block of every solve of that shape (same kernels on the same
values, hence the same result, one launch per block instead of ~900): ``seqcal.backend.cuda_graphs``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from seqcal.algorithms.formats import round_grid_, to_codes
from seqcal.backend import cuda_graphs

# Columns updated eagerly (rank-1) inside a block; the rest of the block gets one matmul per sub-block.
# Same algebra as GPTQ's lazy batch update applied one level down: the rank-1 updates touch 16 columns
# instead of up to block_size, which is what bounded the loop by memory bandwidth on CPU.
SUB_BLOCK = 16


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run torch's CPU kernels inside on one intra-op thread, restoring the caller's setting after.

    For the column loop's thousands of tiny tensor ops: with two intra-op threads each op pays a thread
    hand-off, and when the other core is busy that wait dominates (0.07 s against 6.3 s for a [3072, 576]
    solve on a loaded 2-core machine, benchmarks/RESULTS.md). torch's setting is process-wide, so it is set
    only around the loop; the solve's large products (the inverse factor, the output errors) keep every thread.

    Example:
        >>> with one_intra_op_thread():
        ...     torch.get_num_threads()
        1
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def quantize_columns(
    WT: Tensor, Hinv: Tensor, scale: Tensor, zero: Tensor, col_group: Tensor, block_size: int, qrange: tuple,
    pruned: Tensor | None = None, mismatch: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The GPTQ column loop on ``WT = W^T`` [in, out] float32, which it overwrites (GPTQ's and GPTAQ's).

    Works on ``W^T`` so that a column of W is a contiguous row, and blocks twice (``block_size``, then
    ``SUB_BLOCK``) so that rank-1 updates stay small; everything else is a matmul.

    Args:
        WT: the weight transposed, in processing order, float32 ``[in, out]`` (overwritten).
        Hinv: upper Cholesky factor of the inverse Hessian in processing order ``[in, in]``.
        scale, zero: float32 qparams ``[out or 1, G]``.
        col_group: ``[in]`` the qparam column of each processed column.
        block_size: columns per lazy-update block.
        qrange: ``(qmin, qmax, grid)`` with ``grid`` one of ``WeightFormat.grid``'s values ("int", "fp8",
            "fp6", "fp4").
        pruned: bool ``[in, out]`` in processing order, True where the weight is pruned (a sparsity mask):
            those entries get the code of 0 (their only grid point) and their error is spread like any
            rounding error, so they dequantize to exactly 0. None: no mask.
        mismatch: GPTAQ's ``P`` [in, in] in processing order (``seqcal.algorithms.gptaq``): each column's value
            ``w_q`` when its turn comes is spread over the later columns too, ``+ w_q P_{q,F}``, at both levels
            of the lazy updates. None (GPTQ): no such term, and not one operation more.

    Returns:
        ``(QT, codes, row_loss)`` in processing order: QT ``[in, out]`` float32 (in ``WT``'s memory), codes
        ``[out, in]`` int8 or fp8, row_loss ``[out]`` (the objective summed over columns, per output row).

    Example:
        >>> WT, Hinv = torch.randn(8, 4), torch.eye(8)
        >>> s, z = torch.full((4, 1), 0.5), torch.zeros(4, 1)
        >>> QT, codes, loss = quantize_columns(WT, Hinv, s, z, torch.zeros(8, dtype=torch.long), 4, (-8, 7, "int"))
        >>> codes.shape, codes.dtype
        (torch.Size([4, 8]), torch.int8)
    """
    n_in, n_out = WT.shape
    # No [in, out] matrix of codes: each block's codes (floats, in a block buffer) go to the stored codes and are
    # dequantized into the block's rows of WT, which the loop reads no more once the block is done (the same ops
    # on the same values as over whole matrices at the end: the same bits). 67 MB less at a 8192-wide down_proj.
    C1s = torch.empty(min(block_size, n_in), n_out, dtype=WT.dtype, device=WT.device)
    codes: Tensor | None = None  # [out, in] in the grid's code dtype, made with the first block's
    groups = col_group.tolist()  # plain ints: cheap indexing in the per-column loop
    scaleT, zeroT = scale.T.contiguous(), zero.T.contiguous()  # [G, out or 1]
    symmetric = not bool(zeroT.any())  # then the zero point adds and subtracts nothing: skip those kernels
    gidx = col_group.to(WT.device)
    graph = None
    if (
        cuda_graphs.CUDA_GRAPHS
        and WT.is_cuda
        and n_in >= 2 * block_size
        and pruned is None
        and mismatch is None
    ):
        graph = cuda_graphs.block_graph(
            block_size, n_out, scaleT.shape[1], WT.device, qrange, symmetric, column_block
        )
    losses = torch.zeros(n_out, dtype=torch.float32, device=WT.device)
    for i1 in range(0, n_in, block_size):
        i2 = min(i1 + block_size, n_in)
        Hinv1 = Hinv[i1:i2, i1:i2]  # [B, B]
        terms = None
        if graph is not None and i2 - i1 == block_size:
            zeros = None if symmetric else zeroT[gidx[i1:i2]]  # a symmetric loop never reads them
            C1, Err1 = graph.run(WT[i1:i2], Hinv1, scaleT[gidx[i1:i2]], zeros)
        else:
            W1 = WT[i1:i2].clone()  # [B, out]: the block, updated eagerly
            Err1 = torch.empty_like(W1)  # [B, out]: scaled errors
            rows = [(scaleT[g], zeroT[g]) for g in groups[i1:i2]]
            keep = None if pruned is None else pruned[i1:i2]
            terms = None if mismatch is None else (mismatch[i1:i2, i1:i2], torch.empty_like(W1))  # P, and w_q
            C1 = C1s[: i2 - i1]
            column_block(W1, C1, Err1, Hinv1, rows, qrange, symmetric, keep, terms)
        losses += (Err1 * Err1).sum(0)
        WT[i2:].addmm_(Hinv[i1:i2, i2:].T, Err1, alpha=-1)  # lazy batch update of later blocks: rounding,
        if terms is not None:
            WT[i2:].addmm_(mismatch[i1:i2, i2:].T, terms[1])  # and GPTAQ's input mismatch
        block_codes = to_codes(C1.T, qrange[2])  # [out, B]
        if codes is None:
            codes = torch.empty(n_out, n_in, dtype=block_codes.dtype, device=WT.device)
        codes[:, i1:i2] = block_codes
        g = gidx[i1:i2]  # the block is done: its rows of WT take its dequantized values
        torch.sub(C1, zeroT[g], out=WT[i1:i2]).mul_(scaleT[g])  # exactly the per-column dequantization
    return WT, codes, losses / 2


def column_block(
    W1: Tensor, C1: Tensor, Err1: Tensor, Hinv1: Tensor, qparams: list, qrange: tuple, symmetric: bool,
    pruned: Tensor | None = None, mismatch: tuple[Tensor, Tensor] | None = None,
) -> None:  # fmt: skip
    """Quantize one block's columns in order, spreading each one's error over the block's later columns.

    ``W1`` [B, out] the block (updated in place), ``C1`` / ``Err1`` [B, out] receive the codes (as floats) and
    the scaled errors, ``Hinv1`` [B, B] the block's part of the inverse factor, ``qparams`` one ``(scale,
    zero)`` pair of [out] or [1] rows per column. Each column costs 7 small kernels (9 with a zero point, more
    for a float grid), all writing into preallocated rows: no allocation on the integer grid, so the loop can
    be captured as a graph. ``pruned`` [B, out] (or None): entries whose code is forced to that of 0.
    ``mismatch`` (GPTAQ, or None): ``(P1 [B, B], Wq1 [B, out])``, the block's part of ``P`` and the rows that
    receive each column's value before it is rounded; its term follows the rounding term's separately, so it
    adds exact zeros when ``P1`` is 0.
    """
    qmin, qmax, grid = qrange
    w_rows, c_rows, e_rows = W1.unbind(0), C1.unbind(0), Err1.unbind(0)
    B = W1.shape[0]
    for j1 in range(0, B, SUB_BLOCK):
        j2 = min(j1 + SUB_BLOCK, B)
        for i in range(j1, j2):
            w, c, err = w_rows[i], c_rows[i], e_rows[i]
            s, z = qparams[i]
            if mismatch is not None:
                mismatch[1][i].copy_(w)
            # same op order as quant.fake_quantize: c = round(clamp(w / s + z)); err = w - (c - z) * s
            if symmetric:
                torch.div(w, s, out=c)
            else:
                torch.addcdiv(z, w, s, out=c)  # z + 1 * (w / s): the product by 1 is exact
            round_grid_(c.clamp_(qmin, qmax), grid)
            if pruned is not None:  # a pruned weight's grid is {0}: the zero point's code
                c.copy_(torch.where(pruned[i], z, c))
            if symmetric:
                torch.mul(c, s, out=err)
            else:
                torch.sub(c, z, out=err).mul_(s)
            torch.sub(w, err, out=err)
            err.div_(Hinv1[i, i])
            W1[i:j2].addr_(Hinv1[i, i:j2], err, alpha=-1)  # OBS update inside the sub-block
            if mismatch is not None:
                W1[i + 1 : j2].addr_(mismatch[0][i, i + 1 : j2], mismatch[1][i])  # + w_q P_{q,F}
        W1[j2:].addmm_(Hinv1[j1:j2, j2:].T, Err1[j1:j2], alpha=-1)  # rest of the block, at once
        if mismatch is not None:
            W1[j2:].addmm_(mismatch[0][j1:j2, j2:].T, mismatch[1][j1:j2])
