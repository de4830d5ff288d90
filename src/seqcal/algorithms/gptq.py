"""GPTQ (Frantar et al. 2022, arXiv:2210.17323) as pure tensor functions.

Notation follows the paper: ``W [out, in]`` the weight, ``X [tokens, in]`` the layer inputs,
``H = 2 X^T X / tokens [in, in]`` the Hessian of the layer's squared output error, ``Hinv`` the
upper Cholesky factor of ``H^-1`` (so ``Hinv[i, i]`` is the paper's ``[H_F^-1]_qq ** 0.5``).
Columns are quantized one at a time; each column's rounding error is spread over the not yet
quantized columns, in blocks of ``block_size`` columns with lazy batch updates (paper, Sec. 3.4).
Everything is computed in float32 whatever W's dtype.

Quantization parameters follow llm-compressor: they are computed once, before the column loop,
from the (dead-column-masked) weight, and rounded to their storage dtype so that the returned
``Q`` is exactly ``dequantize(q, scale, zero_point)`` with the stored values.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

import seqcal.algorithms.formats as formats
from seqcal.algorithms.columns import one_intra_op_thread, quantize_columns
from seqcal.algorithms.formats import WeightFormat
from seqcal.algorithms.gptq_factor import GPTQNumericalError as GPTQNumericalError  # re-exported
from seqcal.algorithms.gptq_factor import _factor_scratch as _factor_scratch  # re-exported (SparseGPT)
from seqcal.algorithms.gptq_factor import _inverse_hessian_factor as _inverse_hessian_factor  # re-exported
from seqcal.algorithms.gptq_factor import processing_factor
from seqcal.algorithms.gptq_rows import (
    _codes_in_order,
    _float_rows,
    _original_order,
    _overwrite_in_order,
    _overwrite_rows,
    _processing_rows,
    _stored_qparams,
    _strips,
    _weight_and_qparams,
    overwrite_from_codes,
    processing_mask,
    row_chunked,
    solve_row_chunks,
)
from seqcal.algorithms.quant import STRATEGIES, QuantType, Strategy, quant_range

# "static" and "dynamic" are compressed-tensors' aliases of "weight" and "group"
ACTORDER: dict[str, str] = {"weight": "weight", "static": "weight", "group": "group", "dynamic": "group"}


@dataclass(frozen=True)
class GPTQResult:
    """What :func:`gptq_quantize` returns.

    Attributes:
        Q: dequantized weight ``[out, in]``, W's dtype (load it into the module).
        q: codes ``[out, in]`` in the original column order (int8, or float8_e4m3fn for fp8),
            what the checkpoint stores; ``dequantize(q, scale, zero_point, ...) == Q`` in float32.
        scale: ``[1]`` / ``[out, 1]`` / ``[out, G]`` in ``scale_dtype``.
        zero_point: same shape, int8 (float8 zeros for fp8); zeros when symmetric.
        g_idx: ``[in]`` int32 group of each original column, only for ``actorder="group"`` with
            the group strategy (groups then follow the activation order); otherwise None.
        loss: GPTQ objective ``sum((w - q)^2 / Hinv_ii^2) / 2`` (reference implementation's value);
            with H from :func:`accumulate_hessian` and no dampening it equals the mean over tokens of
            ``||(W - Q) x||^2``.
        dampening_frac: the dampening fraction that made the Cholesky succeed.
        retries: how many times dampening had to be increased (0 = first try worked).
        row_loss: ``[out]`` the objective per output row (``loss`` is its sum), so that rows of several
            modules solved together (they share one Hessian) can be told apart again.
        rel_error: with ``overwrite=True``, :func:`~seqcal.algorithms.output_error.relative_output_error` of Q
            against W as it was (None otherwise).
    """

    Q: Tensor
    q: Tensor
    scale: Tensor
    zero_point: Tensor
    g_idx: Tensor | None
    loss: float
    dampening_frac: float
    retries: int
    row_loss: Tensor | None = None
    rel_error: float | None = None


def _check_inputs(W: Tensor, H: Tensor, strategy: str, group_size: int | None, block_size: int) -> None:
    if W.ndim != 2:
        raise ValueError(
            f"gptq_quantize: W must be 2-D [out, in], got shape {list(W.shape)}; flatten it first"
        )
    if H.shape != (W.shape[1], W.shape[1]):
        raise ValueError(
            f"gptq_quantize: H must be [{W.shape[1]}, {W.shape[1]}] for W {list(W.shape)}, got {list(H.shape)}"
        )
    if strategy not in STRATEGIES:
        raise ValueError(f"gptq_quantize: unknown strategy {strategy!r}; valid: {STRATEGIES}")
    if strategy == "group" and (group_size is None or group_size <= 0 or W.shape[1] % group_size):
        raise ValueError(
            f"gptq_quantize: group strategy needs a group_size > 0 dividing in_features {W.shape[1]}, "
            f"got {group_size}"
        )
    if block_size <= 0:
        raise ValueError(f"gptq_quantize: block_size must be > 0, got {block_size}")
    # a strip at a time: a float32 copy of a 8192-wide weight is 64 MiB
    if not all(bool(torch.isfinite(W[rows]).all()) for rows in _strips(*W.shape)):
        raise ValueError("gptq_quantize: W contains NaN or inf; the checkpoint is broken upstream of GPTQ")


def _format_qparams(
    W: Tensor,
    dead: Tensor,
    perm: Tensor | None,
    actorder: str | None,
    fmt: WeightFormat,
    global_scale: Tensor | None,
    importance: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, None]:
    """:func:`_weight_and_qparams` for a ``seqcal.algorithms.formats`` format (contiguous groups / blocks only)."""
    if actorder == "group":
        raise ValueError("gptq_quantize: actorder='group' is not supported for block, NVFP4 or MX formats")
    scale, zero_point = formats.qparams(_float_rows(W, dead, None), fmt, global_scale, importance)
    return _processing_rows(W, dead, perm), scale, zero_point, torch.empty(0), None


def _format_columns(
    scale: Tensor, zero_point: Tensor | None, fmt: WeightFormat, shape: torch.Size, global_scale: Tensor | None,
    perm: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Effective float32 qparams per row and the qparam column of each processed column."""
    scale32, zero32, col_group = formats.column_qparams(scale, zero_point, fmt, tuple(shape), global_scale)
    return scale32, zero32, col_group if perm is None else col_group[perm]


def gptq_quantize(
    W: Tensor,
    H: Tensor,
    *,
    num_bits: int = 4,
    symmetric: bool = True,
    strategy: Strategy = "group",
    group_size: int | None = 128,
    type: QuantType = "int",
    block_size: int = 128,
    dampening_frac: float = 0.01,
    actorder: Literal["static", "weight", "group", "dynamic"] | None = None,
    observer: str = "minmax",
    observer_kwargs: dict | None = None,
    importance: Tensor | None = None,
    max_retries: int = 3,
    damp_growth: float = 10.0,
    scale_dtype: torch.dtype | None = None,
    fmt: WeightFormat | None = None,
    global_scale: Tensor | None = None,
    pruned: Tensor | None = None,
    in_place_factor: bool = False,
    overwrite: bool = False,
    row_chunks: bool = False,
) -> GPTQResult:
    """Quantize ``W`` with GPTQ given the Hessian ``H`` of its inputs.

    Dead inputs (``H_ii == 0``) get ``H_ii = 1`` and ``W[:, i] = 0`` before the qparams are observed.
    ``H`` is dampened by ``dampening_frac * mean(diag(H))``; if a Cholesky fails the fraction is
    multiplied by ``damp_growth`` up to ``max_retries`` times, then :class:`GPTQNumericalError` is
    raised (fall back to RTN). ``actorder`` processes columns by descending ``diag(H)``:
    ``"weight"``/``"static"`` keeps contiguous groups of original columns (format unchanged, no
    g_idx); ``"group"``/``"dynamic"`` makes groups of consecutive permuted columns and returns g_idx
    (compressed-tensors 0.20 rejects ``actorder="group"`` in configs; prefer ``"weight"``).

    Args:
        W: weight ``[out, in]``, any float dtype (not modified, unless ``overwrite``).
        H: Hessian ``[in, in]`` from :func:`accumulate_hessian`; its memory is the inverse
            factor's scratch meanwhile, its values the same after.
        num_bits, symmetric, type: target format (``type="float"``: fp8 e4m3, symmetric).
        strategy, group_size: qparam granularity (``"tensor"``, ``"channel"``, ``"group"``).
        block_size: columns per lazy-update block.
        dampening_frac: relative dampening added to the diagonal.
        actorder: None, ``"static"``/``"weight"`` or ``"group"``/``"dynamic"``.
        observer: a weight observer of ``seqcal.algorithms.observe.OBSERVERS`` (``"minmax"``, ``"mse"``,
            ``"imatrix_mse"``, ...); its qparams are observed once, before the column loop, on the masked weight.
        observer_kwargs: the observer's search settings (``maxshrink``, ``grid``, ``patience``, ``norm``, ...).
        importance: ``[in]`` column importance ``E[x_j^2]`` for ``"imatrix_mse"``
            (``seqcal.algorithms.observe.importance_from_hessian(H)``), or None.
        max_retries, damp_growth: dampening retry policy.
        scale_dtype: dtype of the stored scale; default W's dtype (float16 if W is not a float).
        fmt: a block fp8 / NVFP4 / MX format (``seqcal.algorithms.formats``); overrides num_bits, symmetric,
            strategy, group_size and type. Its qparams are computed once from the masked weight, before the
            column loop, like the others.
        global_scale: NVFP4's float32 global scale, ``[1]`` or one per row ``[out, 1]`` (modules solved
            stacked keep their own); fixed before the solve (from the unquantized weights).
        pruned: bool ``[out, in]`` sparsity mask (True = pruned, e.g. from SparseGPT): those weights are
            quantized to exactly 0 and their error is compensated like rounding errors; None: no mask.
        in_place_factor: on the CPU, factor ``H`` in its own memory (``gptq_factor.cholesky_in_place_``: no
            second [in, in] matrix, about 2x the time of LAPACK's); equal to the default up to float32 rounding,
            so the codes may differ in a few roundings. For host budgets that need it; False keeps LAPACK's.
        overwrite: write Q into W's own memory, a chunk of rows at a time, each chunk's output error taken just
            before (``rel_error``): no third weight-sized matrix beside W^T and the codes (32 MiB at a 8192-wide
            bf16 down_proj). ``Q`` is then W. For a module solved alone, whose weight Q replaces anyway.
        row_chunks: with ``overwrite``, solve the rows a chunk at a time (``gptq_rows.solve_row_chunks``: W^T and
            its qparams' float32 copy 16 MiB at a time, not weight-sized) where the qparams allow it (per-row
            ones of the min-max observer, ``gptq_rows.row_chunked``); equal to the whole solve up to float32
            rounding. For host budgets that need it, with ``in_place_factor``; False solves the whole weight.

    Returns:
        :class:`GPTQResult`.

    Example:
        >>> from seqcal.algorithms.hessian import accumulate_hessian
        >>> X = torch.randn(256, 64); H, _ = accumulate_hessian(None, X, 0)
        >>> r = gptq_quantize(torch.randn(32, 64), H, num_bits=4, group_size=32)
        >>> r.Q.shape, r.scale.shape, r.g_idx is None
        (torch.Size([32, 64]), torch.Size([32, 2]), True)
    """
    _check_inputs(W, H, strategy if fmt is None else "tensor", group_size, block_size)  # fmt checks its own
    if actorder is not None and actorder not in ACTORDER:
        raise ValueError(f"gptq_quantize: unknown actorder {actorder!r}; valid: None, {sorted(ACTORDER)}")
    if scale_dtype is None:
        scale_dtype = W.dtype if W.dtype.is_floating_point and W.dtype.itemsize >= 2 else torch.float16
    qkw = dict(num_bits=num_bits, symmetric=symmetric, strategy=strategy, group_size=group_size)
    qkw.update(type=type, observer=observer, observer_kwargs=observer_kwargs, importance=importance)

    order = ACTORDER.get(actorder) if actorder else None
    # GGUF scales weighted by the inputs' E[x^2] as llama.cpp's with an importance matrix: H's diagonal (2/n X^T X,
    # a constant times E[x^2], which the weighted fit does not see), read before the factor overwrites H
    grid_importance = importance
    if fmt is not None and fmt.scale == "gguf" and grid_importance is None:
        grid_importance = H.diagonal().float().clone()
    # the factor in H's memory (float32 on W's device: no copy), H's values back after the loop; the inverse
    # first: its [in, in] temporaries are gone before the weight-sized ones appear
    with processing_factor(
        H, W.device, order, dampening_frac, max_retries, damp_growth, in_place_factor
    ) as factor:
        Hinv, dead, perm = factor.Hinv, factor.dead, factor.perm
        QT = None  # the row-chunked solve keeps none: Q comes from the codes
        one_thread = one_intra_op_thread() if W.device.type == "cpu" else contextlib.nullcontext()
        if fmt is not None:
            WT, scale, zero_point, col_group, g_idx = _format_qparams(
                W, dead, perm, order, fmt, global_scale, grid_importance
            )
            # exact: fp8 values, powers of two, or block scales rounded first. GGUF scales stay float32: fp16
            # values and small ints, which bf16 would round.
            if fmt.scale != "gguf":
                scale = scale.to(scale_dtype)
            scale32, zero32, col_group = _format_columns(scale, zero_point, fmt, W.shape, global_scale, perm)
            qrange = (*formats.grid_range(fmt), fmt.grid)
        else:
            qrange = (*quant_range(num_bits, type), "fp8" if type == "float" else "int")
        if fmt is None and overwrite and row_chunks and row_chunked(strategy, observer, False):
            with one_thread:  # the loop of tiny ops on one intra-op thread (columns.one_intra_op_thread)
                scale, zero_point, scale32, zero32, col_group, g_idx, codes, row_loss = solve_row_chunks(
                    W, dead, perm, order, group_size, qkw, scale_dtype, Hinv, block_size, qrange, pruned
                )
        else:
            if fmt is None:
                WT, scale, zero_point, col_group, g_idx = _weight_and_qparams(
                    W, dead, perm, order, group_size, qkw
                )
                scale, scale32, zero32 = _stored_qparams(scale, zero_point, scale_dtype)
            # the sparsity mask [in, out] in processing order, like WT
            prunedT = None if pruned is None else processing_mask(pruned, perm, WT.device)
            # the loop on one intra-op thread; the inverse factor above (LAPACK) keeps the caller's threads
            with one_thread:
                QT, codes, row_loss = quantize_columns(
                    WT, Hinv, scale32, zero32, col_group, block_size, qrange, prunedT
                )
            del WT
        del Hinv
    inv = None if perm is None else torch.argsort(perm)  # processing -> original order
    rel_error = None
    if fmt is not None and fmt.scale == "gguf":
        # the loop's (c - z) * s is within a rounding of s * c + b, the weight llama.cpp computes: the weight is
        # taken from the codes, with the block scales refitted to them where the type allows (seqcal.gguf.refit;
        # W and H hold their values here)
        del QT
        codes = _codes_in_order(codes, inv)
        scale, zero_point = fmt.grid_refit(W, codes, scale, zero_point, H)  # type: ignore[attr-defined]
        exact = formats.dequantize(codes, scale, zero_point, fmt, dtype=W.dtype)
        if overwrite:
            rel_error, Q = _overwrite_rows(W, H, lambda rows: exact[rows]), W
        else:
            Q = exact
    else:
        if QT is None:  # H holds its values again here (processing_factor restored them)
            rel_error, Q = overwrite_from_codes(W, codes, scale32, zero32, col_group, inv, H), W
        elif overwrite:
            rel_error, Q = _overwrite_in_order(W, QT, inv, H), W
        else:
            Q = _original_order(QT, inv, W.dtype)
        codes = _codes_in_order(codes, inv)
        del QT
    if fmt is not None and zero_point is None:
        zero_point = torch.zeros_like(scale, dtype=fmt.code_dtype)
    return GPTQResult(
        Q=Q,
        q=codes,
        scale=scale,
        zero_point=zero_point,
        g_idx=g_idx,
        loss=row_loss.sum().item(),
        dampening_frac=factor.dampening_frac,
        retries=factor.retries,
        row_loss=row_loss,
        rel_error=rel_error,
    )
