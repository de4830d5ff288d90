"""GPTQ's weight on its way into and out of the column loop (``seqcal.algorithms.columns``): float32 strips of
W, ``W^T`` in processing order and its qparams, then ``Q`` and the codes back in the original order, in W's own
memory when the caller allows it; and the solve a chunk of rows at a time, for a host budget that cannot hold a
weight-sized float32 copy beside the Hessian.

Kept apart from ``gptq.py`` (the solve's arguments, checks and result): these are the functions that decide how
many weight-sized copies exist at once, which is what a tight host budget is made of (GPTAQ uses them too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from seqcal.algorithms.columns import quantize_columns
from seqcal.algorithms.observe import weight_qparams
from seqcal.algorithms.output_error import OutputError, error_rows
from seqcal.backend.host import trim_host_memory


def _weight_and_qparams(
    W: Tensor, dead: Tensor, perm: Tensor | None, actorder: str | None, group_size: int | None, qkw: dict
):
    """W transposed into processing order and its qparams.

    Returns ``WT [in, out]`` float32 (column i of the processing order is row i), ``scale, zero_point``,
    ``col_group [in]`` (the qparam column used by each processed column) and ``g_idx`` (or None).
    One weight-sized float32 copy at a time: the qparams' (dropped before ``WT`` is made), then ``WT``.
    """
    n_in = W.shape[1]
    col_group = torch.arange(n_in, device=W.device)
    col_group = col_group // group_size if qkw["strategy"] == "group" else torch.zeros_like(col_group)
    if actorder is None or actorder == "weight":
        # "weight": groups stay contiguous in the original order, so the checkpoint format does not change
        scale, zero_point = weight_qparams(_float_rows(W, dead, None), **qkw)
        order = None if actorder is None else perm
        col_group = col_group if order is None else col_group[order]
        return _processing_rows(W, dead, order), scale, zero_point, col_group, None
    if qkw.get("importance") is not None:  # the importance follows its columns
        qkw = {**qkw, "importance": qkw["importance"][perm]}
    # groups of consecutive *permuted* columns
    scale, zero_point = weight_qparams(_float_rows(W, dead, perm), **qkw)
    g_idx = col_group[torch.argsort(perm)].to(torch.int32) if qkw["strategy"] == "group" else None
    return _processing_rows(W, dead, perm), scale, zero_point, col_group, g_idx


# Output rows per strip: 1 MiB of float32 at most beside the weight-sized copies being built.
STRIP_FLOATS = 1 << 18


def _strips(n_out: int, n_in: int) -> list[slice]:
    """The rows of each strip of an ``[n_out, n_in]`` weight (``STRIP_FLOATS`` floats each, one row at least)."""
    step = max(1, STRIP_FLOATS // max(n_in, 1))
    return [slice(r, r + step) for r in range(0, n_out, step)]


def _float_strips(W: Tensor, dead: Tensor) -> Iterator[tuple[slice, Tensor]]:
    """``(rows, W[rows] in float32)`` a strip at a time, inputs never seen zeroed (any weight is free there)."""
    for rows in _strips(*W.shape):
        strip = W[rows].detach().to(torch.float32, copy=True)
        strip[:, dead] = 0
        yield rows, strip


def _float_rows(W: Tensor, dead: Tensor, perm: Tensor | None) -> Tensor:
    """``W [out, in]`` in float32 (:func:`_float_strips`), columns in ``perm``'s order; built a strip of rows at a
    time, so no second weight-sized copy exists meanwhile."""
    out = torch.empty(W.shape, dtype=torch.float32, device=W.device)
    for rows, strip in _float_strips(W, dead):
        out[rows] = strip if perm is None else strip.index_select(1, perm)
    return out


def _processing_rows(W: Tensor, dead: Tensor, perm: Tensor | None) -> Tensor:
    """``WT [in, out]``: :func:`_float_rows` transposed, rows in ``perm``'s order, from strips of W (the same
    values as transposing a whole float32 copy: every element is copied, none computed)."""
    WT = torch.empty(W.shape[1], W.shape[0], dtype=torch.float32, device=W.device)
    for rows, strip in _float_strips(W, dead):
        WT[:, rows] = strip.T if perm is None else strip.T.index_select(0, perm)
    return WT


def _stored_qparams(
    scale: Tensor, zero_point: Tensor, scale_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """The integer formats' scale as stored (``scale_dtype``; an underflow to 0 made the smallest normal, so no
    column divides by 0) and the float32 ``[out or 1, G]`` scale and zero point the column loop rounds with: rounded
    first, so that ``Q`` is exactly what the checkpoint dequantizes to."""
    scale = scale.to(scale_dtype)
    scale = torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale)
    scale32 = scale.float().reshape(scale.shape[0] if scale.ndim == 2 else 1, -1)  # [out or 1, G]
    return scale, scale32, zero_point.float().reshape(scale32.shape)


def _original_order(QT: Tensor, inv: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``Q [out, in]`` in ``dtype`` and the original column order (``inv``: ``argsort`` of the processing order)
    from the loop's ``QT``, a strip of rows at a time: beside QT, only Q and a strip exist, not a permuted copy."""
    if inv is None:
        return QT.T.to(dtype)  # the cast is per element: the same values in either order
    Q = torch.empty(QT.shape[1], QT.shape[0], dtype=dtype, device=QT.device)
    for rows in _strips(*Q.shape):
        Q[rows] = QT[:, rows].index_select(0, inv).T  # cast on assignment, per element
    return Q


