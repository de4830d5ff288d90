"""float32 products on oneDNN (algorithms/products.py): same values as torch's kernel up to float32 rounding,
taken only where they apply, and used by the passes and the Hessians."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import seqcal.backend.onednn as kernels
from seqcal.algorithms import products
from seqcal.algorithms.hessian import UPPER_BLOCK, accumulate_hessian, add_products

# Skipped only on a torch built without oneDNN; a oneDNN build without the operator fails here and in
# tests/test_backend.py (the operator is private: a torch upgrade may drop it).
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.fixture
def onednn(monkeypatch: pytest.MonkeyPatch):
    """oneDNN on, whatever this machine's CPU (the `auto` choice depends on it)."""
    monkeypatch.setenv("SEQCAL_CPU_MATMUL", "onednn")
    kernels.use_onednn.cache_clear()
    yield
    kernels.use_onednn.cache_clear()


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def _count_onednn(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Record the shapes of every call of the oneDNN operator (the real one still runs)."""
    calls: list[tuple] = []
    real = kernels._linear_pointwise

    def counted(x, w, *rest):
        calls.append((tuple(x.shape), tuple(w.shape)))
        return real(x, w, *rest)

    monkeypatch.setattr(kernels, "_linear_pointwise", counted)
    return calls


@pytest.mark.parametrize("case", ["2d", "3d", "transposed input", "sliced input", "bias"])
def test_linear_matches_float64(onednn, monkeypatch, case):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 96, 64, generator=g), torch.randn(48, 64, generator=g), None
    if case == "2d":
        x = x[0]
    elif case == "transposed input":
        x = torch.randn(2, 64, 96, generator=g).transpose(1, 2)
    elif case == "sliced input":
        x = torch.randn(2, 96, 128, generator=g)[..., 32:96]
    elif case == "bias":
        b = torch.randn(48, generator=g)
    calls = _count_onednn(monkeypatch)
    y = kernels.linear(x, w, b)
    assert calls, "oneDNN was not used"
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    native = F.linear(x, w, b)
    assert y.shape == native.shape and y.dtype == torch.float32
    # float32 accumulation (a reduced-precision kernel, bf16 or tf32, would be off by 1e-3)
    assert _relative(y, ref) < 2e-6 and _relative(native, ref) < 2e-6


def test_linear_keeps_torch_kernel_where_onednn_does_not_apply(onednn, monkeypatch):
    calls = _count_onednn(monkeypatch)
    w = torch.randn(16, 8)
    few = torch.randn(kernels.MIN_ROWS - 1, 8)  # a routed expert's few tokens
    assert torch.equal(kernels.linear(few, w), F.linear(few, w))
    half = torch.randn(64, 8, dtype=torch.bfloat16)
    assert torch.equal(kernels.linear(half, w.bfloat16()), F.linear(half, w.bfloat16()))
    x = torch.randn(64, 8, requires_grad=True)  # gradients: the oneDNN operator has no backward
    y = kernels.linear(x, w)
    y.sum().backward()
    assert torch.allclose(x.grad, w.sum(0).expand(64, 8))
    stand_in = torch.zeros(1, 1).expand(16, 8)  # a view: no copy of it is made (the memory plan's stand-ins)
    assert torch.equal(kernels.linear(torch.randn(64, 8), stand_in), torch.zeros(64, 16))
    x, transposed = torch.randn(64, 8), torch.randn(8, 16).T
    assert torch.equal(kernels.linear(x, transposed), F.linear(x, transposed))
    assert calls == []
    kernels.linear(torch.randn(kernels.MIN_ROWS, 8), w)
    assert calls == [((kernels.MIN_ROWS, 8), (16, 8))]


def test_mode_routes_linear_modules_only_inside(onednn, monkeypatch):
    calls = _count_onednn(monkeypatch)
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(64, 8)
    with torch.no_grad():
        outside = layer(x)
        assert calls == []
        with kernels.linears_on_onednn("cpu"):
            with kernels.linears_on_onednn("cpu"):  # nested: one mode on the stack
                inside = layer(x)
            torch.nn.functional.relu(x)  # other functions run as they are
        assert len(calls) == 1
        with kernels.linears_on_onednn("cuda"):  # another execution device: nothing changes
            layer(x)
        assert len(calls) == 1
    assert torch.allclose(inside, outside, atol=1e-6)


def test_native_choice_and_bad_value(monkeypatch):
    monkeypatch.setenv("SEQCAL_CPU_MATMUL", "native")
    kernels.use_onednn.cache_clear()
    try:
        assert not kernels.use_onednn()
        assert not kernels.onednn_applies(torch.randn(64, 8), torch.randn(4, 8))
        monkeypatch.setenv("SEQCAL_CPU_MATMUL", "fast")
        kernels.use_onednn.cache_clear()
        with pytest.raises(ValueError, match="SEQCAL_CPU_MATMUL must be one of auto, onednn, native"):
            kernels.use_onednn()
    finally:
        kernels.use_onednn.cache_clear()


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hessian_on_onednn_matches_float64(onednn, monkeypatch, upper, dtype):
    """Three block rows (the last one short); X in float32 or bf16 (cast to float32 first)."""
    g = torch.Generator().manual_seed(1)
    d = 2 * UPPER_BLOCK + 40
    X1, X2 = torch.randn(3, 40, d, generator=g).to(dtype), torch.randn(70, d, generator=g).to(dtype)
    calls = _count_onednn(monkeypatch)
    H, n = accumulate_hessian(None, X1, 0, upper=upper)
    H, n = accumulate_hessian(H, X2, n, upper=upper)
    assert n == 190 and len(calls) == 6  # two batches x three block rows
    X = torch.cat([X1.reshape(-1, d), X2]).double()
    ref = 2 * X.T @ X / n
    keep = torch.ones(d, d, dtype=torch.bool)
    if upper:  # only the block rows' parts on and right of the diagonal are kept up to date
        keep = torch.zeros(d, d, dtype=torch.bool)
        for i0 in range(0, d, UPPER_BLOCK):
            keep[i0 : i0 + UPPER_BLOCK, i0:] = True
    assert ((H.double() - ref)[keep].norm() / ref[keep].norm()).item() < 2e-6


def test_add_products_on_onednn(onednn, monkeypatch):
    X = torch.randn(64, UPPER_BLOCK + 5)
    calls = _count_onednn(monkeypatch)
    H = add_products(torch.ones(X.shape[1], X.shape[1]), X, upper=False)
    assert len(calls) == 2
    ref = 1 + X.double().T @ X.double()
    assert _relative(H, ref) < 2e-6


def _attention_reference(q, k, v, mask=None, is_causal=False, scale=None):
    """Attention in float64 from its definition (rows that attend nothing give 0, as torch's kernels)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    L, S = s.shape[-2:]
    if is_causal:
        mask = torch.ones(L, S, dtype=torch.bool).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


@pytest.mark.parametrize(
    "case", ["causal gqa", "causal more keys", "causal more queries", "bool mask", "float mask", "no mask"]
)
def test_attention_matches_float64_and_torch(onednn, monkeypatch, case):
    """Every mask form transformers passes, batch > 1, a query count not a multiple of the chunk, GQA."""
    g = torch.Generator().manual_seed(0)
    B, H, Hk, L, S, D = 2, 6, 2, kernels.CAUSAL_CHUNK + 37, kernels.CAUSAL_CHUNK + 37, 16
    S = {"causal more keys": S + 20, "causal more queries": S - 40}.get(case, S)
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((H, L), (Hk, S), (Hk, S)))
    kw: dict = {"enable_gqa": True, "scale": 0.3 if case == "no mask" else None}
    mask = None
    if case.startswith("causal"):
        kw["is_causal"] = True
    elif case == "bool mask":  # left padding of the second sample: its first 5 query rows attend nothing
        mask = torch.ones(B, 1, L, S, dtype=torch.bool).tril()
        mask[1, :, :, :5] = False
    elif case == "float mask":  # transformers' additive form, one -inf row
        mask = torch.zeros(L, S).masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), torch.finfo().min)
        mask[3] = float("-inf")
    calls = _count_onednn(monkeypatch)
    out = kernels.attention(q, k, v, mask, **kw)
    assert out is not None and calls, "oneDNN was not used"
    ref = _attention_reference(q, k, v, mask, kw.get("is_causal", False), kw["scale"])
    assert (out.double() - ref).abs().max() < 1e-5
    torch_out = F.scaled_dot_product_attention(q, k, v, mask, **kw)
    assert torch.isfinite(out).all() and (out - torch_out).abs().max() < 1e-5
    if case == "causal gqa":  # each chunk of queries meets only the keys it may attend
        chunks = [(a, min(a + kernels.CAUSAL_CHUNK, L)) for a in range(0, L, kernels.CAUSAL_CHUNK)]
        pairs = sum((e - a) * e for a, e in chunks)  # (query, key) pairs computed: 22489 of 27225
        assert sum(x[0] * x[1] * w[0] for x, w in calls) == 2 * B * H * pairs * D


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masking", ["causal", "float mask"])
def test_attention_of_half_types_in_float32(onednn, monkeypatch, dtype, masking):
    """bfloat16 / float16 inputs: float32 products, the output in the inputs' dtype, rounded once (no further
    from float64 than torch's own kernel on the same inputs, within the output's rounding)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 160, 32, generator=g).to(dtype) for h in (6, 2, 2))
    kw: dict = {"enable_gqa": True}
    mask = None
    if masking == "causal":
        kw["is_causal"] = True
    else:  # transformers' additive mask in the model's dtype (a large negative value, not -inf)
        mask = (
            torch.zeros(160, 160).masked_fill(torch.ones(160, 160, dtype=torch.bool).triu(1), -1e4).to(dtype)
        )
    dtypes: list[tuple] = []  # operand dtypes of each oneDNN product
    real = kernels._linear_pointwise
    monkeypatch.setattr(
        kernels, "_linear_pointwise", lambda x, w, b: dtypes.append((x.dtype, w.dtype)) or real(x, w, b)
    )
    out = kernels.attention(q, k, v, mask, **kw)
    assert out is not None and out.dtype == dtype, "oneDNN was not used"
    assert dtypes and set(dtypes) == {(torch.float32, torch.float32)}
    ref = _attention_reference(q, k, v, mask, kw.get("is_causal", False))
    ours = (out.double() - ref).norm() / ref.norm()
    torch_out = F.scaled_dot_product_attention(q, k, v, mask, **kw)
    theirs = (torch_out.double() - ref).norm() / ref.norm()
    assert ours <= theirs * 1.05 + 1e-4 and ours < 4e-3


def test_attention_falls_back_where_it_does_not_apply(onednn, monkeypatch):
    q = torch.randn(1, 2, 64, 8)
    calls = _count_onednn(monkeypatch)
    assert kernels.attention(q, q, q, dropout_p=0.1) is None
    assert kernels.attention(q, q, q, torch.ones(64, 64, dtype=torch.bool), is_causal=True) is None
    assert kernels.attention(q.bfloat16(), q, q) is None  # mixed dtypes
    assert kernels.attention(q.double(), q.double(), q.double()) is None
    assert kernels.attention(q[:, :, :8], q[:, :, :8], q[:, :, :8]) is None  # fewer than MIN_ROWS queries
    assert kernels.attention(q, q[:, :1], q[:, :1]) is None  # heads differ without enable_gqa
    assert kernels.attention(q, q, q, torch.ones(3, 64, 64, dtype=torch.bool)) is None  # does not broadcast
    assert kernels.attention(q, q, q, torch.zeros(64, 64, dtype=torch.int64)) is None
    grad = q.clone().requires_grad_()
    assert kernels.attention(grad, q, q) is None
    with torch.no_grad():
        assert kernels.attention(grad, q, q) is not None
    assert len(calls) == 2 * 2  # only the no_grad call: two heads, one chunk, a product each way
    with kernels.linears_on_onednn("cpu"):  # inside the mode a refused call runs torch's own kernel
        y = F.scaled_dot_product_attention(q, q, q, dropout_p=0.0, is_causal=True)
        z = F.scaled_dot_product_attention(q.double(), q.double(), q.double())
    assert y.shape == q.shape and z.dtype == torch.float64
    assert len(calls) == 2 * 2 + 2 * 2  # the float32 call inside the mode took oneDNN
    real = F.scaled_dot_product_attention

    def newer_torch(*args, future_option=None, **kwargs):  # an argument attention() does not know
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", newer_torch)  # what the mode compares against
    y = kernels._OneDNNLinears().__torch_function__(newer_torch, (), (q, q, q), {"future_option": 1})
    assert y.shape == q.shape and len(calls) == 8  # torch's kernel ran it


def test_oneshot_runs_its_passes_and_hessians_on_onednn(onednn, monkeypatch):
    """A GPTQ run with oneDNN on: the passes' Linears and the Hessians take it (none of the solves' products),
    and the quantized model matches the run on torch's own kernels up to float32 rounding."""
    from seqcal.entrypoint import oneshot
    from seqcal.modifiers import GPTQModifier
    from test_oneshot import tiny_llama, token_data

    data = token_data(4, 48)  # 48 tokens per batch: over MIN_ROWS
    calls = _count_onednn(monkeypatch)
    fast = tiny_llama()
    oneshot(model=fast, dataset=data, recipe=GPTQModifier(scheme="W8A16", ignore=["lm_head"]))
    linears = {(x[-1], w[0]) for x, w in calls if x[:-1] == (1, 48)}  # [batch, tokens, in] x [out, in]
    # rows of X^T, [block, tokens] x [in, tokens]
    hessians = {(x, w) for x, w in calls if len(x) == 2 and x[1] == 48 and x[0] == 128}
    attention = {(x, w) for x, w in calls if len(x) == 2 and x[0] == 2 * 48}  # 2 query heads per k/v head
    assert linears == {(128, 64), (128, 128), (128, 256), (256, 128)}  # k/v, q/o, gate/up, down
    assert hessians == {((128, 48), (128, 48)), ((128, 48), (256, 48))}  # the 128 and 256 wide inputs
    assert attention == {((96, 32), (48, 32)), ((96, 48), (32, 48))}  # Q K^T and P V, head dim 32
    monkeypatch.setenv("SEQCAL_CPU_MATMUL", "native")
    kernels.use_onednn.cache_clear()
    calls.clear()
    native = tiny_llama()
    oneshot(model=native, dataset=data, recipe=GPTQModifier(scheme="W8A16", ignore=["lm_head"]))
    assert calls == []
    for (name, a), b in zip(fast.named_parameters(), native.parameters()):
        # int8 codes may round the other way where float32 rounding moved a value across a half step
        assert (a - b).abs().max() <= 2 * (b.abs().max() / 127), name
        assert (a != b).float().mean() < 0.02, name


