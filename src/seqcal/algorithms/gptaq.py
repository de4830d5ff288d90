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
paper's formula; ``alpha = 0`` or ``dXXT = 0`` (``X~ == X``) is GPTQ, code for code. Lazy batch updates as GPTQ's
(blocks of ``block_size``, sub-blocks of ``SUB_BLOCK``); unlike the reference implementation (and GPTQModel's),
whose update of later blocks multiplies ``P`` by the block's *rounded* columns, both levels use ``w_q``: the
result does not depend on ``block_size`` (up to float rounding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
from torch import Tensor

from seqcal.algorithms import products
from seqcal.algorithms.gptq import GPTQNumericalError, GPTQResult
from seqcal.algorithms.observe import weight_qparams
from seqcal.algorithms.quant import STRATEGIES, Strategy, quant_range
from seqcal.backend import onednn_applies

# The reference implementation's scale of the input-mismatch term (its authors' most stable choice).
DEFAULT_ALPHA = 0.25
# Columns updated eagerly (rank-1) inside a block, the rest of the block by one product per sub-block. The same
# value and the same operations as GPTQ's column loop, so that with P = 0 the floats, hence the codes, are GPTQ's.
SUB_BLOCK = 16
# "static"/"dynamic" are compressed-tensors' aliases of "weight"/"group" (as in gptq.py)
ACTORDER: dict[str, str] = {"weight": "weight", "static": "weight", "group": "group", "dynamic": "group"}


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
    if dXXT is None:
        dXXT = torch.zeros(d, d, dtype=torch.float32, device=Xt.device)
    if dXXT.shape != (d, d) or dXXT.dtype != torch.float32:
        raise ValueError(
            f"accumulate_dxxt: dXXT must be float32 [{d}, {d}] to match inputs with {d} features, "
            f"got {dXXT.dtype} {list(dXXT.shape)}"
        )
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


def _inverse_factor(
    Hp: Tensor, dampening_frac: float, max_retries: int, damp_growth: float
) -> tuple[Tensor, float, int]:
    """``U``, the upper Cholesky factor of ``(Hp + damp I)^-1``, raising dampening ``damp_growth``x per failure.

    ``Hp`` [in, in] float32, in processing order, dead inputs' diagonal already 1 (not modified). The same
    operations as GPTQ's factor: with ``R`` the reversal permutation and ``R Hp R = Lr Lr^T``, ``U = R Lr^-1 R``
    (one Cholesky, one triangular solve), each retry applying the earlier dampening steps in order.
    """
    if not torch.isfinite(Hp.sum()):
        raise GPTQNumericalError("Hessian contains NaN or inf (inputs overflowed?); use RTN for this module")
    n = Hp.shape[0]
    mean_diag = Hp.diagonal().mean().item()
    steps: list[float] = []
    applied = 0.0
    for retry in range(max_retries + 1):
        frac = dampening_frac * damp_growth**retry
        steps.append((frac - applied) * mean_diag)
        applied = frac
        Hr = Hp.flip(0, 1).contiguous()  # R Hp R
        for step in steps:
            Hr.diagonal().add_(step)
        if onednn_applies(Hr, Hr) and n > products.FACTOR_LEAF:  # float32 CPU: GPTQ's blocked factor
            inv = products.inverse_cholesky_factor_(Hr)
        else:
            Lr, info = torch.linalg.cholesky_ex(Hr)
            # Hr is spent: the identity in its memory, column-major as the solve lays out its own output
            inv = None if info.item() != 0 else Hr.zero_().fill_diagonal_(1).t()
            if inv is not None:
                torch.linalg.solve_triangular(Lr, inv, upper=False, out=inv)
            del Lr
        del Hr
        if inv is None:
            continue
        U = inv.flip(0, 1).contiguous()  # R Lr^-1 R
        del inv
        if torch.isfinite(U.sum()) and bool((U.diagonal() > 0).all()):
            return U, frac, retry
    raise GPTQNumericalError(
        f"Cholesky of the Hessian failed up to dampening_frac={applied:g} ({max_retries} retries "
        f"x{damp_growth:g}); raise dampening_frac, add calibration samples, or quantize this module with RTN"
    )


def _factor_and_mismatch(
    H: Tensor, dXXT: Tensor, device: torch.device, actorder: str | None, alpha: float, dampening_frac: float,
    max_retries: int, damp_growth: float,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, float, int]:  # fmt: skip
    """``(dead [in], perm or None, U, P, dampening_frac used, retries)``, ``U`` and ``P`` in processing order.

    At most three [in, in] float32 matrices at once besides the caller's ``H`` and ``dXXT``.
    """
    Hp = H.detach().to(device=device, dtype=torch.float32, copy=True)  # [in, in]
    dead = Hp.diagonal() == 0  # inputs never seen in X~
    perm = None  # processing order with actorder: most active first (descending diag(H))
    if actorder is not None:
        perm = torch.argsort(Hp.diagonal().masked_fill(dead, 1), descending=True, stable=True)
    if perm is not None:
        Hp = _permute_(Hp, perm)
    Hp.diagonal()[dead if perm is None else dead[perm]] = 1
    U, frac, retries = _inverse_factor(Hp, dampening_frac, max_retries, damp_growth)
    del Hp
    D = dXXT.detach().to(device=device, dtype=torch.float32, copy=True)  # [in, in]
    D[:, dead] = 0  # nothing can compensate with an input the quantized model never sees
    if perm is not None:
        D = _permute_(D, perm)
    return dead, perm, U, asymmetry_matrix(D, U, alpha, out=D), frac, retries


def _permute_(A: Tensor, perm: Tensor) -> Tensor:
    """``A[perm][:, perm]`` in ``A``'s memory, one [in, in] temporary at a time."""
    A.copy_(A[perm])
    return A.copy_(A[:, perm])


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


def _weight_and_qparams(
    W: Tensor, dead: Tensor, perm: Tensor | None, actorder: str | None, group_size: int | None, qkw: dict
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """``WT [in, out]`` float32 in processing order, dead inputs 0, ``scale, zero_point``, ``col_group [in]`` (the
    qparam column of each processed column) and ``g_idx`` (``actorder="group"`` with groups), as GPTQ's."""
    n_in = W.shape[1]
    W32 = W.detach().to(torch.float32, copy=True)  # [out, in]
    W32[:, dead] = 0  # inputs never seen: any weight is free, so make it 0
    col_group = torch.arange(n_in, device=W32.device)
    col_group = col_group // group_size if qkw["strategy"] == "group" else torch.zeros_like(col_group)
    if actorder is None:
        return W32.T.contiguous(), *weight_qparams(W32, **qkw), col_group, None
    if actorder == "weight":  # groups of original columns: the checkpoint format does not change
        return W32.T[perm].contiguous(), *weight_qparams(W32, **qkw), col_group[perm], None
    if qkw.get("importance") is not None:  # the importance follows its columns
        qkw = {**qkw, "importance": qkw["importance"][perm]}
    scale, zero_point = weight_qparams(W32[:, perm], **qkw)  # groups of consecutive *permuted* columns
    g_idx = col_group[torch.argsort(perm)].to(torch.int32) if qkw["strategy"] == "group" else None
    return W32.T[perm].contiguous(), scale, zero_point, col_group, g_idx


@contextlib.contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """The column loop's tiny ops on one CPU intra-op thread, as GPTQ's (and so its products round as there)."""
    before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
    dead, perm, Hinv, P, frac, retries = _factor_and_mismatch(
        H, dXXT, W.device, order, alpha, dampening_frac, max_retries, damp_growth
    )
    WT, scale, zero_point, col_group, g_idx = _weight_and_qparams(W, dead, perm, order, group_size, qkw)
    _fit_dead_inputs_(WT, W, P, dead, perm)
    # round first, so Q is exactly what the checkpoint dequantizes to; an underflow must not give 0
    scale = scale.to(scale_dtype)
    scale = torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale)
    scale32 = scale.float().reshape(scale.shape[0] if scale.ndim == 2 else 1, -1)  # [out or 1, G]
    zero32 = zero_point.float().reshape(scale32.shape)
    with _one_thread(WT.device):
        QT, codes, row_loss = _quantize_columns(
            WT, Hinv, P, scale32.T.contiguous(), zero32.T.contiguous(), col_group, block_size, num_bits
        )
    Q = QT.T.to(W.dtype)  # [out, in]; a cast per element: casting before un-permuting is exact
    if perm is not None:
        inv = torch.argsort(perm)
        Q, codes = Q[:, inv], codes[:, inv]
    return GPTQResult(
        Q=Q, q=codes, scale=scale, zero_point=zero_point, g_idx=g_idx, loss=row_loss.sum().item(),
        dampening_frac=frac, retries=retries, row_loss=row_loss,
    )  # fmt: skip


def _quantize_columns(
    WT: Tensor, Hinv: Tensor, P: Tensor, scaleT: Tensor, zeroT: Tensor, col_group: Tensor, block_size: int,
    num_bits: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The column loop on ``WT = W^T`` [in, out] float32 in processing order, which it overwrites. ``scaleT, zeroT``
    [G, out or 1] float32, ``col_group`` [in] the qparam row of each processed column. Returns ``(QT [in, out] float32, codes [out, in] int8, row_loss [out])``, in processing order.
    """
    n_in, n_out = WT.shape
    # a symmetric scheme's zero point adds and subtracts nothing: skip those kernels
    qrange = (*quant_range(num_bits, "int"), not bool(zeroT.any()))
    CT = torch.empty_like(WT)  # [in, out] codes, as floats until the end
    groups = col_group.tolist()
    losses = torch.zeros(n_out, dtype=torch.float32, device=WT.device)
    for i1 in range(0, n_in, block_size):
        i2 = min(i1 + block_size, n_in)
        W1 = WT[i1:i2].clone()  # [B, out]: the block, updated eagerly
        Err1, Wq1 = torch.empty_like(W1), torch.empty_like(W1)  # [B, out]: rounding errors / U_qq, and w_q
        rows = [(scaleT[g], zeroT[g]) for g in groups[i1:i2]]
        _column_block(W1, CT[i1:i2], Err1, Wq1, Hinv[i1:i2, i1:i2], P[i1:i2, i1:i2], rows, qrange)
        losses += (Err1 * Err1).sum(0)
        WT[i2:].addmm_(Hinv[i1:i2, i2:].T, Err1, alpha=-1)  # lazy batch update of later blocks: rounding,
        WT[i2:].addmm_(P[i1:i2, i2:].T, Wq1)  # and input mismatch
    codes = CT.T.to(torch.int8)  # [out, in]
    gidx = col_group.to(WT.device)
    torch.sub(CT, zeroT[gidx], out=WT).mul_(scaleT[gidx])  # WT is spent: Q^T = (c - z) * s, per element
    return WT, codes, losses / 2


def _column_block(
    W1: Tensor, C1: Tensor, Err1: Tensor, Wq1: Tensor, Hinv1: Tensor, P1: Tensor, qparams: list, qrange: tuple,
) -> None:  # fmt: skip
    """One block's columns in order (``[B, out]`` rows of W^T), each one's two terms spread over the block's later
    columns. The rounding term is GPTQ's, operation for operation; the mismatch term follows it separately, so
    that it adds exact zeros when ``P1`` is 0. ``qrange``: ``(qmin, qmax, symmetric)``."""
    qmin, qmax, symmetric = qrange
    B = W1.shape[0]
    for j1 in range(0, B, SUB_BLOCK):
        j2 = min(j1 + SUB_BLOCK, B)
        for i in range(j1, j2):
            w, c, err = W1[i], C1[i], Err1[i]
            s, z = qparams[i]
            Wq1[i].copy_(w)
            if symmetric:  # c = round(clamp(w / s + z)); err = w - (c - z) * s
                torch.div(w, s, out=c)
            else:
                torch.addcdiv(z, w, s, out=c)
            c.clamp_(qmin, qmax).round_()
            if symmetric:
                torch.mul(c, s, out=err)
            else:
                torch.sub(c, z, out=err).mul_(s)
            torch.sub(w, err, out=err)
            err.div_(Hinv1[i, i])
            W1[i:j2].addr_(Hinv1[i, i:j2], err, alpha=-1)  # OBS update inside the sub-block
            W1[i + 1 : j2].addr_(P1[i, i + 1 : j2], Wq1[i])  # + w_q P_{q,F}
        W1[j2:].addmm_(Hinv1[j1:j2, j2:].T, Err1[j1:j2], alpha=-1)  # rest of the block, at once
        W1[j2:].addmm_(P1[j1:j2, j2:].T, Wq1[j1:j2])