def _codes_in_order(codes: Tensor, inv: Tensor | None) -> Tensor:
    """The codes' columns in the original order, in their own memory, a strip of rows at a time."""
    if inv is not None:
        for rows in _strips(*codes.shape):
            codes[rows] = codes[rows].index_select(1, inv)
    return codes


def _overwrite_in_order(W: Tensor, QT: Tensor, inv: Tensor | None, H: Tensor) -> float:
    """Q (``QT`` transposed, columns in the original order, in W's dtype) written over ``W`` in the row chunks of
    :func:`~seqcal.algorithms.output_error.relative_output_error`, each chunk's error taken first; returns that error
    (the same value: the same chunks, sums and order)."""

    def q_rows(rows: slice) -> Tensor:
        columns = QT[:, rows]  # [in, rows] in processing order
        return (columns if inv is None else columns.index_select(0, inv)).T

    return _overwrite_rows(W, H, q_rows)


def _overwrite_rows(W: Tensor, H: Tensor, q_rows: Callable[[slice], Tensor]) -> float:
    """Q written over ``W`` in the row chunks of :func:`~seqcal.algorithms.output_error.relative_output_error`: for each
    chunk ``rows``, ``q_rows(rows)`` ([rows, in], original column order) in W's dtype, its output error taken before
    it replaces them; returns the relative output error."""
    error, step = OutputError(H), error_rows(W.shape[1])
    for r in range(0, W.shape[0], step):
        rows = slice(r, r + step)
        q = q_rows(rows).to(W.dtype)
        error.add(W[rows], q)
        W[rows] = q
    return error.value()


# float32 elements of W^T per chunk of a row-chunked solve: 16 MiB, glibc's mmap threshold in a run
# (backend.host.MMAP_THRESHOLD), so that each chunk's copies are mappings of their own, returned when freed
ROW_CHUNK_FLOATS = 4 << 20


