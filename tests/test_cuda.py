"""The CUDA paths: offloaded weights run on the GPU one subgraph at a time and give the CPU's checkpoint.

Skipped without a CUDA device (CI has none); ``benchmarks/gpu/gpu_check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import seqcal.execution.pipeline
from save_helpers import checkpoint_tensors, reload
from seqcal.entrypoint import oneshot
from seqcal.modifiers import GPTQModifier
from test_oneshot import VOCAB, token_data

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _saved_llama(path: Path, layers: int = 4, hidden: int = 128) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def _gptq() -> GPTQModifier:
    return GPTQModifier(scheme="W4A16", ignore=["lm_head"])


def _run(model: object, out: Path | None, **kwargs: object) -> torch.nn.Module:
    return oneshot(model=model, dataset=token_data(8, 32), recipe=_gptq(), output_dir=out, overwrite=True,
                   num_calibration_samples=8, max_seq_length=32, shuffle_calibration_samples=False,
                   **kwargs)  # fmt: skip


def _mean_module_error(out: Path) -> float:
    modules = json.loads((out / "quantization_report.json").read_text())["modules"]
    errors = [m["rel_error"] for m in modules.values() if m.get("rel_error") is not None]
    return sum(errors) / len(errors)


@pytest.mark.parametrize("one_pass", [True, False])
def test_offloaded_run_on_cuda_matches_the_cpu_run(tmp_path: Path, one_pass: bool, monkeypatch) -> None:
    """A model given as a path runs on cuda, one given on cpu runs there: same checkpoint, same quality.

    Not the same codes: a last-bit difference in a Hessian flips an odd rounding decision and GPTQ's error
    feedback carries it along the row (seen on an H200: a few % of the 4-bit codes differ). Quality is what
    must agree: per-module output errors (stable to <1% under such noise) and the model's output error.
    """
    src = _saved_llama(tmp_path / "src")
    torch.cuda.reset_peak_memory_stats()
    _run(str(src), tmp_path / "gpu", one_pass=one_pass)
    assert torch.cuda.max_memory_allocated() > 0  # it did run on the GPU
    reference = LlamaForCausalLM.from_pretrained(src).eval()
    monkeypatch.setattr(
        seqcal.execution.pipeline, "_stage", lambda model, args: False
    )  # a model in RAM stays on cpu
    _run(LlamaForCausalLM.from_pretrained(src).eval(), tmp_path / "cpu", one_pass=one_pass)
    gpu, cpu = checkpoint_tensors(tmp_path / "gpu"), checkpoint_tensors(tmp_path / "cpu")
    assert gpu.keys() == cpu.keys()
    for name, want in cpu.items():
        got = gpu[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if not name.endswith(("weight_packed", "weight_scale")):  # norms, embeddings, lm_head, weight_shape
            torch.testing.assert_close(got, want, msg=name)
    a, b = _mean_module_error(tmp_path / "gpu"), _mean_module_error(tmp_path / "cpu")
    assert abs(a - b) < 0.05 * b, (a, b)
    ids = torch.tensor([row["input_ids"] for row in token_data(2, 24)])
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        err = {
            run: (
                (reload(tmp_path / run, dequantize=True)(input_ids=ids).logits - want).norm() / want.norm()
            ).item()
            for run in ("gpu", "cpu")
        }
    assert err["gpu"] < 1.3 * err["cpu"] and err["cpu"] < 1.3 * err["gpu"], err


def test_cuda_holds_one_subgraph_and_gives_everything_back(tmp_path: Path, monkeypatch) -> None:
    """Peak device memory is a subgraph's weights plus its activations (and GPTQ's column-loop graphs, a fixed
    cost), not the model; nothing stays behind."""
    import seqcal.backend.cuda_graphs as cuda_graphs
    from seqcal.algorithms.gptq import gptq_quantize

    src = _saved_llama(tmp_path / "src", layers=12, hidden=256)
    model_bytes = sum(
        p.numel() * p.element_size() for p in LlamaForCausalLM.from_pretrained(src).parameters()
    )
    # The first matmul of a process (and the first on the column loop's capture stream) allocates cuBLAS's
    # workspace (32 MiB on Hopper) through torch's allocator; it belongs to the process, not to the run, and
    # would count here when this test runs first (pytest -n).
    x = torch.ones(8, 8, device="cuda")
    (x @ x).sum().item()
    gptq_quantize(torch.randn(8, 256, device="cuda"), torch.eye(256, device="cuda"), group_size=128)
    cuda_graphs.clear_graphs()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    held = []
    clear = seqcal.execution.pipeline.clear_graphs
    monkeypatch.setattr(seqcal.execution.pipeline, "clear_graphs", lambda: held.append(clear()) or held[-1])
    model = _run(str(src), tmp_path / "out")
    assert held and held[0] > 0  # the column loop ran as CUDA graphs, freed with the run
    peak = torch.cuda.max_memory_allocated() - before - held[0]
    layer_bytes = model_bytes / 12
    assert layer_bytes / 4 < peak < 0.35 * model_bytes, (
        peak,
        model_bytes,
    )  # ran there, one subgraph at a time
    assert torch.cuda.memory_allocated() - before < 1 << 20  # weights went back; no cached activation left
    assert all(p.device.type in ("meta", "cpu") for p in model.parameters())


def test_profile_synchronizes_and_reads_device_memory(tmp_path: Path) -> None:
    src = _saved_llama(tmp_path / "src")
    trace = tmp_path / "run.trace.json"
    _run(str(src), tmp_path / "out", profile=str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    device = [e["args"] for e in events if e.get("ph") == "C" and "device" in e.get("name", "")]
    assert device and max(v for args in device for v in args.values()) > 0
    spans = [e for e in events if e.get("ph") == "X"]
    for tid in {e["tid"] for e in spans}:
        track = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == tid)
        assert all(a[1] <= b[0] + 1 for a, b in zip(track, track[1:])), tid  # stages never overlap


def test_bf16_autocast_on_cuda(tmp_path: Path) -> None:
    """compute_dtype="bfloat16" (autocast) runs on cuda and quantizes about as well as the fp32 run."""
    src = _saved_llama(tmp_path / "src")
    _run(str(src), tmp_path / "fp32")
    _run(str(src), tmp_path / "bf16", compute_dtype="bfloat16")
    ids = torch.tensor([row["input_ids"] for row in token_data(2, 24)])
    with torch.no_grad():
        want = LlamaForCausalLM.from_pretrained(src).eval()(input_ids=ids).logits
        err = {
            run: (
                (reload(tmp_path / run, dequantize=True)(input_ids=ids).logits - want).norm() / want.norm()
            ).item()
            for run in ("fp32", "bf16")
        }
    assert err["bf16"] < 1.25 * err["fp32"], err


def test_model_in_ram_runs_on_cuda_and_comes_back(tmp_path: Path) -> None:
    """A model object on the cpu is staged through the GPU subgraph by subgraph and returned on the cpu."""
    src = _saved_llama(tmp_path / "src")
    model = LlamaForCausalLM.from_pretrained(src).eval()
    torch.cuda.reset_peak_memory_stats()
    returned = _run(model, tmp_path / "ram")
    assert torch.cuda.max_memory_allocated() > 0 and returned is model
    assert all(p.device.type == "cpu" for p in model.parameters())
    _run(str(src), tmp_path / "dir")
    a, b = _mean_module_error(tmp_path / "ram"), _mean_module_error(tmp_path / "dir")
    assert abs(a - b) < 0.05 * b, (a, b)
    ids = torch.tensor([row["input_ids"] for row in token_data(2, 24)])
    with torch.no_grad():  # the weights in the returned model are the checkpoint's
        want = reload(tmp_path / "ram", dequantize=True)(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_hessian_on_tensor_cores_is_the_float32_one(dtype: torch.dtype) -> None:
    """bf16/fp16 inputs take the tensor-core path (exact products, float32 accumulation), in place in H, and
    give the float64 reference's Hessian up to float32 summation order, over batches of different sizes."""
    from seqcal.algorithms.hessian import _half_tensor_cores, accumulate_hessian

    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randn(n, 512, device="cuda", generator=g).to(dtype) for n in (300, 1000, 77)]
    probe = torch.zeros(512, 512, device="cuda")
    assert _half_tensor_cores(probe, batches[0], 0.0, 1.0), "the torch on this machine lacks addmm out_dtype"
    H, n = accumulate_hessian(None, batches[0], 0)
    first = H
    for X in batches[1:]:
        H, n = accumulate_hessian(H, X, n)
    assert first is H and H.dtype == torch.float32  # updated in place, never reallocated
    X64 = torch.cat(batches).double()
    ref = 2 / n * X64.T @ X64
    assert (H.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    H32, _ = accumulate_hessian(None, torch.cat(batches).float(), 0)  # the float32 CUDA-core path
    assert (H.double() - H32.double()).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("kind", ["symmetric", "asymmetric", "fp8"])
def test_gptq_column_loop_as_cuda_graph_equals_the_eager_loop(kind: str, monkeypatch) -> None:
    """Full blocks replayed as one CUDA graph each give the eager loop's codes, weights and loss bit for bit
    (same kernels on the same values), with a remainder block and group scales crossing blocks."""
    import seqcal.backend.cuda_graphs as cuda_graphs
    from seqcal.algorithms.gptq import gptq_quantize
    from seqcal.algorithms.hessian import accumulate_hessian

    g = torch.Generator(device="cuda").manual_seed(1)
    X = torch.randn(2048, 3 * 128 + 64, device="cuda", generator=g)
    H, _ = accumulate_hessian(None, X, 0)
    W = torch.randn(300, X.shape[1], device="cuda", generator=g)
    kw = {"symmetric": dict(group_size=64), "asymmetric": dict(group_size=64, symmetric=False),
          "fp8": dict(num_bits=8, type="float", strategy="channel", group_size=None)}[kind]  # fmt: skip
    results = {}
    for graphs in (False, True, "again"):  # the graphed path: captured, then replayed from the cache
        monkeypatch.setattr(cuda_graphs, "CUDA_GRAPHS", bool(graphs))
        results[graphs] = gptq_quantize(W, H, block_size=128, **kw)
    eager = results[False]
    for graphed in (results[True], results["again"]):
        assert torch.equal(eager.q.float(), graphed.q.float()) and torch.equal(eager.Q, graphed.Q)
        assert eager.loss == graphed.loss and torch.equal(eager.scale, graphed.scale)
    assert all(g.graph is not None and g.failed is None for g in cuda_graphs._GRAPHS.values())


def test_column_loop_graphs_are_captured_once_per_shape_and_freed(monkeypatch) -> None:
    """Solves of one shape capture one graph and replay it; a graph captured while another thread runs CUDA work
    gives the eager result; the cache keeps to its byte budget and frees its buffers when cleared."""
    import threading

    import seqcal.backend.cuda_graphs as cuda_graphs
    from seqcal.algorithms.gptq import gptq_quantize
    from seqcal.algorithms.hessian import accumulate_hessian

    cuda_graphs.clear_graphs()
    captures = []
    real = torch.cuda.CUDAGraph.capture_begin
    monkeypatch.setattr(
        torch.cuda.CUDAGraph,
        "capture_begin",
        lambda self, *a, **k: (captures.append(1), real(self, *a, **k))[1],
    )
    g = torch.Generator(device="cuda").manual_seed(2)
    X = torch.randn(1024, 512, device="cuda", generator=g)
    H, _ = accumulate_hessian(None, X, 0)
    Ws = [torch.randn(256, 512, device="cuda", generator=g) for _ in range(3)]
    monkeypatch.setattr(cuda_graphs, "CUDA_GRAPHS", False)
    eager = [gptq_quantize(W, H, group_size=128) for W in Ws]
    monkeypatch.setattr(cuda_graphs, "CUDA_GRAPHS", True)
    stop, errors = threading.Event(), []

    # another thread's CUDA work (allocations, products, copies) during the capture; not random numbers: a
    # capture claims the device's default generator, and drawing from it elsewhere meanwhile raises
    def busy() -> None:
        try:
            while not stop.is_set():
                (torch.ones(256, 256, device="cuda") @ torch.full((256, 256), 0.5, device="cuda")).cpu()
        except RuntimeError as exc:
            errors.append(exc)

    worker = threading.Thread(target=busy)
    worker.start()
    try:
        graphed = [gptq_quantize(W, H, group_size=128) for W in Ws]
    finally:
        stop.set()
        worker.join()
    assert not errors
    assert len(captures) == 1 and len(cuda_graphs._GRAPHS) == 1  # one shape: one capture for three solves
    assert all(g.graph is not None and g.failed is None for g in cuda_graphs._GRAPHS.values())
    for a, b in zip(eager, graphed):
        assert torch.equal(a.q, b.q) and torch.equal(a.Q, b.Q) and a.loss == b.loss
    one = next(iter(cuda_graphs._GRAPHS.values())).nbytes
    monkeypatch.setattr(cuda_graphs, "GRAPH_CACHE_BYTES", one + one // 2)  # room for one graph of this size
    gptq_quantize(Ws[0][:192], H, group_size=128)  # a second shape evicts the first
    assert len(cuda_graphs._GRAPHS) == 1 and len(captures) == 2
    cached = sum(g.nbytes for g in cuda_graphs._GRAPHS.values())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cuda_graphs.clear_graphs()
    torch.cuda.synchronize()
    assert before - torch.cuda.memory_allocated() >= cached  # the graphs' buffers are freed


def test_cache_copies_beside_the_compute_keep_the_values_put() -> None:
    """Puts copy to the host on a side stream and fetches of the next batch are copied ahead: what comes back is
    what was put, while the compute stream is busy and the device memory the values came from is reused at once;
    a prefetched value dropped unread, or left unread, costs nothing afterwards."""
    from seqcal.execution.cache import ActivationCache

    g = torch.Generator().manual_seed(0)
    want = [torch.randn(512, 1024, generator=g) for _ in range(6)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with ActivationCache(offload="cpu", device="cuda", overlap=True) as cache:
        assert cache._transfers is not None
        for b, w in enumerate(want):
            torch.cuda._sleep(2_000_000)  # the compute stream runs behind the host
            x = w.to("cuda") * 1.0  # made on the compute stream, after the sleep
            cache.put(b, "h", x)
            del x
            torch.full((512, 1024), -1.0, device="cuda")  # x's memory, were the copy not holding it
        for b in range(len(want)):
            got = cache.fetch(b, "h")
            if b + 1 < len(want):
                cache.prefetch(b + 1, ["h"])
            torch.cuda._sleep(2_000_000)
            torch.full((512 * 1024,), -2.0, device="cuda")  # allocations while the copies in run
            assert torch.equal(got.cpu(), want[b]), b
            del got
        cache.prefetch(0, ["h"])  # prefetched, then dropped unread
        cache.drop(0, "h")
        cache.prefetch(1, ["h"])  # prefetched, never fetched
        cache.settle()
        assert not cache._prefetched
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 << 20


def test_cache_copies_out_keep_at_most_one_earlier_batch_on_the_device() -> None:
    """While batch b is put, the copies of batch b - 1 must be done: the overlap holds one batch's outputs more
    on the device, not every batch's (puts far faster than the copies)."""
    from seqcal.execution.cache import ActivationCache

    nbytes = 64 << 20
    with ActivationCache(offload="cpu", device="cuda", overlap=True) as cache:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for b in range(8):
            cache.put(b, "h", torch.full((nbytes,), b, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base <= 2 * nbytes + (1 << 20)
        assert all(torch.equal(cache.fetch(b, "h")[-4:].cpu(), torch.full((4,), b, dtype=torch.uint8))
                   for b in range(8))  # fmt: skip


def test_overlapped_cache_copies_give_the_same_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """A GPTQ run with the cache's copies beside the compute writes the checkpoint of one with them on the compute
    stream, tensor for tensor and bit for bit (the same kernels in the same order on the compute stream)."""
    import seqcal.execution.cache.store as store

    src = _saved_llama(tmp_path / "src")
    monkeypatch.setattr(store, "OVERLAP", False)
    _run(str(src), tmp_path / "plain", batch_size=2)
    monkeypatch.setattr(store, "OVERLAP", True)
    _run(str(src), tmp_path / "overlap", batch_size=2)
    plain, overlap = checkpoint_tensors(tmp_path / "plain"), checkpoint_tensors(tmp_path / "overlap")
    assert plain.keys() == overlap.keys()
    assert [k for k in plain if not torch.equal(plain[k], overlap[k])] == []


def test_device_tier_cache_keeps_values_on_the_gpu_and_gives_the_same_checkpoint(tmp_path: Path) -> None:
    """offload="device": values made on the GPU stay there (kept as they are, no copy), host inputs are copied
    there, and the run writes the checkpoint of the cpu tier's, bit for bit."""
    from seqcal.execution.cache import ActivationCache

    x = torch.randn(4, 8, device="cuda")
    for offload in ("device", "cuda:0"):
        with ActivationCache(offload=offload, device="cuda") as cache:
            cache.put(0, "h", x)
            cache.put(0, "ids", torch.arange(4))
            assert cache.fetch(0, "h") is x and cache.fetch(0, "ids").device.type == "cuda"
    src = _saved_llama(tmp_path / "src")
    _run(str(src), tmp_path / "ram", batch_size=2)
    _run(str(src), tmp_path / "device", batch_size=2, offload="device")
    ram, device = checkpoint_tensors(tmp_path / "ram"), checkpoint_tensors(tmp_path / "device")
    assert ram.keys() == device.keys() and [k for k in ram if not torch.equal(ram[k], device[k])] == []


def test_background_checkpoint_writes_on_cuda_give_the_synchronous_checkpoint(
    tmp_path: Path, monkeypatch
) -> None:
    """With subgraphs on the GPU the worker thread writes only host copies the calibration's thread made: the
    checkpoint equals a synchronous save's, tensor for tensor and bit for bit, and device memory after the run is
    what it was before (nothing held for the worker)."""
    import seqcal.checkpoint.streaming as streaming

    src = _saved_llama(tmp_path / "src")
    monkeypatch.setattr(streaming, "CHECKPOINT_BYTES", 1)  # a shard and a record after every subgraph
    monkeypatch.setattr(streaming, "BACKGROUND", False)
    _run(str(src), tmp_path / "sync", batch_size=2)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    monkeypatch.setattr(streaming, "BACKGROUND", True)
    _run(str(src), tmp_path / "background", batch_size=2)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before
    sync, background = checkpoint_tensors(tmp_path / "sync"), checkpoint_tensors(tmp_path / "background")
    assert (
        sync.keys() == background.keys()
        and [k for k in sync if not torch.equal(sync[k], background[k])] == []
    )


def test_gptq_solve_on_cuda_keeps_the_hessian_in_pinned_host_memory() -> None:
    """A GPTQ solve on the GPU computes its factor in the Hessian's memory and keeps the Hessian's values in
    pinned host memory: the device holds the Hessian and the Cholesky factor (one [n, n] matrix beside it) plus
    the weight-sized temporaries, the Hessian comes back bit for bit, and the codes equal those of a solve on a
    clone of it."""
    from seqcal.algorithms import gptq_quantize
    from seqcal.algorithms.hessian import symmetrize_upper
    from seqcal.algorithms.kept_hessian import KeptHessian

    n, rows = 2048, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    X = torch.randn(4 * n, n, device="cuda", generator=g)
    H = symmetrize_upper(2 * X.T @ X / X.shape[0])
    del X
    W = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    kept = KeptHessian(H)
    assert kept.blocks[0].device.type == "cpu" and kept.blocks[0].is_pinned()
    del kept
    before = H.clone()
    reference = gptq_quantize(W, before.clone(), num_bits=4, group_size=128, actorder="static")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    result = gptq_quantize(W, H, num_bits=4, group_size=128, actorder="static")
    torch.cuda.synchronize()
    beyond = (torch.cuda.max_memory_allocated() - start) / H.nbytes
    assert torch.equal(H, before)
    assert torch.equal(result.q, reference.q)
    assert beyond < 1.3, (
        beyond
    )  # the Cholesky factor and small temporaries (the copy made before: 2 and more)
