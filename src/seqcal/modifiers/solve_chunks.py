"""How many modules sharing one Hessian go into one stacked GPTQ solve: chunks sized from the memory budget.

Rows of a weight are solved independently given H, so the modules reading one input (q/k/v, gate/up, and in
all-experts calibration the gate/up projections of every expert of a layer) are stacked into one solve. The
solve holds ``SOLVE_COPIES`` float32 copies of the stacked ``[rows, in]`` weight; a layer of 128-384
experts stacked at once would hold gigabytes. The stack is therefore cut into chunks of at most
``chunk_bytes`` (the result is the same: rows are independent):

- with a device budget (``max_device_memory``): what the subgraph leaves of it while it solves (its
  weights and Hessians stay on the device meanwhile);
- without one: the largest stacked solve of the model's modules outside routed experts (its attention
  projections, a dense MLP's gate/up; grouped by parent and input width as the plan groups Hessians, which
  may count o_proj with q/k/v), so that the experts add nothing to the peak the dense parts set already;

both kept within ``[SOLVE_MIN_BYTES, SOLVE_MAX_BYTES]``. A single module larger than the chunk is solved
alone. ``seqcal plan`` shows the chunks of each subgraph; the run logs them and reports them per module.

Example:
    >>> chunk_bytes(dense=32 << 20)  # a model whose q/k/v solve takes 32 MiB
    33554432
    >>> chunk_bytes(dense=32 << 20, budget=8 << 30, resident=7 << 30)  # 1 GiB left of an 8 GiB device
    268435456
    >>> chunk_bytes(dense=32 << 20, budget=8 << 30, resident=(8 << 30) - (64 << 20))  # 64 MiB left
    50331648
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from seqcal.algorithms.gptq_factor import factor_bytes
from seqcal.algorithms.gptq_rows import chunk_rows
from seqcal.algorithms.kept_hessian import kept_in_ram
from seqcal.algorithms.output_error import error_rows
from seqcal.experts import routed_experts, shared_expert_inputs
from seqcal.tracing.partition import Subgraph

# float32 copies of the stacked [rows, in] weight during a solve (algorithms.gptq): W, Q, codes, errors
SOLVE_COPIES = 4
# A floor, so that a tight budget still stacks a few experts (each chunk repeats the Hessian's Cholesky and
# pays the column loop's per-column overhead), and a ceiling: past it stacking gains no speed.
SOLVE_MIN_BYTES = 16 << 20
SOLVE_MAX_BYTES = 256 << 20


def stacked_bytes(rows: int, n_in: int) -> int:
    """Working bytes of a solve of ``rows`` stacked rows reading ``n_in`` features."""
    return SOLVE_COPIES * rows * n_in * 4


def chunk_bytes(dense: int, budget: int | None = None, resident: int = 0) -> int:
    """The most working bytes one stacked solve may take (see the module docstring).

    Args:
        dense: ``dense_solve_bytes`` of the model (used when there is no budget).
        budget: the device budget in bytes (``max_device_memory``), or None.
        resident: bytes on the device during the solve besides it (the subgraph's weights and Hessians, and
            the inverse Hessian factor the solve makes).

    Returns:
        Bytes, within ``[SOLVE_MIN_BYTES, SOLVE_MAX_BYTES]``.
    """
    # a quarter of what is left goes to the solve's other temporaries (codes, the result in the weight's dtype)
    wanted = dense if budget is None else (budget - resident) * 3 // 4
    return max(SOLVE_MIN_BYTES, min(SOLVE_MAX_BYTES, wanted))


def dense_solve_bytes(model: torch.nn.Module, names: Iterable[str]) -> int:
    """The largest stacked solve among the quantized Linears ``names`` outside routed experts.

    Modules are grouped as they share a Hessian: by parent module and input width (q/k/v, gate/up).

    Example:
        >>> dense_solve_bytes(model, modifier.modules)  # doctest: +SKIP
        33554432
    """

    names = list(names)
    experts = set(routed_experts(model, names))
    rows: dict[tuple[str, int], int] = {}
    for name in names:
        if name in experts:
            continue
        weight = model.get_submodule(name).weight
        if weight.dim() != 2:
            continue
        key = (name.rpartition(".")[0], weight.shape[1])
        rows[key] = rows.get(key, 0) + weight.shape[0]
    return max((stacked_bytes(r, n_in) for (_, n_in), r in rows.items()), default=0)


def split_rows(rows: Sequence[int], n_in: int, max_bytes: int) -> list[list[int]]:
    """Indices of modules with ``rows`` output rows each (``n_in`` inputs), in chunks of at most ``max_bytes``.

    Example:
        >>> split_rows([512] * 4, 1024, 16 << 20)
        [[0, 1], [2, 3]]
    """
    chunks: list[list[int]] = [[]]
    used = 0
    for i, r in enumerate(rows):
        need = stacked_bytes(r, n_in)
        if chunks[-1] and used + need > max_bytes:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += need
    return chunks


def solve_groups(
    model: torch.nn.Module, sg: Subgraph, quantized: set[str]
) -> dict[tuple[str, int], list[int]]:
    """(parent, in_features) -> out_features of the quantized Linears solved together (one Hessian).

    The modules are those the modifiers calibrate in ``sg`` (QuantizationModifier.modules_in): its targets
    for a subgraph cut before them, else every quantized module under its modules.
    """
    groups: dict[tuple[str, int], list[int]] = {}
    shared = shared_expert_inputs(model)
    for name, module in model.named_modules():
        if name not in quantized:
            continue
        if name in sg.targets if sg.target_inputs else sg.holds(name):
            key = (shared.get(name, name.rpartition(".")[0]), module.in_features)
            groups.setdefault(key, []).append(module.out_features)
    return groups


def hessian_bytes(groups: dict[tuple[str, int], list[int]]) -> int:
    """fp32 Hessians: one per (parent, in_features) of ``solve_groups``, as q/k/v and gate/up share theirs."""
    return sum(n_in**2 * 4 for _, n_in in groups)


def solve_bytes(
    groups: dict[tuple[str, int], list[int]], dtype_bytes: int, limit: int, device_on_host: bool = True,
    in_place: bool = False, row_chunks: bool = False,
) -> tuple[int, int]:  # fmt: skip
    """Temporaries of the largest GPTQ solve of ``solve_groups`` beyond its Hessian and weights, and the
    most chunks one group is solved in (modules sharing a Hessian are stacked, ``limit`` bytes at most).

    The working copy and the factor take the Hessian's own memory; its values are kept beside it meanwhile, in
    host memory (the device's when that is the host). ``in_place``: the CPU factor in the Hessian's own memory
    (``gptq_factor.factor_bytes``); ``row_chunks``: with it, a module solved alone goes a chunk of rows at a
    time (``gptq_rows.solve_row_chunks``; every quantized module's qparams allow it)."""
    peak, most = 0, 1
    for (_, n_in), outs in groups.items():
        chunks = split_rows(outs, n_in, limit)
        most = max(most, len(chunks))
        n_out = max(sum(outs[i] for i in chunk) for chunk in chunks)
        kept = kept_in_ram(n_in) if device_on_host else 0  # a wide one is kept in a file
        # the Cholesky factor and LAPACK's work buffers (a few blocks when in place)
        inverse = factor_bytes(n_in, device_on_host, in_place) + kept
        # Per weight: W^T in fp32 and the int8 codes (gptq._weight_and_qparams builds W^T a strip of rows at a time;
        # the factor is in the Hessian's memory). A module solved alone takes Q in its own weight's memory, each
        # chunk of rows after its output error (about six [rows, in] float32 temporaries); a stack of modules
        # has its stacked copy and a new Q in W's dtype (gptq._original_order, a strip at a time), the error after.
        # A module solved a chunk of rows at a time has W^T of one chunk beside its codes.
        stacked = any(len(chunk) > 1 for chunk in chunks)
        errors = 0 if stacked else 6 * error_rows(n_in) * n_in * 4
        if row_chunks and in_place and not stacked:  # the codes, and W^T of one chunk of rows
            held = n_out * n_in + min(n_out, chunk_rows(n_in)) * n_in * 4
        else:  # W^T and the codes, and a stack's copy and its Q
            held = n_out * n_in * (4 + 1 + (2 * dtype_bytes if stacked else 0))
        columns = kept + held + errors
        peak = max(peak, inverse, columns)
    return peak, most
