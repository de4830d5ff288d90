"""GPTAQ (Li et al. 2025, arXiv:2504.02692; first named GPTQv2) as pure tensor functions.

GPTQ with *asymmetric calibration*: a layer's quantized weight ``Q`` is fitted to the full-precision model's
output, ``min ||W X^T - Q X~^T||^2``, where ``X [tokens, in]`` are the layer's inputs in the full-precision model
and ``X~ [tokens, in]`` its inputs in the model quantized so far. Each layer thereby also corrects the error of
the quantized inputs it receives, instead of only its own rounding error (GPTQ's ``min ||(W - Q) X~^T||^2``).

Notation as in ``gptq.py``: ``W [out, in]``, ``H = 2 X~^T X~ / tokens [in, in]`` (GPTQ's Hessian, of ``X~``),
``Hinv`` the upper Cholesky factor ``U`` of ``H^-1``, and ``dXXT = 2 (X - X~)^T X~ / tokens [in, in]``.

The solve is GPTQ's column loop plus one term. Column ``q`` (its value ``w_q`` when its turn comes) is rounded to
``c_q``; the later columns ``F`` absorb its rounding error, ``-(w_q - c_q) / U_qq * U_{q,F}`` as in GPTQ, and
its share of the input mismatch, ``w_q (x_q - x~_q)``: ``+ w_q P_{q,F}`` with ``P_{q,F} = dXXT_{q,F} H_FF^-1``,
the least-squares fit of ``x_q - x~_q`` by the quantized inputs not yet fixed (paper, Eq. 18).

With ``H_FF^-1 = U_FF^T U_FF``, all rows at once: ``P = alpha * triu(dXXT U^T, 1) U`` (strictly upper
triangular). ``alpha = 0.25`` (default) is the reference implementation's empirical scale, ``alpha = 1`` the
paper's formula; ``alpha = 0`` or ``dXXT = 0`` (``X~ == X``) is GPTQ, code for code. The factor is GPTQ's
(``gptq_factor.processing_factor``), the loop GPTQ's with the term added (``columns.quantize_columns`` with
``mismatch=P``): lazy batch updates in blocks of ``block_size`` and sub-blocks of ``columns.SUB_BLOCK``; unlike the reference implementation (and GPTQModel's),
whose update of later blocks multiplies ``P`` by the block's *rounded* columns, both levels use ``w_q``: the
result does not depend on ``block_size`` (up to float rounding).
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from torch import Tensor

from seqcal.algorithms.columns import one_intra_op_thread, quantize_columns
from seqcal.algorithms.gptq import ACTORDER, GPTQResult
from seqcal.algorithms.gptq_factor import Factor, processing_factor
from seqcal.algorithms.gptq_rows import _codes_in_order, _original_order, _stored_qparams, _weight_and_qparams
from seqcal.algorithms.hessian import running_square
from seqcal.algorithms.in_place import _permute_
from seqcal.algorithms.quant import STRATEGIES, Strategy, quant_range

# The reference implementation's scale of the input-mismatch term (its authors' most stable choice).
DEFAULT_ALPHA = 0.25


def accumulate_dxxt(dXXT: Tensor | None, X: Tensor, X_tilde: Tensor, n_seen: int) -> tuple[Tensor, int]:
    """Running average ``dXXT_n = 2 / n * sum_t (x_t - x~_t)^T x~_t`` over tokens, in float32.

    The same token average as ``hessian.accumulate_hessian``: call both on every batch with the same ``n_seen``,
    ``H`` on ``X~``. ``X`` and ``X~`` are the same tokens (padding dropped from both); their difference is taken
    in float32, so bf16 inputs lose nothing there.

    Args:
        dXXT: current ``[in, in]`` float32 (updated in place), or None to start one on ``X~``'s device.
        X: the layer's inputs in the full-precision model, ``[..., in]`` (leading dims are tokens).
        X_tilde: its inputs in the partly quantized model, same shape.
        n_seen: tokens already averaged into ``dXXT``.

    Returns:
        ``(dXXT, n_seen + tokens in X)``.

    Example:
        >>> X = torch.randn(2, 16, 8)
        >>> D, n = accumulate_dxxt(None, X, X + 0.1, 0)
        >>> D.shape, n
        (torch.Size([8, 8]), 32)
    """
    if X.shape != X_tilde.shape:
        raise ValueError(
            f"accumulate_dxxt: X {list(X.shape)} and X_tilde {list(X_tilde.shape)} must be the same tokens; "
            "record both inputs of one batch with the same padding removed"
        )
    Xt = X_tilde.reshape(-1, X_tilde.shape[-1])  # [m, in]
    d = Xt.shape[1]
    dXXT = running_square(dXXT, Xt, "accumulate_dxxt", "dXXT")
    m = Xt.shape[0]
    if m == 0:
        return dXXT, n_seen
    n = n_seen + m
    Xt32 = Xt.to(device=dXXT.device, dtype=torch.float32)  # [m, in]
    dX = X.reshape(-1, d).to(device=dXXT.device, dtype=torch.float32) - Xt32  # [m, in]
    dXXT.mul_(n_seen / n).addmm_(dX.T, Xt32, alpha=2 / n)
    return dXXT, n


def asymmetry_matrix(
    dXXT: Tensor, Hinv: Tensor, alpha: float = DEFAULT_ALPHA, out: Tensor | None = None
) -> Tensor:
    """``P = alpha * triu(dXXT U^T, 1) U``: row ``q`` is ``alpha * dXXT_{q,F} H_FF^-1`` on the later columns F.

    Args:
        dXXT: ``[in, in]`` float32 in processing order.
        Hinv: ``U`` ``[in, in]``, the upper Cholesky factor of ``H^-1`` in the same order.
        alpha: scale of the input-mismatch term.
        out: where to write ``P`` (``dXXT`` itself is allowed: it is read first), or None for a new matrix.

    Returns:
        ``P`` ``[in, in]``, strictly upper triangular.

    Example:
        >>> U = torch.linalg.cholesky(torch.linalg.inv(torch.eye(3) * 2), upper=True)
        >>> bool(asymmetry_matrix(torch.ones(3, 3), U, 1.0).diagonal().eq(0).all())
        True
    """
    T = (dXXT @ Hinv.T).triu_(1).mul_(alpha)  # [in, in]
    return torch.mm(T, Hinv) if out is None else torch.mm(T, Hinv, out=out)


def _check_inputs(W: Tensor, H: Tensor, dXXT: Tensor, strategy: str, group_size: int | None, **kw) -> None:
    n_in = W.shape[1] if W.ndim == 2 else -1
    bits, block, actorder = kw["type"], kw["block_size"], kw["actorder"]
    # fmt: off
    problems = [
        (W.ndim != 2, f"W must be 2-D [out, in], got shape {list(W.shape)}; flatten it first"),
        (H.shape != (n_in, n_in), f"H must be [{n_in}, {n_in}] for W {list(W.shape)}, got {list(H.shape)}"),
        (dXXT.shape != (n_in, n_in), f"dXXT must be [{n_in}, {n_in}] like H, got {list(dXXT.shape)}"),
        (strategy not in STRATEGIES, f"unknown strategy {strategy!r}; valid: {STRATEGIES}"),
        (strategy == "group" and (not group_size or group_size < 0 or n_in % group_size != 0),
         f"group strategy needs a group_size > 0 dividing in_features {n_in}, got {group_size}"),
        (block <= 0, f"block_size must be > 0, got {block}"),
        (bits != "int", f"only integer weights are supported, got type={bits!r}; use GPTQ for fp8"),
        (actorder is not None and actorder not in ACTORDER,
         f"unknown actorder {actorder!r}; valid: None, {sorted(ACTORDER)}"),
    ]
    # fmt: on
    for bad, message in problems:
        if bad:
            raise ValueError(f"gptaq_quantize: {message}")
    if not torch.isfinite(W.sum(dtype=torch.float32)):
        raise ValueError("gptaq_quantize: W contains NaN or inf; the checkpoint is broken upstream of GPTAQ")


def _mismatch(dXXT: Tensor, factor: Factor, alpha: float) -> Tensor:
    """``P`` [in, in] in processing order (:func:`asymmetry_matrix` of the dead-masked, permuted ``dXXT``), in the
    memory of one copy of ``dXXT`` on the factor's device."""
    D = dXXT.detach().to(device=factor.Hinv.device, dtype=torch.float32, copy=True)  # [in, in]
    D[:, factor.dead] = 0  # nothing can compensate with an input the quantized model never sees
    if factor.perm is not None:
        _permute_(D, factor.perm)
    return asymmetry_matrix(D, factor.Hinv, alpha, out=D)


