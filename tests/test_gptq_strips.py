"""GPTQ's weight-sized float32 copies built and un-permuted a strip of rows at a time (``gptq_rows.STRIP_FLOATS``):
the same bits as whole-matrix copies, and no second weight-sized copy beside the first; a host budget's solve a chunk
of rows at a time (``gptq_rows.solve_row_chunks``): the same codes without a weight-sized float32 copy; the save's
packing and its check of the weight by chunks of rows too."""

from __future__ import annotations

import pytest
import torch

import seqcal.algorithms.gptq as gptq_module
import seqcal.algorithms.gptq_rows as gptq_rows
from seqcal.algorithms import gptq_quantize
from test_factor_scratch import _hessian
from test_products import _allocation_peak

CASES = [  # (actorder, quantization arguments)
    (None, {"group_size": 16}),
    ("static", {"group_size": 16}),
    ("group", {"group_size": 16}),
    ("static", {"strategy": "channel", "group_size": None}),
    ("static", {"group_size": 16, "observer": "mse"}),
]


@pytest.mark.parametrize("actorder, kwargs", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strips_give_the_bits_of_one_strip(monkeypatch, actorder, kwargs, dtype):
    """Strips of 1 or 3 rows (a last strip shorter) against one strip for the whole weight: Q, the codes, the
    qparams, g_idx and the loss equal, with a dead input (zeroed in every strip)."""
    W = torch.randn(11, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    H = _hessian(64)
    H[7], H[:, 7] = 0, 0  # an input never seen
    results = []
    for floats in (1 << 30, 64, 3 * 64):
        monkeypatch.setattr(gptq_rows, "STRIP_FLOATS", floats)
        results.append(gptq_quantize(W, H.clone(), actorder=actorder, **kwargs))
    for other in results[1:]:
        for field in ("Q", "q", "scale", "zero_point", "g_idx"):
            a, b = getattr(results[0], field), getattr(other, field)
            assert (a is None and b is None) or (torch.equal(a, b) and a.dtype == b.dtype), field
        assert other.loss == results[0].loss
    assert not results[0].Q[:, 7].any() or actorder is None  # the dead column's weight was zeroed first


@pytest.mark.parametrize("actorder", [None, "static", "group"])
def test_one_float32_copy_of_the_weight_at_a_time(monkeypatch, actorder):
    """The qparams' float32 copy is gone before W^T is made, and Q is un-permuted from QT with the codes in their
    own memory: 4 bytes per weight, then 2 (Q in bfloat16), plus a strip; whole-matrix copies took 8 and 5."""
    monkeypatch.setattr(gptq_rows, "STRIP_FLOATS", 4096)  # strips of 8 rows of 512 inputs
    out, n = 512, 512
    W = torch.randn(out, n, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    dead, perm = (
        torch.zeros(n, dtype=torch.bool),
        torch.randperm(n, generator=torch.Generator().manual_seed(5)),
    )
    qkw = dict(num_bits=4, symmetric=True, strategy="group", group_size=64, type="int", observer="minmax",
               observer_kwargs=None, importance=None)  # fmt: skip
    (WT, *_), peak, _ = _allocation_peak(
        lambda: gptq_rows._weight_and_qparams(W, dead, perm, actorder, 64, qkw)
    )
    weight, strip = out * n, 4096 * 4 * 3  # a strip in float32: its copy, its permuted copy, its transpose
    qparams = 10 * out * (n // 64) * 4  # the observer's [out, groups] float32 temporaries
    assert WT.shape == (n, out) and 4 * weight <= peak <= 4 * weight + max(strip, qparams), peak / weight
    codes = torch.randint(-8, 8, (out, n), dtype=torch.int8)
    expected = (WT.T.to(torch.bfloat16)[:, torch.argsort(perm)], codes[:, torch.argsort(perm)])
    inv = torch.argsort(perm)
    (Q, permuted), peak, _ = _allocation_peak(
        lambda: (
            gptq_rows._original_order(WT, inv, torch.bfloat16),
            gptq_rows._codes_in_order(codes, inv),
        )
    )
    assert torch.equal(Q, expected[0]) and torch.equal(permuted, expected[1]) and permuted is codes
    assert 2 * weight <= peak <= 2 * weight + strip, peak / weight


@pytest.mark.parametrize("actorder", [None, "static", "group"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overwrite_writes_q_into_the_weight_with_the_same_error(monkeypatch, actorder, dtype):
    """``overwrite=True``: Q is W's own memory, with the bits of the returned Q of the default, and the relative
    output error is exactly the one taken afterwards from the two matrices (the same chunks: 16, 16 and 8 rows)."""
    import seqcal.algorithms.output_error as output_error
    from seqcal.algorithms.output_error import relative_output_error

    monkeypatch.setattr(output_error, "ERROR_CHUNK_FLOATS", 16 * 96)
    assert output_error.error_rows(96) == 16
    W = torch.randn(40, 96, generator=torch.Generator().manual_seed(6)).to(dtype)
    H = _hessian(96)
    default = gptq_quantize(W, H.clone(), actorder=actorder, group_size=32)
    expected = relative_output_error(W, default.Q, H)
    target = W.clone()
    result = gptq_quantize(target, H.clone(), actorder=actorder, group_size=32, overwrite=True)
    assert result.Q is target and torch.equal(target, default.Q) and torch.equal(result.q, default.q)
    assert result.rel_error == expected and default.rel_error is None and expected > 0


ROW_CASES = [  # (actorder, quantization arguments, whether the rows go in chunks)
    (None, {"group_size": 32}, True),
    ("static", {"group_size": 32, "symmetric": False}, True),
    ("group", {"group_size": 32}, True),
    ("static", {"strategy": "channel", "group_size": None}, True),
    (None, {"strategy": "channel", "group_size": None, "num_bits": 8, "type": "float"}, True),  # fp8 codes
    ("static", {"group_size": 32, "observer": "mse"}, False),  # its search stops on all rows at once
    ("static", {"strategy": "tensor", "group_size": None}, False),  # one scale over every row
]


@pytest.mark.parametrize("actorder, kwargs, chunked", ROW_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pruned", [False, True])
def test_rows_solved_a_chunk_at_a_time_give_the_same_codes(
    monkeypatch, actorder, kwargs, chunked, dtype, pruned
):
    """``row_chunks=True`` (chunks of 16 rows of 96 inputs, the last one shorter, a dead input, a sparsity mask)
    against the whole solve: the same codes, qparams, g_idx, Q written over W and output error; the objective per
    row within float32 rounding. Where the qparams span rows, the solve is the whole one."""
    monkeypatch.setattr(gptq_rows, "ROW_CHUNK_FLOATS", 16 * 96)
    calls = []
    real = gptq_rows.solve_row_chunks
    monkeypatch.setattr(gptq_module, "solve_row_chunks", lambda *a: calls.append(1) or real(*a))
    W = torch.randn(40, 96, generator=torch.Generator().manual_seed(8)).to(dtype)
    mask = torch.rand(40, 96, generator=torch.Generator().manual_seed(9)) < 0.3 if pruned else None
    if mask is not None:
        W[mask] = 0
    H = _hessian(96)
    H[5], H[:, 5] = 0, 0  # an input never seen
    results = [
        gptq_quantize(W.clone(), H.clone(), actorder=actorder, pruned=mask, overwrite=True, row_chunks=chunks,
                      **kwargs)
        for chunks in (False, True)
    ]  # fmt: skip
    whole, rows = results
    assert len(calls) == (1 if chunked else 0)
    for field in ("Q", "q", "scale", "zero_point", "g_idx"):
        a, b = getattr(whole, field), getattr(rows, field)
        assert (a is None and b is None) or (torch.equal(a, b) and a.dtype == b.dtype), field
    assert rows.rel_error == whole.rel_error > 0
    # summed in another order per chunk: a few float32 roundings apart over the 96 columns (oneDNN on AMD CPUs)
    assert torch.allclose(rows.row_loss, whole.row_loss, rtol=1e-4, atol=0)


def test_rows_solved_a_chunk_at_a_time_hold_no_weight_sized_float_copy(monkeypatch):
    """The row-chunked solve of a bfloat16 [4096, 128] weight holds its codes (1 byte a weight) and one chunk's float32
    copies (64 rows, a few at once: 2 bytes a weight at most) beside the Hessian; the whole solve holds W^T in float32 (4 bytes a weight) besides. The output
    error goes by 16 rows, so that its temporaries are small beside the weight."""
    import seqcal.algorithms.output_error as output_error

    monkeypatch.setattr(gptq_rows, "ROW_CHUNK_FLOATS", 64 * 128)
    monkeypatch.setattr(output_error, "ERROR_CHUNK_FLOATS", 16 * 128)
    out, n = 4096, 128
    W = torch.randn(out, n, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    H = _hessian(n)
    peaks = {}
    for chunks in (False, True):
        kwargs = dict(
            group_size=64, actorder="static", overwrite=True, in_place_factor=True, row_chunks=chunks
        )
        _, peaks[chunks], _ = _allocation_peak(lambda kw=kwargs: gptq_quantize(W.clone(), H.clone(), **kw))
    clones = out * n * 2 + n * n * 4  # the arguments' copies, made inside the profile
    weight = out * n
    assert peaks[True] - clones < 2 * weight and peaks[False] - clones > 5 * weight, (peaks, weight)


@pytest.mark.parametrize("num_bits", [2, 3, 4, 8])
def test_codes_packed_a_chunk_of_rows_at_a_time(monkeypatch, num_bits):
    """``pack_int32`` widens a few rows at a time (``PACK_CODES``): the same words as one chunk, and no int32 copy
    of all the codes (12 bytes a code at once before: 192 MiB at a 8192-wide down_proj)."""
    import seqcal.algorithms.packing as packing

    q = torch.randint(-(1 << (num_bits - 1)), 1 << (num_bits - 1), (64, 1000), dtype=torch.int8)
    whole = packing.pack_int32(q, num_bits)
    monkeypatch.setattr(packing, "PACK_CODES", 3 * 1000)  # chunks of 3 rows, the last one shorter
    (chunked, peak, _) = _allocation_peak(lambda: packing.pack_int32(q, num_bits))
    assert torch.equal(chunked, whole) and torch.equal(packing.unpack_int32(whole, num_bits, q.shape), q)
    assert peak <= chunked.nbytes + 12 * 3 * 1024 + (64 << 10), peak  # the result and one chunk's temporaries


@pytest.mark.parametrize("symmetric", [True, False])
def test_the_save_compares_the_weight_a_chunk_of_rows_at_a_time(monkeypatch, symmetric):
    """The save's check that the weight in memory is what the codes dequantize to goes by chunks of rows
    (``CHECK_VALUES``), each with its own rows of the scale and zero point, and still sees a change in the last
    chunk."""
    from compressed_tensors.quantization import preset_name_to_scheme

    import seqcal.checkpoint.tensors as tensors
    from seqcal.algorithms.quant import dequantize
    from seqcal.records import QuantizedWeight

    scheme = preset_name_to_scheme("W4A16" if symmetric else "W4A16_ASYM", ["Linear"])
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-8, 8, (10, 256), dtype=torch.int8, generator=g)
    scale = torch.rand(10, 2, generator=g).to(torch.bfloat16) + 0.1
    zp = None if symmetric else torch.randint(-2, 2, (10, 2), dtype=torch.int8, generator=g)
    weight = dequantize(q, scale, zp, group_size=128, dtype=torch.bfloat16)
    qw = QuantizedWeight(q=q, scale=scale, zero_point=zp, g_idx=None, scheme=scheme)
    monkeypatch.setattr(tensors, "CHECK_VALUES", 3 * 256)  # chunks of 3 rows
    tensors._check_fake_quantized("m", weight, qw)
    weight[9, 255] += 1.0
    with pytest.raises(ValueError, match="differs from the dequantized codes"):
        tensors._check_fake_quantized("m", weight, qw)