def chunk_rows(n_in: int) -> int:
    """Output rows per chunk of a row-chunked solve with ``n_in`` inputs (``ROW_CHUNK_FLOATS``, one at least)."""
    return max(1, ROW_CHUNK_FLOATS // max(n_in, 1))


def row_chunked(strategy: str, observer: str, block_format: bool) -> bool:
    """Whether a solve can go a chunk of rows at a time and keep its qparams: per-row ones (groups, channels) of
    the min-max observer. The MSE observers stop their search on all rows at once, a tensor-wide scale spans every
    row, and the block formats' scales span 128 rows or a global scale: those solve the whole weight."""
    return not block_format and strategy in ("group", "channel") and observer == "minmax"


def solve_row_chunks(
    W: Tensor, dead: Tensor, perm: Tensor | None, order: str | None, group_size: int | None, qkw: dict,
    scale_dtype: torch.dtype, Hinv: Tensor, block_size: int, qrange: tuple, pruned: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor, Tensor]:  # fmt: skip
    """GPTQ's column loop on ``W`` a chunk of rows at a time (``chunk_rows``), for a host budget.

    Given the inverse factor, the rows of W are independent: the loop only mixes a row's own columns. So each
    chunk's ``W^T [in, rows]`` in float32, and the float32 copy its qparams are observed on, exist alone, not
    the whole weight's (64 MiB each at a 8192-wide down_proj beside its 256 MiB Hessian). The qparams are per
    row (``row_chunked``), so the same; each product of the loop sums over the same columns in the same order,
    but a BLAS may block a product of fewer rows differently: the codes equal the whole solve's up to float32
    rounding, as the in-place factor's do (the two go together in a budget's lean solve).

    Returns ``(scale, zero_point, scale32, zero32, col_group, g_idx, codes, row_loss)``: the stored qparams, the
    loop's float32 ones (``overwrite_from_codes`` dequantizes with them), the qparam column of each processed
    column, ``g_idx`` (or None), the codes ``[out, in]`` in processing order and the objective per row.
    """
    codes, parts = None, []
    step = chunk_rows(W.shape[1])
    for r in range(0, W.shape[0], step):
        rows = slice(r, r + step)
        WT, scale, zero_point, col_group, g_idx = _weight_and_qparams(
            W[rows], dead, perm, order, group_size, qkw
        )
        scale, scale32, zero32 = _stored_qparams(scale, zero_point, scale_dtype)
        prunedT = None if pruned is None else processing_mask(pruned[rows], perm, WT.device)
        # the loop's Q^T is WT itself: not kept, so that it is gone before the next chunk's copies
        loop = quantize_columns(WT, Hinv, scale32, zero32, col_group, block_size, qrange, prunedT)
        chunk_codes, loss = loop[1], loop[2]
        del WT, loop
        # the chunk's smaller temporaries (its codes, strips, qparams) came from the heap: its freed pages are
        # handed back before the next chunk's (see trim_host_memory)
        if W.device.type == "cpu":
            trim_host_memory()
        if codes is None:
            codes = torch.empty(W.shape, dtype=chunk_codes.dtype, device=W.device)
        codes[rows] = chunk_codes
        parts.append((scale, zero_point, scale32, zero32, loss))
    scale, zero_point, scale32, zero32, row_loss = (torch.cat(p) for p in zip(*parts))
    return scale, zero_point, scale32, zero32, col_group, g_idx, codes, row_loss


def processing_mask(pruned: Tensor, perm: Tensor | None, device: torch.device) -> Tensor:
    """A sparsity mask ``[out, in]`` as the loop reads it: ``[in, out]`` in processing order, on ``device``."""
    return pruned.T.contiguous().to(device) if perm is None else pruned.T.to(device).index_select(0, perm)


def overwrite_from_codes(
    W: Tensor,
    codes: Tensor,
    scale32: Tensor,
    zero32: Tensor,
    col_group: Tensor,
    inv: Tensor | None,
    H: Tensor,
) -> float:
    """:func:`_overwrite_in_order` for a row-chunked solve, which kept no ``Q^T``: each chunk of rows of Q is
    dequantized from the codes (processing order) as the loop dequantized it, ``(code - zero) * scale`` on the same
    float32 values (the same Q, up to the sign of a zero), its output error taken, then written over W."""
    groups = col_group.to(W.device)

    def q_rows(rows: slice) -> Tensor:
        scale = scale32 if scale32.shape[0] == 1 else scale32[rows]  # [rows or 1, G]
        zero = zero32 if zero32.shape[0] == 1 else zero32[rows]
        q = (codes[rows].float() - zero[:, groups]).mul_(scale[:, groups])  # [rows, in] in processing order
        return q if inv is None else q.index_select(1, inv)

    return _overwrite_rows(W, H, q_rows)
