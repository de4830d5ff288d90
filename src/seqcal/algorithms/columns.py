"""GPTQ's column loop (paper Alg. 1, with lazy batch updates, Sec. 3.4) on the transposed weight.

Kept apart from ``gptq.py`` because it is the hot loop: thousands of tiny tensor ops per module. On a CPU
their cost is Python and dispatch; on a GPU it is kernel launches (the GPU idles between them). Each column
is 7 kernels writing in place (11 before). On CUDA, :class:`BlockGraph` captures a full block's loop as a CUDA
graph once per shape and replays it for every block of every solve of that shape (same kernels on the same
values, hence the same result, one launch per block instead of ~900): see ``CUDA_GRAPHS``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Iterator

import torch
from torch import Tensor

from seqcal.algorithms.formats import round_grid_, to_codes

# Columns updated eagerly (rank-1) inside a block; the rest of the block gets one matmul per sub-block.
# Same algebra as GPTQ's lazy batch update applied one level down: the rank-1 updates touch 16 columns
# instead of up to block_size, which is what bounded the loop by memory bandwidth on CPU.
SUB_BLOCK = 16

# Replay full blocks as CUDA graphs on CUDA devices. The graph of a block shape (rows, output columns, qparam
# columns, grid, symmetry) is captured once and kept in ``_GRAPHS`` for every later block and solve of that
# shape (a 1B Llama has four shapes; a layer's solves replay ~110 blocks). Captured without torch.cuda.graph's
# context manager, which synchronizes, collects garbage and empties the allocator caches at each capture (that
# made a whole run slower when every solve captured anew), on one side stream per device (one cuBLAS
# workspace), in thread-local capture mode (a background thread's CUDA calls are not this capture's; but a
# capture claims the device's default random generator for its ~ms, and another thread drawing CUDA random
# numbers meanwhile gets an error: set False where that can happen). The graphed loop gives the eager loop's
# codes bit for bit (tests/test_cuda.py).
CUDA_GRAPHS = True
# Device bytes the cached graphs' fixed buffers may hold together; the least recently used graph goes first.
# A 1B Llama's four shapes take ~49 MB with symmetric scales (gate/up's [128, 16384] buffers 34 MB of it).
GRAPH_CACHE_BYTES = 96 << 20


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
    pruned: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The GPTQ column loop on ``WT = W^T`` [in, out] float32, which it overwrites.

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
    CT = torch.empty_like(WT)  # [in, out] codes, as floats until the end
    groups = col_group.tolist()  # plain ints: cheap indexing in the per-column loop
    scaleT, zeroT = scale.T.contiguous(), zero.T.contiguous()  # [G, out or 1]
    symmetric = not bool(zeroT.any())  # then the zero point adds and subtracts nothing: skip those kernels
    gidx = col_group.to(WT.device)
    graph = None
    if CUDA_GRAPHS and WT.is_cuda and n_in >= 2 * block_size and pruned is None:
        graph = block_graph(block_size, n_out, scaleT.shape[1], WT.device, qrange, symmetric)
    losses = torch.zeros(n_out, dtype=torch.float32, device=WT.device)
    for i1 in range(0, n_in, block_size):
        i2 = min(i1 + block_size, n_in)
        Hinv1 = Hinv[i1:i2, i1:i2]  # [B, B]
        if graph is not None and i2 - i1 == block_size:
            zeros = None if symmetric else zeroT[gidx[i1:i2]]  # a symmetric loop never reads them
            C1, Err1 = graph.run(WT[i1:i2], Hinv1, scaleT[gidx[i1:i2]], zeros)
            CT[i1:i2] = C1
        else:
            W1 = WT[i1:i2].clone()  # [B, out]: the block, updated eagerly
            Err1 = torch.empty_like(W1)  # [B, out]: scaled errors
            rows = [(scaleT[g], zeroT[g]) for g in groups[i1:i2]]
            keep = None if pruned is None else pruned[i1:i2]
            column_block(W1, CT[i1:i2], Err1, Hinv1, rows, qrange, symmetric, keep)
        losses += (Err1 * Err1).sum(0)
        WT[i2:].addmm_(Hinv[i1:i2, i2:].T, Err1, alpha=-1)  # lazy batch update of later blocks
    codes = to_codes(CT.T, qrange[2])
    for i1 in range(0, n_in, block_size):  # WT is spent: dequantize into it, a block of rows at a time
        i2, g = min(i1 + block_size, n_in), gidx[i1 : i1 + block_size]
        torch.sub(CT[i1:i2], zeroT[g], out=WT[i1:i2]).mul_(scaleT[g])  # exactly the per-column dequantization
    return WT, codes, losses / 2


def column_block(
    W1: Tensor, C1: Tensor, Err1: Tensor, Hinv1: Tensor, qparams: list, qrange: tuple, symmetric: bool,
    pruned: Tensor | None = None,
) -> None:  # fmt: skip
    """Quantize one block's columns in order, spreading each one's error over the block's later columns.

    ``W1`` [B, out] the block (updated in place), ``C1`` / ``Err1`` [B, out] receive the codes (as floats) and
    the scaled errors, ``Hinv1`` [B, B] the block's part of the inverse factor, ``qparams`` one ``(scale,
    zero)`` pair of [out] or [1] rows per column. Each column costs 7 small kernels (9 with a zero point, more
    for a float grid), all writing into preallocated rows: no allocation on the integer grid, so the loop can
    be captured as a graph. ``pruned`` [B, out] (or None): entries whose code is forced to that of 0.
    """
    qmin, qmax, grid = qrange
    w_rows, c_rows, e_rows = W1.unbind(0), C1.unbind(0), Err1.unbind(0)
    B = W1.shape[0]
    for j1 in range(0, B, SUB_BLOCK):
        j2 = min(j1 + SUB_BLOCK, B)
        for i in range(j1, j2):
            w, c, err = w_rows[i], c_rows[i], e_rows[i]
            s, z = qparams[i]
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
        W1[j2:].addmm_(Hinv1[j1:j2, j2:].T, Err1[j1:j2], alpha=-1)  # rest of the block, at once


class BlockGraph:
    """:func:`column_block` for full blocks of one shape, captured once as a CUDA graph, replayed per block.

    Inputs are copied into fixed buffers before each replay and the outputs read from fixed buffers after it
    (a graph replays the same addresses). The first call runs the loop eagerly on the device's side stream
    (warm-up, as CUDA graph capture requires; its result is that block's result) and then captures it. Should
    the capture fail, the object says so (``failed``) and keeps running the loop eagerly: same result.
    """

    def __init__(
        self, rows: int, cols: int, qcols: int, device: torch.device, qrange: tuple, symmetric: bool
    ):
        def buf(*shape: int) -> Tensor:
            return torch.empty(*shape, dtype=torch.float32, device=device)

        self.W1, self.C1, self.Err1, self.Hinv1 = (
            buf(rows, cols),
            buf(rows, cols),
            buf(rows, cols),
            buf(rows, rows),
        )
        # the qparam row of each column of the block; a symmetric loop never reads its zero points
        self.S, self.Z = buf(rows, qcols), buf(rows, 1 if symmetric else qcols).zero_()
        self.nbytes = _graph_bytes(rows, cols, qcols, symmetric)
        self.qrange, self.symmetric, self.device = qrange, symmetric, device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed: str | None = None

    def _loop(self) -> None:
        qparams = list(zip(self.S.unbind(0), self.Z.unbind(0)))
        column_block(self.W1, self.C1, self.Err1, self.Hinv1, qparams, self.qrange, self.symmetric)

    def run(self, W1: Tensor, Hinv1: Tensor, S: Tensor, Z: Tensor | None) -> tuple[Tensor, Tensor]:
        """One block: ``W1`` [B, out], ``Hinv1`` [B, B], ``S``/``Z`` [B, out or 1] (``Z`` None when symmetric)
        -> (codes, errors) buffers, valid until the next call."""
        self.W1.copy_(W1)
        self.Hinv1.copy_(Hinv1)
        self.S.copy_(S)
        if not self.symmetric:
            self.Z.copy_(Z)
        if self.graph is not None:
            self.graph.replay()
            return self.C1, self.Err1
        if self.failed is not None:
            self._loop()
            return self.C1, self.Err1
        stream = torch.cuda.current_stream(self.device)
        side = _side_stream(self.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            self._loop()  # warm-up: this block's real result
            graph = torch.cuda.CUDAGraph()
            try:  # records the kernels without running them: the buffers keep the warm-up's result
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._loop()
                finally:
                    graph.capture_end()
            except RuntimeError as exc:  # a torch or driver without this capture: the eager loop, same values
                self.failed = f"{type(exc).__name__}: {exc}"
                graph = None
                warnings.warn(
                    f"GPTQ's column loop could not be captured as a CUDA graph ({self.failed}); it runs "
                    "eagerly (same result, more kernel launches). Set seqcal.algorithms.columns.CUDA_GRAPHS = "
                    "False to skip the attempt.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        stream.wait_stream(side)
        self.graph = graph
        return self.C1, self.Err1

    def reset(self) -> None:
        """Free the graph (its buffers go with the object)."""
        if self.graph is not None:
            self.graph.reset()
            self.graph = None


# One capture per block shape, reused by every solve of that shape, least recently used last out.
_GRAPHS: OrderedDict[tuple, BlockGraph] = OrderedDict()
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_HELD_MOST = 0  # the most bytes the cached graphs held together since clear_graphs() last ran


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's stream for warm-ups and captures: one, so that cuBLAS keeps one workspace for it."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _graph_bytes(rows: int, cols: int, qcols: int, symmetric: bool) -> int:
    """Device bytes of a :class:`BlockGraph`'s fixed float32 buffers."""
    return 4 * (3 * rows * cols + rows * rows + rows * qcols + rows * (1 if symmetric else qcols))


def block_graph(
    rows: int, cols: int, qcols: int, device: torch.device, qrange: tuple, symmetric: bool
) -> BlockGraph | None:
    """The cached :class:`BlockGraph` of this block shape, captured on its first run; None when an earlier
    capture of it failed or its buffers alone exceed ``GRAPH_CACHE_BYTES`` (the loop then runs eagerly)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (rows, cols, qcols, torch.device(device.type, index), tuple(qrange), symmetric)
    graph = _GRAPHS.get(key)
    if graph is not None:
        _GRAPHS.move_to_end(key)
        return None if graph.failed is not None else graph
    global _HELD_MOST
    need = _graph_bytes(rows, cols, qcols, symmetric)
    if need > GRAPH_CACHE_BYTES:
        return None
    while _GRAPHS and _cached_bytes() + need > GRAPH_CACHE_BYTES:
        _GRAPHS.popitem(last=False)[1].reset()
    graph = _GRAPHS[key] = BlockGraph(rows, cols, qcols, key[3], qrange, symmetric)
    _HELD_MOST = max(_HELD_MOST, _cached_bytes())
    return graph


def _cached_bytes() -> int:
    """Device bytes the cached graphs' buffers hold together."""
    return sum(g.nbytes for g in _GRAPHS.values())


def clear_graphs() -> int:
    """Free every cached column-loop graph and its buffers (a run's pipeline does at its end). Returns the most
    device bytes the cached graphs' buffers held together since the previous call."""
    global _HELD_MOST
    while _GRAPHS:
        _GRAPHS.popitem()[1].reset()
    held, _HELD_MOST = _HELD_MOST, 0
    return held
