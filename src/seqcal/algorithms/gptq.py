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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

import seqcal.algorithms.formats as formats
import seqcal.algorithms.products as products
from seqcal.algorithms.columns import one_intra_op_thread, quantize_columns
from seqcal.algorithms.formats import WeightFormat
from seqcal.algorithms.hessian import KeptHessian
from seqcal.algorithms.observe import weight_qparams
from seqcal.algorithms.quant import STRATEGIES, QuantType, Strategy, quant_range
from seqcal.backend import onednn_applies

# "static" and "dynamic" are compressed-tensors' aliases of "weight" and "group"
ACTORDER: dict[str, str] = {"weight": "weight", "static": "weight", "group": "group", "dynamic": "group"}


class GPTQNumericalError(RuntimeError):
    """The Hessian could not be inverted even after extra dampening; fall back to RTN for this module."""


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
    if not torch.isfinite(W.sum(dtype=torch.float32)):
        raise ValueError("gptq_quantize: W contains NaN or inf; the checkpoint is broken upstream of GPTQ")


def _reverse_(t: Tensor, chunk: int = 1 << 20) -> Tensor:
    """Reverse the elements of contiguous ``t`` in place, ``chunk`` at a time (no full-size temporary).

    For a contiguous square matrix that is ``P t P`` with P the reversal permutation.
    """
    flat = t.view(-1)
    n = flat.numel()
    for i in range(0, n // 2, chunk):
        j = min(i + chunk, n // 2)
        head = flat[i:j].flip(0)  # [j - i] copy
        flat[i:j] = flat[n - j : n - i].flip(0)
        flat[n - j : n - i] = head
    return t


def _transpose_(t: Tensor, rows: int = 256) -> Tensor:
    """Transpose contiguous square ``t`` in place, a strip of ``rows`` rows at a time (no full-size temporary)."""
    n = t.shape[0]
    for i0 in range(0, n, rows):
        i1 = min(i0 + rows, n)
        block = t[i0:i1, i0:i1]
        block.copy_(block.T.clone())
        right = t[i0:i1, i1:].clone()  # [rows, n - i1]
        t[i0:i1, i1:] = t[i1:, i0:i1].T
        t[i1:, i0:i1] = right.T
    return t


def _permute_(H: Tensor, perm: Tensor, symmetric: bool = False, rows: int = 256) -> Tensor:
    """``H[perm][:, perm]`` in ``H``'s memory (contiguous, square), with temporaries of ``rows`` rows.

    ``P^T H P = ((H^T P)^T) P``: columns are permuted a strip of rows at a time (a gather each), and a transpose in
    place turns permuted columns into permuted rows; ``symmetric`` (``H == H^T`` exactly) skips the first
    transpose. A constant number of passes, however many cycles ``perm`` has.
    """
    if not symmetric:
        _transpose_(H, rows)  # H^T
    _permute_columns_(H, perm, rows)  # H^T P
    _transpose_(H, rows)  # P^T H
    return _permute_columns_(H, perm, rows)  # P^T H P


def _permute_columns_(H: Tensor, perm: Tensor, rows: int) -> Tensor:
    """``H[:, perm]`` in ``H``'s memory, a strip of ``rows`` rows at a time."""
    for r in range(0, H.shape[0], rows):
        H[r : r + rows] = H[r : r + rows].index_select(1, perm)
    return H


def _processing_hessian_(H: Tensor, perm: Tensor | None, dead: Tensor, symmetric: bool = False) -> Tensor:
    """``H`` float32 in processing order, dead inputs' diagonal set to 1, in ``H``'s memory."""
    if perm is not None:
        _permute_(H, perm, symmetric)
    H.diagonal()[dead if perm is None else dead[perm]] = 1
    return H


@contextlib.contextmanager
def _factor_scratch(H32: Tensor, H: Tensor) -> Iterator[KeptHessian]:
    """``H32``'s memory as the inverse factor's working copy (:func:`_inverse_hessian_factor`); yields its values,
    kept meanwhile (``hessian.KeptHessian``: the upper triangle, half an [in, in] matrix, of a symmetric one).

    When ``H32`` is ``H``'s memory (a float32 Hessian on the weight's device: the usual case), ``H``'s values are
    written back on exit, bit for bit, for the caller's later reads (errors measured with ``H``, the next chunk
    of a shared Hessian). The factor lives in that memory until then: it must not be read after the block.
    """
    kept = KeptHessian(H32)
    try:
        yield kept
    finally:
        if H32.data_ptr() == H.data_ptr():
            kept.restore(H32)


def _inverse_hessian_factor(
    H: Tensor,
    kept: KeptHessian,
    perm: Tensor | None,
    dead: Tensor,
    dampening_frac: float,
    max_retries: int,
    damp_growth: float,
) -> tuple[Tensor, float, int]:
    """Upper Cholesky factor of ``(Hp + damp I)^-1`` in ``H``'s memory, raising dampening ``damp_growth``x per
    failure.

    ``Hp`` is ``H`` [in, in] float32 (contiguous) permuted by ``perm`` with the ``dead`` inputs' diagonal set to
    1. ``H`` is overwritten: it becomes ``Hp``, then the factor; ``kept`` holds its values
    (:func:`_factor_scratch`), from which a retry rebuilds ``Hp`` and replays the dampening steps, so the values
    are those of dampening one copy step by step. Memory besides ``H`` and ``kept``: the Cholesky factor (one
    [in, in] matrix), or with the blocked factor of ``products.inverse_cholesky_factor_`` (float32 CPU solves
    wider than ``FACTOR_LEAF`` where oneDNN is on) three quarters of one. Building the working copy in ``H``'s
    memory instead of a new [in, in] matrix bounds a layer's peak for wide inputs (down_proj: 5632^2 floats =
    127 MB each).
    """
    n = H.shape[0]
    steps: list[float] = []  # diagonal increments so far; each attempt applies them all, in order
    applied = mean_diag = 0.0
    for retry in range(max_retries + 1):
        Hp = _processing_hessian_(H if retry == 0 else kept.restore(H), perm, dead, kept.symmetric)
        if retry == 0:
            if not torch.isfinite(Hp.sum()):  # one reduction: any NaN/inf makes the sum non-finite
                raise GPTQNumericalError(
                    "Hessian contains NaN or inf (inputs overflowed?); use RTN for this module"
                )
            mean_diag = Hp.diagonal().mean().item()
        frac = dampening_frac * damp_growth**retry
        steps.append((frac - applied) * mean_diag)
        applied = frac
        # The upper Cholesky factor U of H^-1 (H^-1 = U^T U) without forming H^-1: with P the reversal
        # permutation and P H P = Lr Lr^T, U = P Lr^-1 P. One Cholesky and one triangular solve.
        Hr = _reverse_(Hp)  # P Hp P, in place
        del Hp
        for step in steps:
            Hr.diagonal().add_(step)  # the diagonal of P Hp P is Hp's, reversed: same values, same adds
        blocked = onednn_applies(Hr, Hr) and n > products.FACTOR_LEAF  # float32 CPU: on oneDNN
        inv = _lower_inverse(Hr, blocked)  # Lr^-1 in H's memory, or None when the Cholesky failed
        del Hr
        if inv is None:
            continue
        # P Lr^-1 P, row-major, in H's memory. The blocked factor is row-major already: reversed in place.
        # LAPACK's is column-major: reversing its memory in place reverses it too (still column-major), and
        # the in-place transpose makes it row-major (contiguous() would make a second [in, in] matrix)
        Hinv = _reverse_(inv) if blocked else _transpose_(_reverse_(inv.t()))
        del inv
        if torch.isfinite(Hinv.sum()) and bool((Hinv.diagonal() > 0).all()):
            return Hinv, frac, retry
    raise GPTQNumericalError(
        f"Cholesky of the Hessian failed up to dampening_frac={applied:g} "
        f"({max_retries} retries x{damp_growth:g}); raise dampening_frac, add calibration samples, "
        "or quantize this module with RTN"
    )


def _lower_inverse(Hr: Tensor, blocked: bool) -> Tensor | None:
    """``Lr^-1`` for the lower Cholesky factor ``Lr`` of ``Hr``, or None if ``Hr`` is not positive definite.

    ``blocked``: ``products.inverse_cholesky_factor_`` in ``Hr``'s memory (row-major). Otherwise LAPACK's (or
    cuSOLVER's) Cholesky, then ``Lr^-1`` in place of an identity written into ``Hr``'s memory and laid out
    column-major, as solve_triangular lays out its own output: same call, same values, one [in, in] matrix
    (the factor ``Lr``) besides ``Hr``.
    """
    if blocked:
        return products.inverse_cholesky_factor_(Hr)
    Lr, info = torch.linalg.cholesky_ex(Hr)
    if info.item() != 0:
        return None
    inv = Hr.zero_().fill_diagonal_(1).t()  # Hr is spent: the identity in its memory, column-major
    return torch.linalg.solve_triangular(Lr, inv, upper=False, out=inv)


def _order(H: Tensor, dead: Tensor, actorder: str | None) -> Tensor | None:
    """Processing order of the input columns: most active first (descending diag(H)), or None."""
    if actorder is None:
        return None
    diag = H.diagonal().clone()  # [in]
    diag[dead] = 1
    return torch.argsort(diag, descending=True, stable=True)


def _weight_and_qparams(
    W: Tensor, dead: Tensor, perm: Tensor | None, actorder: str | None, group_size: int | None, qkw: dict
):
    """W transposed into processing order and its qparams.

    Returns ``WT [in, out]`` float32 (column i of the processing order is row i), ``scale, zero_point``,
    ``col_group [in]`` (the qparam column used by each processed column) and ``g_idx`` (or None).
    At most two weight-sized float32 copies exist at once.
    """
    n_in = W.shape[1]
    W32 = W.detach().to(torch.float32, copy=True)  # [out, in]
    W32[:, dead] = 0  # inputs never seen: any weight is free, so make it 0
    col_group = torch.arange(n_in, device=W.device)
    col_group = col_group // group_size if qkw["strategy"] == "group" else torch.zeros_like(col_group)
    if actorder is None:
        return W32.T.contiguous(), *weight_qparams(W32, **qkw), col_group, None
    if actorder == "weight":
        # groups stay contiguous in the original order: the checkpoint format does not change
        scale, zero_point = weight_qparams(W32, **qkw)
        return W32.T.index_select(0, perm), scale, zero_point, col_group[perm], None
    W32 = W32[:, perm]
    if qkw.get("importance") is not None:  # the importance follows its columns
        qkw = {**qkw, "importance": qkw["importance"][perm]}
    scale, zero_point = weight_qparams(W32, **qkw)  # groups of consecutive *permuted* columns
    g_idx = col_group[torch.argsort(perm)].to(torch.int32) if qkw["strategy"] == "group" else None
    return W32.T.contiguous(), scale, zero_point, col_group, g_idx


def _format_qparams(
    W: Tensor,
    dead: Tensor,
    perm: Tensor | None,
    actorder: str | None,
    fmt: WeightFormat,
    global_scale: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, None]:
    """:func:`_weight_and_qparams` for a ``seqcal.algorithms.formats`` format (contiguous groups / blocks only)."""
    if actorder == "group":
        raise ValueError("gptq_quantize: actorder='group' is not supported for block, NVFP4 or MX formats")
    W32 = W.detach().to(torch.float32, copy=True)  # [out, in]
    W32[:, dead] = 0
    scale, zero_point = formats.qparams(W32, fmt, global_scale)
    WT = W32.T.contiguous() if perm is None else W32.T.index_select(0, perm)
    return WT, scale, zero_point, torch.empty(0), None


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
        W: weight ``[out, in]``, any float dtype (not modified).
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

    # float32 on W's device; no copy when it already is (its memory is the factor's scratch, its values restored)
    H32 = H.detach().to(device=W.device, dtype=torch.float32).contiguous()  # [in, in]
    dead = H32.diagonal() == 0  # inputs never seen: H_ii = 1 and W[:, i] = 0
    order = ACTORDER.get(actorder) if actorder else None
    perm = _order(H32, dead, order)
    with _factor_scratch(H32, H) as kept:  # the factor in H's memory; H's values back after the loop
        # the inverse first: its [in, in] temporaries are gone before the weight-sized ones appear
        Hinv, frac, retries = _inverse_hessian_factor(
            H32, kept, perm, dead, dampening_frac, max_retries, damp_growth
        )
        if fmt is not None:
            WT, scale, zero_point, col_group, g_idx = _format_qparams(W, dead, perm, order, fmt, global_scale)
            scale = scale.to(scale_dtype)  # exact: fp8 values, powers of two, or block scales rounded first
            scale32, zero32, col_group = _format_columns(scale, zero_point, fmt, W.shape, global_scale, perm)
            qrange = (*formats.grid_range(fmt), fmt.grid)
        else:
            WT, scale, zero_point, col_group, g_idx = _weight_and_qparams(
                W, dead, perm, order, group_size, qkw
            )
            # round first, so Q is exactly what the checkpoint dequantizes to; an underflow must not give 0
            scale = scale.to(scale_dtype)
            scale = torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale)
            scale32 = scale.float().reshape(scale.shape[0] if scale.ndim == 2 else 1, -1)  # [out or 1, G]
            zero32 = zero_point.float().reshape(scale32.shape)
            qrange = (*quant_range(num_bits, type), "fp8" if type == "float" else "int")
        prunedT = None
        if pruned is not None:  # [in, out] in processing order, like WT
            prunedT = (
                pruned.T.contiguous().to(WT.device)
                if perm is None
                else pruned.T.to(WT.device).index_select(0, perm)
            )
        # the loop of tiny ops on one intra-op thread; the inverse factor above (LAPACK) keeps the caller's threads
        with one_intra_op_thread() if WT.device.type == "cpu" else contextlib.nullcontext():
            QT, codes, row_loss = quantize_columns(
                WT, Hinv, scale32, zero32, col_group, block_size, qrange, prunedT
            )
        del WT, Hinv
    Q = QT.T.to(W.dtype)  # [out, in]; the cast is per element, so casting before un-permuting is exact
    del QT
    if perm is not None:
        inv = torch.argsort(perm)
        Q, codes = Q[:, inv], codes[:, inv]
    if fmt is not None and zero_point is None:
        zero_point = torch.zeros_like(scale, dtype=fmt.code_dtype)
    return GPTQResult(
        Q=Q,
        q=codes,
        scale=scale,
        zero_point=zero_point,
        g_idx=g_idx,
        loss=row_loss.sum().item(),
        dampening_frac=frac,
        retries=retries,
        row_loss=row_loss,
    )
