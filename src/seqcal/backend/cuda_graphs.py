"""A block of GPTQ's column loop captured once per shape as a CUDA graph and replayed (CUDA only).

On a GPU the column loop's cost is kernel launches (the GPU idles between ~900 tiny kernels per block); the
same kernels replayed from a graph give the same values, one launch per block. The loop itself
(``seqcal.algorithms.columns.column_block``) is the math; this module captures whatever loop it is given,
keeps the graphs of the shapes seen (``GRAPH_CACHE_BYTES``) and frees them (``clear_graphs``, at the end of a
run).

Example:
    >>> graph = block_graph(128, 1536, 12, torch.device("cuda"), (-8, 7, "int"), True, column_block)  # doctest: +SKIP
    >>> codes, errors = graph.run(W1, Hinv1, S, None)  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["CUDA_GRAPHS", "GRAPH_CACHE_BYTES", "BlockGraph", "block_graph", "clear_graphs"]

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


# The loop a graph captures: (W1, C1, Err1, Hinv1, qparams, qrange, symmetric) -> None, writing in place
Loop = Callable[[Tensor, Tensor, Tensor, Tensor, list, tuple, bool], None]


class BlockGraph:
    """A column loop (``seqcal.algorithms.columns.column_block``) for full blocks of one shape, captured once as a CUDA graph, replayed per block.

    Inputs are copied into fixed buffers before each replay and the outputs read from fixed buffers after it
    (a graph replays the same addresses). The first call runs the loop eagerly on the device's side stream
    (warm-up, as CUDA graph capture requires; its result is that block's result) and then captures it. Should
    the capture fail, the object says so (``failed``) and keeps running the loop eagerly: same result.
    """

    def __init__(
        self,
        rows: int,
        cols: int,
        qcols: int,
        device: torch.device,
        qrange: tuple,
        symmetric: bool,
        loop: Loop,
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
        self.qrange, self.symmetric, self.device, self.loop = qrange, symmetric, device, loop
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed: str | None = None

    def _loop(self) -> None:
        qparams = list(zip(self.S.unbind(0), self.Z.unbind(0)))
        self.loop(self.W1, self.C1, self.Err1, self.Hinv1, qparams, self.qrange, self.symmetric)

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
                    "eagerly (same result, more kernel launches). Set seqcal.backend.cuda_graphs.CUDA_GRAPHS = "
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
    rows: int, cols: int, qcols: int, device: torch.device, qrange: tuple, symmetric: bool, loop: Loop
) -> BlockGraph | None:
    """The cached :class:`BlockGraph` of this block shape and ``loop``, captured on its first run; None when an earlier
    capture of it failed or its buffers alone exceed ``GRAPH_CACHE_BYTES`` (the loop then runs eagerly)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (rows, cols, qcols, torch.device(device.type, index), tuple(qrange), symmetric, loop)
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
    graph = _GRAPHS[key] = BlockGraph(rows, cols, qcols, key[3], qrange, symmetric, loop)
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