def test_subgraph_list_run_stays_on_torch_kernels(onednn, monkeypatch):
    """The public SubgraphList.run() returns what the model's own forward returns, bit for bit: only calibration
    runs (and the pipeline's partition check, on both sides) take oneDNN."""
    from seqcal.execution.subgraphs import trace_subgraphs
    from test_oneshot import tiny_llama

    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 40))
    subgraphs = trace_subgraphs(model, {"input_ids": ids})
    calls = _count_onednn(monkeypatch)
    with torch.no_grad():
        got, want = subgraphs.run(input_ids=ids), model(input_ids=ids)
    assert calls == [] and torch.equal(got.logits, want.logits)


def _gptq_like_hessian(n: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """``2 X^T X / tokens`` of correlated inputs with a few dead-ish channels, dampened by 1% as GPTQ does."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(tokens, n // 4, generator=g) @ torch.randn(n // 4, n, generator=g)  # rank n/4 ...
    X += 0.05 * torch.randn(tokens, n, generator=g)  # ... plus a little of every direction
    X[:, :3] *= 1e-3
    H = 2 * X.T @ X / tokens
    H.diagonal().add_(0.01 * H.diagonal().mean())
    return H


@pytest.mark.parametrize("n", [products.FACTOR_LEAF + 17, 2 * products.FACTOR_LEAF + 250])
def test_inverse_cholesky_factor_matches_float64_as_lapack_does(onednn, n):
    """The blocked factor on oneDNN: L^-1 within float32 rounding of float64's, no worse than LAPACK's two
    calls by more than a small factor, and the inverse Hessian it gives is the same."""
    H = _gptq_like_hessian(n, 2 * n)
    want = torch.linalg.inv(torch.linalg.cholesky(H.double()))
    got = products.inverse_cholesky_factor_(H.clone())
    L, info = torch.linalg.cholesky_ex(H)
    assert info.item() == 0
    lapack = torch.linalg.solve_triangular(L, torch.eye(n), upper=False)
    err, err_lapack = _relative(got, want), _relative(lapack, want)
    assert err < max(4 * err_lapack, 1e-6), (err, err_lapack)
    assert torch.equal(got.triu(1), torch.zeros(n, n))  # lower triangular, exactly
    Hinv = torch.linalg.inv(H.double())
    assert _relative(got.T @ got, Hinv) < max(4 * _relative(lapack.T @ lapack, Hinv), 1e-6)


def test_inverse_cholesky_factor_refuses_what_is_not_positive_definite(onednn):
    n = products.FACTOR_LEAF + 40
    H = _gptq_like_hessian(n, 2 * n)
    for where in (5, n - 5):  # in the first leaf, and in the last Schur complement
        bad = H.clone()
        bad[where, where] = -1.0
        assert products.inverse_cholesky_factor_(bad) is None


def test_gptq_inverse_factor_on_onednn_matches_lapack(onednn, monkeypatch):
    """A GPTQ solve wider than FACTOR_LEAF takes the blocked factor; its codes equal LAPACK's run but where float32
    rounding moves a value across a half step (and what that moves in the later columns)."""
    from seqcal.algorithms import gptq_quantize

    n = products.FACTOR_LEAF + 64
    H = _gptq_like_hessian(n, 4 * n, seed=1)
    W = torch.randn(48, n, generator=torch.Generator().manual_seed(2))
    calls = []
    real = products.inverse_cholesky_factor_
    monkeypatch.setattr(products, "inverse_cholesky_factor_", lambda A: calls.append(A.shape) or real(A))
    fast = gptq_quantize(W, H, num_bits=8, group_size=64, actorder="static")
    assert calls[0] == (n, n)  # then its recursive calls
    taken = len(calls)
    monkeypatch.setenv("SEQCAL_CPU_MATMUL", "native")
    kernels.use_onednn.cache_clear()
    native = gptq_quantize(W, H, num_bits=8, group_size=64, actorder="static")
    assert len(calls) == taken
    # a code rounded the other way moves the errors spread to later columns: as the oneshot test above, within
    # two int8 steps and under 2% of the codes
    assert (fast.q.int() - native.q.int()).abs().max() <= 2
    assert (fast.q != native.q).float().mean() < 0.02
    assert fast.loss == pytest.approx(native.loss, rel=5e-3)


def _allocation_peak(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """``fn()``'s result, the peak of the bytes it held allocated, and what it left allocated: torch's CPU
    allocations of each op (frees are negative), summed in the order the ops started."""
    with torch.profiler.profile(
        profile_memory=True, activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        result = fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return result, peak, live


def _is_damped_inverse_factor(Hinv: torch.Tensor, H: torch.Tensor) -> bool:
    """``Hinv^T Hinv = (H + damp I)^-1`` with GPTQ's dampening of 1% of the mean diagonal."""
    damped = H.double() + 0.01 * H.diagonal().mean().item() * torch.eye(H.shape[0], dtype=torch.float64)
    return _relative(Hinv.T @ Hinv, torch.linalg.inv(damped)) < 1e-4


def _factor_in_place(H: torch.Tensor, perm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's inverse factor computed in a copy of ``H`` (the copy's memory, and the factor)."""
    import seqcal.algorithms.gptq as gptq_module
    from seqcal.algorithms.kept_hessian import KeptHessian

    A = H.clone()
    dead = torch.zeros(H.shape[0], dtype=torch.bool)
    Hinv, _, _ = gptq_module._inverse_hessian_factor(A, KeptHessian(A), perm, dead, 0.01, 0, 10.0)
    return A, Hinv


def _reference_factor(H: torch.Tensor, perm: torch.Tensor | None, blocked: bool) -> torch.Tensor:
    """The factor as GPTQ computed it from a permuted copy of ``H`` beside it: the same operations on the same
    values, so the in-place factor must equal it bit for bit."""
    Hp = H[perm[:, None], perm] if perm is not None else H.clone()
    Hr = Hp.flip(0).flip(1).contiguous()
    Hr.diagonal().add_(0.01 * Hp.diagonal().mean().item())
    if blocked:
        return products.inverse_cholesky_factor_(Hr).flip(0).flip(1).contiguous()
    Lr = torch.linalg.cholesky(Hr)
    inv = torch.linalg.solve_triangular(Lr, torch.eye(H.shape[0]).t(), upper=False)
    return inv.flip(0).flip(1).contiguous()


@pytest.mark.parametrize("order", [None, "static"])
def test_gptq_blocked_factor_is_computed_in_the_hessians_memory(onednn, order):
    """The blocked inverse factor is computed in the Hessian's own memory, permuted there for act-order, and
    reversed in place: no [in, in] copy (127 MB for a 5632-wide down_proj) beside it; the values are those of
    the copy it was computed in before, bit for bit."""
    n = products.FACTOR_LEAF + 64
    H = _gptq_like_hessian(n, 2 * n)
    perm = torch.argsort(H.diagonal(), descending=True, stable=True) if order else None
    A, Hinv = _factor_in_place(H, perm)
    assert Hinv.data_ptr() == A.data_ptr()
    assert torch.equal(Hinv, _reference_factor(H, perm, blocked=True))
    Hp = H if perm is None else H[perm[:, None], perm]
    assert _is_damped_inverse_factor(Hinv, Hp)


@pytest.mark.parametrize("order", [None, "static"])
def test_lapack_factor_in_the_hessians_memory_keeps_one_matrix_beside_it(monkeypatch, order):
    """On LAPACK's (and cuSOLVER's) path the triangular solve writes into the Hessian's spent memory and the
    result is made row-major there, by an in-place transpose: besides H and its kept upper triangle, one [n, n]
    matrix (the Cholesky factor) at most; before, a dampened copy and the factor (8192-wide down_proj on a GPU:
    268 MB each). The values are those of the copy, bit for bit. Counted from torch's CPU allocations."""
    import seqcal.algorithms.gptq as gptq_module
    from seqcal.algorithms.kept_hessian import KeptHessian

    monkeypatch.setenv("SEQCAL_CPU_MATMUL", "native")
    kernels.use_onednn.cache_clear()
    n = 512
    H = _gptq_like_hessian(n, 2 * n)
    H = H.triu() + H.triu(1).T  # exactly symmetric, as the modifiers make it: the kept part is half of it
    perm = torch.argsort(H.diagonal(), descending=True, stable=True) if order else None
    A, dead = H.clone(), torch.zeros(n, dtype=torch.bool)
    kept = KeptHessian(A)
    (Hinv, _, _), peak, _ = _allocation_peak(
        lambda: gptq_module._inverse_hessian_factor(A, kept, perm, dead, 0.01, 0, 10.0)
    )
    kernels.use_onednn.cache_clear()
    assert Hinv.data_ptr() == A.data_ptr()
    assert peak / (n * n * 4) < 1.2, peak / (n * n * 4)
    assert torch.equal(Hinv, _reference_factor(H, perm, blocked=False))


def test_blocked_factor_keeps_at_most_three_quarter_blocks_alive(onednn):
    """Besides ``A``, the factor's temporaries peak at 3.25 quarter blocks at this size (three at the top level,
    the LAPACK leaves' factor and identity a quarter more), as its docstring says; the order before kept five.
    Counted from torch's CPU allocations (each op's own, in order; frees are negative)."""
    n = 2 * products.FACTOR_LEAF + 128
    A = _gptq_like_hessian(n, 2 * n)
    _, peak, live = _allocation_peak(lambda: products.inverse_cholesky_factor_(A))
    quarters = peak / ((n // 2) ** 2 * 4)
    assert 2 < quarters <= 3.26 and live == 0, quarters