def _fit_dead_inputs_(WT: Tensor, W: Tensor, P: Tensor, dead: Tensor, perm: Tensor | None) -> None:
    """Add the dead inputs' terms ``w_i P_{i,F}`` (``w_i`` the original weight) to ``WT`` [in, out] up front: a dead
    input is quantized to 0, but its float output ``W_:,i x_i`` is still fitted by the later columns. Nothing
    updates a dead column (``U`` is diagonal there, ``P``'s column zero): the loop would add the same at its turn.
    """
    if not bool(dead.any()):
        return
    original = dead.nonzero().squeeze(1)  # [k] original column indices
    at = original if perm is None else torch.argsort(perm)[original]  # their positions in processing order
    WT.addmm_(P[at].T, W.detach()[:, original].T.to(torch.float32))  # [in, k] @ [k, out]


def gptaq_quantize(
    W: Tensor,
    H: Tensor,
    dXXT: Tensor,
    *,
    num_bits: int = 4,
    symmetric: bool = True,
    strategy: Strategy = "group",
    group_size: int | None = 128,
    alpha: float = DEFAULT_ALPHA,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    actorder: Literal["static", "weight", "group", "dynamic"] | None = None,
    observer: str = "minmax",
    observer_kwargs: dict | None = None,
    importance: Tensor | None = None,
    max_retries: int = 3,
    damp_growth: float = 10.0,
    scale_dtype: torch.dtype | None = None,
    type: Literal["int"] = "int",
    in_place_factor: bool = False,
) -> GPTQResult:
    """Quantize ``W`` with GPTAQ given ``H`` of its quantized-model inputs and ``dXXT`` (module docstring).

    The rest is as ``gptq.gptq_quantize`` does it: dead inputs (``H_ii == 0``) get ``H_ii = 1`` and ``Q[:, i] = 0``
    (their float output ``W[:, i] x_i`` is still fitted), qparams observed once on the masked weight, dampening
    grown ``damp_growth``x per failed Cholesky, then :class:`GPTQNumericalError`, ``actorder``.

    Args:
        W: weight ``[out, in]``, any float dtype (not modified).
        H: ``[in, in]`` from ``hessian.accumulate_hessian`` on ``X~`` (not modified).
        dXXT: ``[in, in]`` from :func:`accumulate_dxxt` on the same tokens (not modified).
        num_bits, symmetric, strategy, group_size: integer target format and qparam granularity.
        alpha: scale of the input-mismatch term (0: GPTQ).
        block_size: columns per lazy-update block.
        dampening_frac, max_retries, damp_growth: dampening and its retry policy.
        actorder: None, ``"static"``/``"weight"`` or ``"group"``/``"dynamic"``.
        observer, observer_kwargs, importance: the weight observer (``seqcal.algorithms.observe``).
        scale_dtype: dtype of the stored scale; default W's dtype (float16 if W is not a float).
        type: ``"int"`` only (fp8 and the block formats are GPTQ's).
        in_place_factor: the CPU factor in ``H``'s memory, as ``gptq.gptq_quantize``'s.

    Returns:
        ``gptq.GPTQResult`` (codes, scale and zero point exactly as GPTQ's; ``loss`` its rounding objective).

    Example:
        >>> from seqcal.algorithms.hessian import accumulate_hessian
        >>> X = torch.randn(256, 64); Xq = X + 0.05 * torch.randn(256, 64)
        >>> H, _ = accumulate_hessian(None, Xq, 0); D, _ = accumulate_dxxt(None, X, Xq, 0)
        >>> r = gptaq_quantize(torch.randn(32, 64), H, D, group_size=32)
        >>> r.Q.shape, r.scale.shape
        (torch.Size([32, 64]), torch.Size([32, 2]))
    """
    _check_inputs(W, H, dXXT, strategy, group_size, block_size=block_size, type=type, actorder=actorder)
    if scale_dtype is None:
        scale_dtype = W.dtype if W.dtype.is_floating_point and W.dtype.itemsize >= 2 else torch.float16
    qkw = dict(num_bits=num_bits, symmetric=symmetric, strategy=strategy, group_size=group_size, type=type)
    qkw.update(observer=observer, observer_kwargs=observer_kwargs, importance=importance)
    order = ACTORDER.get(actorder) if actorder else None
    # GPTQ's factor, in H's memory (float32 on W's device: no copy), H's values back after the loop
    with processing_factor(
        H, W.device, order, dampening_frac, max_retries, damp_growth, in_place_factor
    ) as factor:
        P = _mismatch(dXXT, factor, alpha)
        WT, scale, zero_point, col_group, g_idx = _weight_and_qparams(
            W, factor.dead, factor.perm, order, group_size, qkw
        )
        _fit_dead_inputs_(WT, W, P, factor.dead, factor.perm)
        scale, scale32, zero32 = _stored_qparams(scale, zero_point, scale_dtype)
        qrange = (*quant_range(num_bits, "int"), "int")
        with one_intra_op_thread() if WT.device.type == "cpu" else contextlib.nullcontext():
            QT, codes, row_loss = quantize_columns(
                WT, factor.Hinv, scale32, zero32, col_group, block_size, qrange, mismatch=P
            )
        del WT, P
    inv = None if factor.perm is None else torch.argsort(factor.perm)  # processing -> original order
    Q, codes = _original_order(QT, inv, W.dtype), _codes_in_order(codes, inv)
    return GPTQResult(
        Q=Q, q=codes, scale=scale, zero_point=zero_point, g_idx=g_idx, loss=row_loss.sum().item(),
        dampening_frac=factor.dampening_frac, retries=factor.retries, row_loss=row_loss,
    )  # fmt: skip
