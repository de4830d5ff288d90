"""GPTQ's Cholesky factor in the Hessian's own memory (``gptq_factor.cholesky_in_place_``): LAPACK's values up to
float32 rounding, valid codes, a few blocks of temporaries instead of a second [in, in] matrix, and the host budget
that takes it only when neither cut fits without it."""

from __future__ import annotations

import pytest
import torch

from seqcal.algorithms import gptq_factor, products
from seqcal.algorithms.gptq import gptq_quantize
from seqcal.algorithms.gptq_factor import (
    FACTOR_BLOCK,
    IN_PLACE_FROM,
    GPTQNumericalError,
    cholesky_in_place_,
    factor_bytes,
    factors_in_place,
    lower_inverse_in_place_,
    processing_factor,
)
from seqcal.algorithms.hessian import symmetrize_upper
from seqcal.algorithms.kept_hessian import KeptHessian, kept_in_ram
from seqcal.backend import onednn_applies
from seqcal.plan import PROCESS_BASELINE, MemoryPlan, SubgraphPlan
from seqcal.plan.host import HostBudgetError, fit_host
from test_host_budget import room


def _hessian(n: int, seed: int = 0) -> torch.Tensor:
    """An exactly symmetric float32 Hessian with a spread spectrum (some inputs 10x larger), as GPTQ's are."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n + 200, n, generator=g)
    X[:, : n // 4] *= 10
    return symmetrize_upper(2 * X.T @ X / X.shape[0])


@pytest.mark.parametrize(("n", "block"), [(300, 128), (256, 64), (5, 8)])
def test_the_in_place_factor_and_inverse_equal_float64s(n: int, block: int) -> None:
    H = _hessian(n)
    H.diagonal().add_(0.01 * H.diagonal().mean())
    L64 = torch.linalg.cholesky(H.double())
    A = H.clone()
    L = cholesky_in_place_(A, block)
    assert L is not None and L.data_ptr() == A.data_ptr()
    assert torch.equal(L, L.tril())  # the upper triangle is zeroed
    assert (L.double() - L64).abs().max() <= 1e-5 * L64.abs().max()
    X = lower_inverse_in_place_(L, block)
    X64 = torch.linalg.inv(L64)
    assert X.data_ptr() == A.data_ptr() and torch.equal(X, X.tril())
    assert (X.double() - X64).abs().max() <= 1e-5 * X64.abs().max()


def test_a_matrix_that_is_not_positive_definite_has_no_factor() -> None:
    H = _hessian(200)
    H[150, 150] = -1.0  # a negative diagonal: no Cholesky, in the third block
    assert cholesky_in_place_(H.clone(), 64) is None


def test_the_processing_factor_in_place_equals_lapacks_and_restores_the_hessian() -> None:
    n = FACTOR_BLOCK + 188  # two blocks, the second ragged
    H = _hessian(n)
    before = H.clone()
    with processing_factor(H.clone(), torch.device("cpu"), "weight", 0.01, 3, 10.0) as f:
        lapack = f.Hinv.clone()
    with processing_factor(H, torch.device("cpu"), "weight", 0.01, 3, 10.0, in_place=True) as f:
        assert f.Hinv.data_ptr() == H.data_ptr() and f.retries == 0
        assert not torch.equal(f.Hinv, lapack)  # another algorithm: not the same bits
        assert (f.Hinv - lapack).abs().max() <= 1e-5 * lapack.abs().max()
    assert torch.equal(H, before)  # the Hessian's values back, bit for bit


def test_an_indefinite_hessian_is_dampened_until_the_in_place_factor_works() -> None:
    n = FACTOR_BLOCK + 64
    H = _hessian(n)
    H.diagonal()[-10:] -= 1.5 * H.diagonal()[-10:].min()  # slightly indefinite: the first dampening fails
    with processing_factor(H, torch.device("cpu"), None, 0.01, 3, 10.0, in_place=True) as f:
        assert f.retries > 0 and bool((f.Hinv.diagonal() > 0).all())
    with pytest.raises(GPTQNumericalError, match="Cholesky of the Hessian failed"):
        bad = _hessian(n)
        bad.diagonal()[-1] = -1e9
        with processing_factor(bad, torch.device("cpu"), None, 0.01, 1, 10.0, in_place=True):
            pass


def test_gptq_with_the_in_place_factor_gives_valid_codes_close_to_lapacks() -> None:
    n = FACTOR_BLOCK + 128
    H = _hessian(n, seed=1)
    W = torch.randn(96, n, generator=torch.Generator().manual_seed(2))
    kw = dict(num_bits=4, group_size=128, actorder="weight")
    ref = gptq_quantize(W, H.clone(), **kw)
    got = gptq_quantize(W, H.clone(), in_place_factor=True, **kw)
    assert got.q.dtype == torch.int8 and int(got.q.min()) >= -8 and int(got.q.max()) <= 7
    scale = got.scale.float().repeat_interleave(128, dim=1)
    assert torch.equal(got.Q, got.q.float() * scale)  # exactly what the checkpoint dequantizes to
    assert (got.q == ref.q).float().mean() > 0.99  # a few roundings may flip, no more
    assert got.loss == pytest.approx(ref.loss, rel=1e-3)


def _allocated_peak(fn) -> int:
    """Peak bytes torch's CPU allocator holds during ``fn()`` beyond what it held before (profiler events)."""
    with torch.profiler.profile(
        profile_memory=True, activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def test_the_in_place_factor_allocates_a_few_blocks_where_lapacks_allocates_a_matrix() -> None:
    n = 4 * FACTOR_BLOCK
    dead = torch.zeros(n, dtype=torch.bool)
    peaks = {}
    for in_place in (False, True):
        H = _hessian(n)
        kept = KeptHessian(H)  # its copy is made before: the factor's own allocations are measured

        def factor(H: torch.Tensor = H, kept: KeptHessian = kept, in_place: bool = in_place) -> None:
            gptq_factor._inverse_hessian_factor(H, kept, None, dead, 0.01, 0, 10.0, in_place)

        peaks[in_place] = _allocated_peak(factor)
    # LAPACK's factor beside the Hessian; on oneDNN (float32 CPU solves wider than FACTOR_LEAF) the blocked factor,
    # three quarters of one matrix (_inverse_hessian_factor)
    blocked = onednn_applies(H, H) and n > products.FACTOR_LEAF
    assert peaks[False] >= (n * n * 4 * 3 // 4 if blocked else n * n * 4)
    assert peaks[True] <= 6 * FACTOR_BLOCK**2 * 4 < n * n * 4 // 2  # a few blocks, counted in factor_bytes
    assert factor_bytes(n, in_place=True) >= peaks[True]


def test_the_plan_counts_a_few_blocks_for_the_in_place_factor() -> None:
    n = 2048
    lapack, in_place = factor_bytes(n), factor_bytes(n, in_place=True)
    assert lapack > n * n * 4 and in_place < 40 << 20
    assert factor_bytes(n, device_on_host=False, in_place=True) == n * n * 4  # on a GPU: cuSOLVER's
    assert factor_bytes(FACTOR_BLOCK, in_place=True) == factor_bytes(FACTOR_BLOCK)  # one block: LAPACK's


def test_wide_cpu_hessians_are_factored_in_place_whatever_the_run_asks() -> None:
    """From IN_PLACE_FROM inputs (a 4096- or 8192-wide down_proj) the cpu factor is in place: no second matrix."""
    assert not factors_in_place(IN_PLACE_FROM - 1, True) and factors_in_place(IN_PLACE_FROM, True)
    assert factor_bytes(8192) == factor_bytes(8192, in_place=True) < 40 << 20
    assert factor_bytes(8192, device_on_host=False) == 8192 * 8192 * 4  # a GPU's cuSOLVER factor
    n = IN_PLACE_FROM
    H = _hessian(n)
    kept = KeptHessian(H)
    dead = torch.zeros(n, dtype=torch.bool)

    def factor() -> None:
        gptq_factor._inverse_hessian_factor(H, kept, None, dead, 0.01, 0, 10.0)  # the run's default

    assert _allocated_peak(factor) <= factor_bytes(n) < n * n * 4 // 2


def _plan(work: int, one_pass: bool, in_place: bool = False) -> MemoryPlan:
    row = SubgraphPlan(0, ["layers.0.mlp.down_proj"], work, 0, 0, 0)
    row.work, row.host = work, PROCESS_BASELINE + work
    return MemoryPlan([row], row.host, 0, one_pass=one_pass, in_place_factor=in_place)


def test_the_budget_takes_the_in_place_factor_only_when_no_cut_fits_without_it() -> None:
    mb = 10**6
    default, layers = _plan(600 * mb, True), _plan(550 * mb, False)
    asked: list[bool] = []

    def in_place(one_pass: bool) -> MemoryPlan:
        asked.append(one_pass)
        return _plan((300 if one_pass else 250) * mb, one_pass, in_place=True)

    # the default plan fits: the in-place plans are not even made
    fit = fit_host(
        room(PROCESS_BASELINE + 600 * mb), default, one_pass=True, other_cut=lambda: layers, in_place=in_place
    )
    assert not fit.plan.in_place_factor and asked == []
    # neither cut fits: the default cut with the in-place factor does, and the run is told so
    fit = fit_host(
        room(PROCESS_BASELINE + 400 * mb), default, one_pass=True, other_cut=lambda: layers, in_place=in_place
    )
    assert fit.plan.in_place_factor and fit.one_pass and asked == [True]
    assert any("Cholesky factors in the Hessians' own memory" in line for line in fit.decisions)
    # only the layer cut with it fits
    asked.clear()
    fit = fit_host(
        room(PROCESS_BASELINE + 280 * mb), default, one_pass=True, other_cut=lambda: layers, in_place=in_place
    )
    assert fit.plan.in_place_factor and not fit.one_pass and asked == [True, False]
    # nothing fits: refused, naming the lowest floor of all four
    with pytest.raises(HostBudgetError, match=f"needs at least {(PROCESS_BASELINE + 250 * mb) / 1e9:.2f} GB"):
        fit_host(
            room(PROCESS_BASELINE + 100 * mb),
            default,
            one_pass=True,
            other_cut=lambda: layers,
            in_place=in_place,
        )


def test_the_budget_writes_each_save_before_the_next_subgraph_only_when_the_in_place_factor_is_not_enough() -> (
    None
):
    mb = 10**6
    default = _plan(600 * mb, True)

    def in_place(one_pass: bool) -> MemoryPlan:
        return _plan(300 * mb, one_pass, in_place=True)

    def synchronous(one_pass: bool) -> MemoryPlan:
        plan = _plan(240 * mb, one_pass, in_place=True)
        plan.background_save = False
        return plan

    kw = dict(one_pass=True, other_cut=None, in_place=in_place, synchronous=synchronous)
    fit = fit_host(room(PROCESS_BASELINE + 300 * mb), default, **kw)
    assert fit.plan.in_place_factor and fit.plan.background_save  # the factor alone is enough
    fit = fit_host(room(PROCESS_BASELINE + 250 * mb), default, **kw)
    assert fit.plan.in_place_factor and not fit.plan.background_save
    assert any("written before the next subgraph starts" in line for line in fit.decisions)
    with pytest.raises(HostBudgetError, match=f"needs at least {(PROCESS_BASELINE + 240 * mb) / 1e9:.2f} GB"):
        fit_host(room(PROCESS_BASELINE + 200 * mb), default, **kw)


def test_a_budget_that_chose_the_synchronous_save_writes_no_file_on_a_worker_thread(
    wide_dir, tmp_path, monkeypatch
) -> None:
    import seqcal.checkpoint.streaming as streaming
    import seqcal.entrypoint as entrypoint
    from dist_helpers import tensor_hashes

    workers = []
    init, fit = streaming.StreamingCheckpoint.__init__, entrypoint.fit_host

    def recording(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        workers.append(self._worker)

    def synchronous(*args, **kwargs):  # as if the budget had needed it
        chosen = fit(*args, **kwargs)
        chosen.plan.background_save = False
        return chosen

    monkeypatch.setattr(streaming.StreamingCheckpoint, "__init__", recording)
    kw = dict(model=str(wide_dir), recipe="GPTQModifier: {scheme: W4A16, ignore: [lm_head]}",
              dataset=[{"input_ids": list(range(1, 17))}] * 2, max_seq_length=16, max_host_memory="20GB")  # fmt: skip
    entrypoint.oneshot(output_dir=str(tmp_path / "background"), **kw)
    monkeypatch.setattr(entrypoint, "fit_host", synchronous)
    entrypoint.oneshot(output_dir=str(tmp_path / "synchronous"), **kw)
    assert workers[0] is not None and workers[1] is None
    assert tensor_hashes(tmp_path / "background") == tensor_hashes(tmp_path / "synchronous")


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=2 * FACTOR_BLOCK, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    path = tmp_path_factory.mktemp("wide-down-proj")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_the_plan_counts_the_shards_hessians_while_calibrating_and_the_in_place_factor(wide_dir) -> None:
    from seqcal.entrypoint import oneshot
    from seqcal.modifiers.solve_chunks import solve_bytes
    from seqcal.plan import GEMM_BUFFERS

    def plan(samples: int) -> MemoryPlan:
        return oneshot(model=str(wide_dir), recipe="GPTQModifier: {scheme: W4A16, ignore: [lm_head]}", dataset=[],
                       dry_run=True, num_calibration_samples=samples, max_seq_length=16, batch_size=1)  # fmt: skip

    one, several = plan(1), plan(4)
    down = several.rows[-1]  # down_proj, calibrated from its cached inputs
    assert down.hessians == (2 * FACTOR_BLOCK) ** 2 * 4
    # several batches: a shard's Hessian beside the fold of those before; one batch: none
    assert down.accumulators == down.hessians + GEMM_BUFFERS and one.rows[-1].accumulators == GEMM_BUFFERS
    assert down.device_peak >= down.weights + 2 * down.hessians
    groups = {("mlp", 2 * FACTOR_BLOCK): [128]}
    assert solve_bytes(groups, 4, 1 << 30)[0] == down.solve
    kept = kept_in_ram(2 * FACTOR_BLOCK)  # the Hessian's values, in RAM at this width
    assert (
        solve_bytes(groups, 4, 1 << 30, in_place=True)[0]
        == factor_bytes(2 * FACTOR_BLOCK, in_place=True) + kept
    )


def test_the_solve_counts_a_stacked_copy_only_for_modules_solved_together() -> None:
    """A module solved alone is its own weight (counted with the subgraph's) and takes Q in its memory; a stack
    is a new matrix, and its Q another."""
    from seqcal.algorithms.output_error import error_rows
    from seqcal.modifiers.solve_chunks import solve_bytes

    n_in, rows, dtype_bytes = 8192, 2048, 2
    alone = solve_bytes({("mlp", n_in): [rows]}, dtype_bytes, 1 << 40)[0]
    stacked = solve_bytes({("mlp", n_in): [rows // 2, rows // 2]}, dtype_bytes, 1 << 40)[0]
    # W^T in fp32 and the int8 codes (the fp32 copies built a strip of rows at a time; no [in, out] matrix of
    # codes): 5 bytes per weight, and the output error's chunk of rows for a module alone; a stack adds its
    # stacked copy and its Q in the weight's dtype
    error = 6 * error_rows(n_in) * n_in * 4
    assert alone == rows * n_in * 5 + error + kept_in_ram(n_in)
    assert stacked == rows * n_in * (5 + 2 * dtype_bytes) + kept_in_ram(n_in)
    assert solve_bytes({("mlp", n_in): [rows]}, 4, 1 << 40)[0] == alone  # the same for a float32 weight


def test_the_lean_solve_counts_one_chunk_of_rows_for_a_module_alone() -> None:
    """With the in-place factor and row chunks, a module solved alone holds its int8 codes and one 16 MiB chunk of
    W^T instead of W^T whole; a stack, and a solve without the in-place factor, are counted as before. GPTQ's
    min-max schemes allow the chunks, an MSE observer and GPTAQ do not (the plan then counts the whole weight)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    from seqcal.algorithms.gptq_rows import ROW_CHUNK_FLOATS, chunk_rows
    from seqcal.algorithms.output_error import error_rows
    from seqcal.modifiers import GPTAQModifier, GPTQModifier
    from seqcal.modifiers.solve_chunks import solve_bytes

    n_in, rows = 8192, 2048
    alone = {("mlp", n_in): [rows]}
    whole = solve_bytes(alone, 2, 1 << 40, in_place=True)[0]
    lean = solve_bytes(alone, 2, 1 << 40, in_place=True, row_chunks=True)[0]
    assert chunk_rows(n_in) * n_in == ROW_CHUNK_FLOATS
    error = 6 * error_rows(n_in) * n_in * 4
    assert lean == max(
        factor_bytes(n_in, in_place=True), rows * n_in + ROW_CHUNK_FLOATS * 4 + error
    ) + kept_in_ram(n_in)
    assert whole - lean == rows * n_in * 4 - ROW_CHUNK_FLOATS * 4  # 48 MiB less at a 8192-wide down_proj
    stacked = {("mlp", n_in): [rows // 2, rows // 2]}
    assert solve_bytes(stacked, 2, 1 << 40, in_place=True, row_chunks=True) == solve_bytes(
        stacked, 2, 1 << 40, True, True
    )
    assert solve_bytes(alone, 2, 1 << 40, row_chunks=True) == solve_bytes(alone, 2, 1 << 40)  # needs in_place
    gptq, mse = GPTQModifier(scheme="W4A16"), GPTQModifier(scheme="W4A16")
    gptq.modules = {"m": preset_name_to_scheme("W4A16", ["Linear"])}
    mse.modules = {"m": preset_name_to_scheme("W4A16", ["Linear"])}
    mse.modules["m"].weights.observer = "mse"
    gptaq = GPTAQModifier(scheme="W4A16")
    gptaq.modules = dict(gptq.modules)
    assert (
        gptq.solves_rows_in_chunks() and not mse.solves_rows_in_chunks() and not gptaq.solves_rows_in_chunks()
    )
