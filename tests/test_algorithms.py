"""Tests for seqcal.algorithms: bit-exact parity with compressed-tensors, and GPTQ behaviour."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle import forward as ct
from compressed_tensors.quantization.utils.helpers import calculate_qparams, compute_dynamic_scales_and_zp

from seqcal.algorithms import (
    UPPER_BLOCK,
    GPTQNumericalError,
    accumulate_hessian,
    compute_qparams,
    dequantize,
    fake_quantize,
    fake_quantize_per_token,
    gptq_quantize,
    observe_minmax,
    observe_mse,
    pack_int32,
    quantize,
    relative_output_error,
    symmetrize_upper,
    unpack_int32,
    weight_qparams,
)

GS = 32


def _weight(dtype: torch.dtype = torch.float32, out: int = 16, inp: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, inp, generator=g) * torch.rand(out, 1, generator=g)  # rows of different ranges
    W[0, :GS] = 0  # an all-zero group exercises the zero-scale (eps) path
    W[1] = W[1].abs()  # a one-signed row exercises the "0 must be representable" widening
    return W.to(dtype)


def _ct_args(num_bits: int, symmetric: bool, strategy: str, type: str = "int") -> QuantizationArgs:
    return QuantizationArgs(
        num_bits=num_bits,
        symmetric=symmetric,
        strategy=strategy,
        group_size=GS if strategy == "group" else None,
        type=type,
    )


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b), (a - b).abs().max()


# ---------------------------------------------------------------- parity with compressed-tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", ["tensor", "channel", "group"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("num_bits", [4, 8])
def test_int_qparams_and_quantization_match_compressed_tensors(num_bits, symmetric, strategy, dtype):
    W = _weight(dtype)
    args = _ct_args(num_bits, symmetric, strategy)
    gs = GS if strategy == "group" else None
    w_min, w_max = observe_minmax(W, strategy=strategy, group_size=gs)
    scale, zp = compute_qparams(w_min, w_max, num_bits=num_bits, symmetric=symmetric)
    ct_scale, ct_zp = calculate_qparams(w_min, w_max, args)
    _assert_same(scale, ct_scale)
    _assert_same(zp, ct_zp)
    expected = {"tensor": (1,), "channel": (16, 1), "group": (16, 128 // GS)}[strategy]
    assert tuple(scale.shape) == expected and scale.dtype == dtype and zp.dtype == torch.int8
    q = quantize(W, scale, zp, num_bits=num_bits, group_size=gs)
    _assert_same(q, ct.quantize(W, ct_scale, ct_zp, args, dtype=torch.int8))
    assert q.min() >= -(2 ** (num_bits - 1)) and q.max() <= 2 ** (num_bits - 1) - 1
    _assert_same(dequantize(q, scale, zp, group_size=gs), ct.dequantize(q, ct_scale, ct_zp, args))
    _assert_same(
        fake_quantize(W, scale, zp, num_bits=num_bits, group_size=gs), ct.fake_quantize(W, scale, zp, args)
    )
    s0, z0 = (scale[:1, :1], zp[:1, :1]) if scale.ndim == 2 else (scale, zp)  # qparams of the zero group
    assert torch.equal(fake_quantize(W[:1, :GS], s0, z0, num_bits=num_bits), W[:1, :GS])


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_fp8_weights_match_compressed_tensors(strategy):
    W = _weight(torch.bfloat16) * 1000  # beyond fp8's +-448 before scaling
    args = _ct_args(8, True, strategy, type="float")
    scale, zp = weight_qparams(W, num_bits=8, symmetric=True, strategy=strategy, type="float")
    ct_scale, ct_zp = calculate_qparams(*observe_minmax(W, strategy=strategy), args)
    _assert_same(scale, ct_scale)
    _assert_same(zp, ct_zp)
    q = quantize(W, scale, zp, num_bits=8, type="float")
    _assert_same(q, ct.quantize(W, scale, zp, args, dtype=torch.float8_e4m3fn))
    _assert_same(fake_quantize(W, scale, zp, num_bits=8, type="float"), ct.fake_quantize(W, scale, zp, args))
    assert (dequantize(q, scale, zp) - W).abs().max() <= 0.07 * W.abs().max()  # 3 mantissa bits


@pytest.mark.parametrize("type", ["int", "float"])
def test_per_token_activation_fake_quant_matches_compressed_tensors(type):
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16) * torch.rand(2, 7, 1, dtype=torch.bfloat16) * 10
    args = QuantizationArgs(num_bits=8, type=type, symmetric=True, strategy="token", dynamic=True)
    ct_scale, ct_zp = compute_dynamic_scales_and_zp(x, args, module=torch.nn.Identity())
    expected = ct.fake_quantize(x, ct_scale, ct_zp, args)
    _assert_same(fake_quantize_per_token(x, num_bits=8, type=type), expected)
    assert not torch.equal(expected, x)  # the test would be vacuous if quantization were a no-op


def test_g_idx_matches_contiguous_groups_on_permuted_columns():
    W = _weight()
    perm = torch.randperm(W.shape[1], generator=torch.Generator().manual_seed(1))
    scale, zp = weight_qparams(W[:, perm], num_bits=4, symmetric=False, strategy="group", group_size=GS)
    g_idx = (torch.arange(W.shape[1]) // GS)[torch.argsort(perm)]  # original column -> its group
    q = quantize(W, scale, zp, num_bits=4, g_idx=g_idx)
    q_perm = quantize(W[:, perm], scale, zp, num_bits=4, group_size=GS)
    assert torch.equal(q[:, perm], q_perm)
    Q = fake_quantize(W, scale, zp, num_bits=4, g_idx=g_idx)
    assert torch.equal(Q, dequantize(q, scale, zp, g_idx=g_idx))
    identity = torch.arange(W.shape[1]) // GS
    assert torch.equal(
        quantize(W, scale, zp, num_bits=4, g_idx=identity), quantize(W, scale, zp, num_bits=4, group_size=GS)
    )


def test_quantization_errors_name_the_fix():
    W = _weight()
    scale, zp = weight_qparams(W, num_bits=4, symmetric=True, strategy="group", group_size=GS)
    with pytest.raises(ValueError, match="pass group_size"):
        quantize(W, scale, zp, num_bits=4)
    with pytest.raises(ValueError, match="not divisible by group_size 48"):
        weight_qparams(W, num_bits=4, symmetric=True, strategy="group", group_size=48)
    with pytest.raises(ValueError, match="valid: minmax, static_minmax"):
        weight_qparams(W, num_bits=4, symmetric=True, strategy="channel", observer="percentile")
    with pytest.raises(ValueError, match="must be symmetric"):
        weight_qparams(W, num_bits=8, symmetric=False, strategy="channel", type="float")


@pytest.mark.parametrize("strategy", ["channel", "group"])
def test_mse_observer_shrinks_range_and_lowers_error(strategy):
    W = torch.randn(32, 128, generator=torch.Generator().manual_seed(2))
    gs = GS if strategy == "group" else None
    kw = dict(num_bits=4, symmetric=True, strategy=strategy, group_size=gs)
    lo, hi = observe_mse(W, **kw)
    lo0, hi0 = observe_minmax(W, strategy=strategy, group_size=gs)
    assert lo.shape == lo0.shape and (hi <= hi0).all() and (hi >= 0.8 * hi0 - 1e-6).all() and (hi < hi0).any()

    def err(observer):
        s, z = weight_qparams(W, observer=observer, **kw)
        return ((fake_quantize(W, s, z, num_bits=4, group_size=gs) - W) ** 2).sum()

    assert err("mse") < 0.95 * err("minmax")


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("num_bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("cols", [8, 20, 32, 100])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_matches_compressed_tensors_and_round_trips(num_bits, cols, dim):
    g = torch.Generator().manual_seed(num_bits * cols)
    q = torch.randint(-(2 ** (num_bits - 1)), 2 ** (num_bits - 1), (64, cols), generator=g).to(torch.int8)
    packed = pack_int32(q, num_bits, dim=dim)
    _assert_same(packed, pack_to_int32(q, num_bits, packed_dim=dim))
    _assert_same(unpack_int32(packed, num_bits, q.shape, dim=dim), q)
    _assert_same(unpack_from_int32(packed, num_bits, q.shape, packed_dim=dim), q)


def test_int4_layout_is_eight_nibbles_per_word_low_first():
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7]], dtype=torch.int8)
    u = [v + 8 for v in q[0].tolist()]
    word = sum(v << (4 * j) for j, v in enumerate(u))
    assert pack_int32(q, 4).item() == word - (1 << 32)  # top nibble 15 sets the int32 sign bit
    q3 = torch.randint(-8, 8, (3, 6, 64), dtype=torch.int8)  # stacked (MoE-style) weights
    _assert_same(pack_int32(q3, 4), pack_to_int32(q3, 4))
    with pytest.raises(ValueError, match="int8 codes"):
        pack_int32(q.to(torch.int32), 4)


# ---------------------------------------------------------------- Hessian


def test_accumulate_hessian_is_a_running_token_average():
    X = torch.randn(3, 10, 16, dtype=torch.bfloat16)
    H, n = None, 0
    for batch in (X[:1], X[1:], X[:0]):
        H, n = accumulate_hessian(H, batch, n)
    Xf = X.float().reshape(-1, 16)
    assert n == 30 and H.dtype == torch.float32
    torch.testing.assert_close(H, 2 * Xf.T @ Xf / 30)
    with pytest.raises(ValueError, match="must be float32 \\[8, 8\\]"):
        accumulate_hessian(H, torch.randn(4, 8), n)


@pytest.mark.parametrize("product_dtype", [torch.float32, torch.bfloat16])
def test_upper_only_hessian_equals_the_full_one_once_symmetrized(product_dtype: torch.dtype):
    d = 2 * UPPER_BLOCK + 100  # three block rows, the last one short
    X = torch.randn(3, 50, d).to(torch.bfloat16)
    full, upper, n, m = None, None, 0, 0
    for batch in X:
        full, n = accumulate_hessian(full, batch, n, product_dtype)
        upper, m = accumulate_hessian(upper, batch, m, product_dtype, upper=True)
    assert not torch.allclose(upper, full)  # below the diagonal blocks: stale until symmetrized
    symmetrize_upper(upper)
    assert n == m and torch.equal(upper, upper.T)
    torch.testing.assert_close(upper, full, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- GPTQ


def _correlated_inputs(n: int = 1024, d: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g) / d**0.5
    X = torch.randn(n, d, generator=g) @ mix + 0.1 * torch.randn(n, d, generator=g)
    return X * (3 * torch.rand(d, generator=g))  # uneven feature scales make actorder matter


def _out_err(X: torch.Tensor, W: torch.Tensor, Q: torch.Tensor) -> float:
    return ((X @ (W.float() - Q.float()).T) ** 2).sum().item() / X.shape[0]


GPTQ_CONFIGS = [
    dict(num_bits=4, symmetric=True, strategy="channel", group_size=None),
    dict(num_bits=4, symmetric=True, strategy="group", group_size=GS),
    dict(num_bits=4, symmetric=False, strategy="group", group_size=GS),
    dict(num_bits=4, symmetric=True, strategy="group", group_size=GS, actorder="static"),
    dict(num_bits=4, symmetric=False, strategy="group", group_size=GS, actorder="group"),
    dict(num_bits=4, symmetric=True, strategy="channel", group_size=None, actorder="weight"),
    dict(num_bits=4, symmetric=True, strategy="tensor", group_size=None),
    dict(num_bits=8, symmetric=True, strategy="channel", group_size=None),
    dict(num_bits=8, symmetric=True, strategy="channel", group_size=None, type="float"),
    dict(num_bits=4, symmetric=True, strategy="group", group_size=GS, observer="mse", block_size=48),
]


@pytest.mark.parametrize("cfg", GPTQ_CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_gptq_beats_rtn_and_stays_on_the_grid(cfg):
    X = _correlated_inputs()
    W = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    H, _ = accumulate_hessian(None, X, 0)
    H_before = H.clone()
    r = gptq_quantize(W, H, **cfg)
    assert torch.equal(H, H_before)
    qkw = {k: cfg[k] for k in ("num_bits", "symmetric", "strategy", "group_size")}
    qkw.update(type=cfg.get("type", "int"), observer=cfg.get("observer", "minmax"))
    gs = cfg["group_size"]
    rtn_scale, rtn_zp = weight_qparams(W, **qkw)
    Q_rtn = fake_quantize(W, rtn_scale, rtn_zp, num_bits=cfg["num_bits"], type=qkw["type"], group_size=gs)
    if cfg.get("actorder") != "group" and qkw["observer"] == "minmax":  # original groups' qparams
        torch.testing.assert_close(r.scale, rtn_scale, rtol=0.01, atol=0)
    assert _out_err(X, W, r.Q) < 0.8 * _out_err(X, W, Q_rtn)
    assert r.Q.dtype == W.dtype and r.scale.dtype == W.dtype and r.retries == 0 and r.dampening_frac == 0.01
    # the returned codes dequantize to exactly Q, with and without an explicit g_idx
    _assert_same(dequantize(r.q, r.scale, r.zero_point, group_size=gs, g_idx=r.g_idx), r.Q)  # g_idx wins
    assert (r.g_idx is not None) == (cfg.get("actorder") == "group")


def test_gptq_codes_are_recovered_by_compressed_tensors_quantize():
    X, W = _correlated_inputs(), torch.randn(64, 128).to(torch.bfloat16)
    H, _ = accumulate_hessian(None, X, 0)
    r = gptq_quantize(W, H, num_bits=4, symmetric=False, group_size=GS, actorder="static")
    args = _ct_args(4, False, "group")
    _assert_same(ct.quantize(r.Q, r.scale, r.zero_point, args, dtype=torch.int8), r.q)


def test_gptq_group_actorder_g_idx_maps_columns_to_full_groups():
    X = _correlated_inputs()
    H, _ = accumulate_hessian(None, X, 0)
    r = gptq_quantize(torch.randn(64, 128), H, group_size=GS, actorder="group")
    assert r.g_idx.dtype == torch.int32 and r.g_idx.shape == (128,)
    assert torch.equal(torch.bincount(r.g_idx.long()), torch.full((128 // GS,), GS))
    assert not torch.equal(r.g_idx.long(), torch.arange(128) // GS)  # otherwise the test shows nothing
    most_active = torch.argsort(H.diagonal(), descending=True)[:GS]
    assert (r.g_idx[most_active] == 0).all()


def test_gptq_with_isotropic_hessian_is_rtn():
    W = _weight(out=32)
    for actorder in (None, "static", "group"):
        r = gptq_quantize(W, 3 * torch.eye(128), group_size=GS, symmetric=False, actorder=actorder)
        s, z = weight_qparams(W, num_bits=4, symmetric=False, strategy="group", group_size=GS)
        assert torch.equal(r.Q, fake_quantize(W, s, z, num_bits=4, group_size=GS))


def test_gptq_column_loop_alone_runs_on_one_intra_op_thread(monkeypatch):
    """The loop of tiny ops on one thread; the inverse factor's LAPACK calls with the caller's threads."""
    import seqcal.algorithms.gptq as gptq_module

    seen = {}
    real_loop, real_cholesky = gptq_module.quantize_columns, torch.linalg.cholesky_ex

    def loop(*args, **kwargs):
        seen["loop"] = torch.get_num_threads()
        return real_loop(*args, **kwargs)

    def cholesky(*args, **kwargs):
        seen["cholesky"] = torch.get_num_threads()
        return real_cholesky(*args, **kwargs)

    monkeypatch.setattr(gptq_module, "quantize_columns", loop)
    monkeypatch.setattr(torch.linalg, "cholesky_ex", cholesky)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        X = torch.randn(512, 64)
        gptq_quantize(_weight(out=16)[:, :64], 2 * X.T @ X / 512, group_size=32)
        assert seen == {"loop": 1, "cholesky": 2}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _reference_gptq(W, H, scale, zero, damp):
    """Textbook OBS updates on the explicit inverse (no Cholesky, no blocks), float64."""
    W, H = W.double().clone(), H.double().clone()
    H.diagonal().add_(damp * H.diagonal().mean())
    Hinv = torch.linalg.inv(H)
    Q = torch.zeros_like(W)
    for i in range(W.shape[1]):
        Q[:, i] = fake_quantize(W[:, i : i + 1], scale.double(), zero, num_bits=4)[:, 0]
        err = (W[:, i] - Q[:, i]) / Hinv[i, i]
        W[:, i:] -= err[:, None] * Hinv[i, i:][None, :]
        Hinv -= Hinv[:, i : i + 1] @ Hinv[i : i + 1, :] / Hinv[i, i]
    return Q


@pytest.mark.parametrize("block_size", [128, 16, 7])
def test_gptq_matches_textbook_obs_updates(block_size):
    X = _correlated_inputs(n=512, d=48)
    W = torch.randn(24, 48, generator=torch.Generator().manual_seed(4))
    H, _ = accumulate_hessian(None, X, 0)
    r = gptq_quantize(W, H, strategy="channel", group_size=None, block_size=block_size)
    Q_ref = _reference_gptq(W, H, r.scale, r.zero_point, 0.01)
    torch.testing.assert_close(r.Q.double(), Q_ref, atol=1e-5, rtol=0)


def test_gptq_loss_is_the_mean_token_output_error():
    X = _correlated_inputs()
    W = torch.randn(64, 128)
    H, _ = accumulate_hessian(None, X, 0)
    r = gptq_quantize(W, H, strategy="channel", group_size=None, dampening_frac=1e-6)
    assert r.loss == pytest.approx(_out_err(X, W, r.Q), rel=0.02)


def test_gptq_dead_columns_are_zeroed_and_finite():
    X = _correlated_inputs()
    dead = torch.tensor([0, 5, 77, 127])
    X[:, dead] = 0
    W = torch.randn(64, 128) * 5
    H, _ = accumulate_hessian(None, X, 0)
    assert (H.diagonal()[dead] == 0).all()
    r = gptq_quantize(W, H, group_size=GS, actorder="static")
    assert torch.isfinite(r.Q).all() and (r.Q[:, dead] == 0).all() and r.retries == 0
    s, z = weight_qparams(W, num_bits=4, symmetric=True, strategy="group", group_size=GS)
    assert _out_err(X, W, r.Q) < _out_err(X, W, fake_quantize(W, s, z, num_bits=4, group_size=GS))
    # without dampening only the H_ii = 1 fix keeps the Cholesky alive
    r0 = gptq_quantize(W, H, group_size=GS, dampening_frac=0.0, max_retries=0)
    assert torch.isfinite(r0.Q).all() and (r0.Q[:, dead] == 0).all()


def _indefinite_hessian(d: int = 64, neg: float = -0.03) -> torch.Tensor:
    """Symmetric H whose smallest eigenvalue is ``neg * mean(diag(H))``: 1% dampening is not enough."""
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(5)))
    eig = torch.linspace(1.0, 2.0, d)
    eig[0] = neg * eig.mean() / (1 - neg / d)  # solves eig0 = neg * mean(eig) including eig0 itself
    return (basis * eig) @ basis.T


def test_gptq_retries_with_more_dampening_when_cholesky_fails():
    H, W = _indefinite_hessian(), torch.randn(16, 64)
    assert torch.linalg.eigvalsh(H).min() < -0.01 * H.diagonal().mean()
    r = gptq_quantize(W, H, strategy="channel", group_size=None, dampening_frac=0.01)
    assert r.retries == 1 and r.dampening_frac == pytest.approx(0.1)
    assert torch.isfinite(r.Q).all()


@pytest.mark.parametrize(
    "make_H", [_indefinite_hessian, lambda: -torch.eye(64), lambda: torch.full((64, 64), float("nan"))]
)
def test_gptq_raises_numerical_error_for_fallback(make_H):
    with pytest.raises(GPTQNumericalError, match="RTN"):
        gptq_quantize(torch.randn(16, 64), make_H(), strategy="channel", group_size=None, max_retries=0)


def test_gptq_rejects_bad_arguments_with_valid_choices():
    W, H = torch.randn(8, 64), torch.eye(64)
    with pytest.raises(ValueError, match="valid: None, \\['dynamic', 'group', 'static', 'weight'\\]"):
        gptq_quantize(W, H, group_size=GS, actorder="random")
    with pytest.raises(ValueError, match="H must be \\[64, 64\\]"):
        gptq_quantize(W, torch.eye(32), group_size=GS)
    with pytest.raises(ValueError, match="dividing in_features 64"):
        gptq_quantize(W, H, group_size=48)
    with pytest.raises(ValueError, match="W must be 2-D"):
        gptq_quantize(W[None], H, group_size=GS)


def test_column_loop_graph_cache_keeps_its_budget_and_skips_failed_shapes(monkeypatch):
    """The CUDA-graph cache (policy only; the graphs themselves are tested in test_cuda.py): one entry per block
    shape, reused; least recently used out first when a new shape would exceed the byte budget; a shape larger
    than the budget, or one whose capture failed, runs eagerly (None)."""
    import seqcal.backend.cuda_graphs as cuda_graphs
    from seqcal.algorithms.columns import column_block

    class Fake:  # stands in for BlockGraph: no device buffers on a CPU machine
        def __init__(self, rows, cols, qcols, device, qrange, symmetric, loop):
            self.nbytes, self.failed = cuda_graphs._graph_bytes(rows, cols, qcols, symmetric), None
            self.freed = False

        def reset(self):
            self.freed = True

    monkeypatch.setattr(cuda_graphs, "BlockGraph", Fake)
    monkeypatch.setattr(cuda_graphs, "_GRAPHS", type(cuda_graphs._GRAPHS)())
    dev, q = torch.device("cuda", 0), (-8, 7, "int")
    size = cuda_graphs._graph_bytes(128, 1000, 1000, True)
    monkeypatch.setattr(cuda_graphs, "GRAPH_CACHE_BYTES", 2 * size + size // 2)  # room for two of these
    a = cuda_graphs.block_graph(128, 1000, 1000, dev, q, True, column_block)
    assert cuda_graphs.block_graph(128, 1000, 1000, dev, q, True, column_block) is a  # reused
    b = cuda_graphs.block_graph(128, 1001, 1001, dev, q, True, column_block)
    cuda_graphs.block_graph(128, 1000, 1000, dev, q, True, column_block)  # a is now the most recently used
    c = cuda_graphs.block_graph(128, 1002, 1002, dev, q, True, column_block)  # evicts b, not a
    assert b.freed and not a.freed and list(cuda_graphs._GRAPHS.values()) == [a, c]
    assert (
        cuda_graphs.block_graph(128, 1000, 1000, dev, q, False, column_block) is not a
    )  # symmetry is part of the shape
    assert (
        cuda_graphs.block_graph(128, 4000, 4000, dev, q, True, column_block) is None
    )  # alone over the budget: eager
    c.failed = "RuntimeError: capture failed"
    assert cuda_graphs.block_graph(128, 1002, 1002, dev, q, True, column_block) is None
    cuda_graphs.clear_graphs()
    assert not cuda_graphs._GRAPHS and a.freed


def test_docstring_examples_run():
    import doctest

    from seqcal.algorithms import (
        gptq,
        hessian,
        in_place,
        kept_hessian,
        observe,
        output_error,
        packing,
        quant,
        range_search,
    )

    for module in (
        quant,
        observe,
        range_search,
        packing,
        gptq,
        hessian,
        kept_hessian,
        output_error,
        in_place,
    ):
        result = doctest.testmod(
            module, extraglobs={"torch": torch}, optionflags=doctest.NORMALIZE_WHITESPACE
        )
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_relative_output_error_from_the_hessian_equals_the_forward_error() -> None:
    g = torch.Generator().manual_seed(5)
    X = torch.randn(3, 40, 24, generator=g)  # [batch, tokens, in]
    W = torch.randn(16, 24, generator=g)
    Q = W + 0.05 * torch.randn(16, 24, generator=g)
    H, n = None, 0
    for x in X:  # accumulated batch by batch, as in calibration
        H, n = accumulate_hessian(H, x, n)
    rows = X.reshape(-1, 24)
    want = ((rows @ (Q - W).T).norm() / (rows @ W.T).norm()).item()
    assert relative_output_error(W, Q, H) == pytest.approx(want, rel=1e-4)
    assert relative_output_error(W, W, H) == 0.0


def test_quadratic_forms_from_the_upper_blocks_equal_the_dense_product() -> None:
    """Over several column blocks (the last one ragged): the upper blocks give every row's ``a^T H a``."""
    from seqcal.algorithms.hessian import UPPER_BLOCK
    from seqcal.algorithms.output_error import quadratic_forms

    g = torch.Generator().manual_seed(6)
    d = 2 * UPPER_BLOCK + 44
    X = torch.randn(512, d, generator=g) * torch.randn(d, generator=g).exp()  # uneven columns, as activations
    H, _ = accumulate_hessian(None, X, 0)
    A = torch.randn(37, d, generator=g)
    want = ((A.double() @ H.double()) * A.double()).sum(dim=1)
    torch.testing.assert_close(quadratic_forms(A, H).double(), want, rtol=1e-5, atol=0)
    W, Q = A[:20], A[:20] + 0.05 * A[20:].repeat(2, 1)[:20]
    rows = X.double()
    direct = ((rows @ (Q - W).double().T).norm() / (rows @ W.double().T).norm()).item()
    assert relative_output_error(W, Q, H, rows=8) == pytest.approx(direct, rel=1e-5)
