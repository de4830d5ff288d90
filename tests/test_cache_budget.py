"""ActivationCache options: a RAM budget that spills to disk, narrower storage dtype, shared equal spans."""

from __future__ import annotations

import ctypes
import gc
import os
import weakref
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import seqcal.execution.cache.storage as cache_module
from seqcal.cli import build_parser
from seqcal.entrypoint import oneshot
from seqcal.execution.cache.entries import _checksum
from seqcal.execution.cache.spill import SpillFolder
from seqcal.execution.cache.store import DEDUP_MAX_BYTES, ActivationCache
from seqcal.execution.pipeline import PipelineArgs
from seqcal.modifiers import GPTQModifier
from test_oneshot import _output_error, tiny_llama, token_data

MB = 1 << 20
F32_MIN = torch.finfo(torch.float32).min

# cpu: host tensors kept as they are; cpu-copy: the path accelerator tensors take (copied to host RAM),
# forced on this CPU-only machine; disk: safetensors files.
TIERS = ["cpu", "cpu-copy", "disk"]


def make_cache(tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> ActivationCache:
    if tier == "disk":
        return ActivationCache("disk", offload_dir=tmp_path, **kwargs)
    cache = ActivationCache("cpu", **kwargs)
    if tier == "cpu-copy":
        monkeypatch.setattr(cache, "_stores_as_is", lambda t: False)
    return cache


def held(cache: ActivationCache) -> int:
    return cache.resident_bytes() + cache.disk_bytes()


def rss() -> int:
    """Process RSS after returning freed heap to the OS, so earlier tests' garbage does not blur it."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: measure as is
        pass
    return psutil.Process().memory_info().rss


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


# ---- RAM budget -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["cpu", "cpu-copy"])
def test_spans_over_the_budget_spill_to_disk(
    tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = 3 * 4000 + 100
    cache = make_cache(tier, tmp_path, monkeypatch, max_memory=budget, offload_dir=tmp_path)
    assert cache.directory is None  # the spill folder is made on the first spill only
    values = [torch.randn(1000) for _ in range(10)]  # 4000 bytes each
    for b, v in enumerate(values):
        cache.put(b, "h", v)
        assert cache.resident_bytes() <= budget
    assert cache.resident_bytes() == 3 * 4000 and cache.disk_bytes() >= 7 * 4000
    folder = cache.directory
    assert os.path.dirname(folder) == str(tmp_path) and len(os.listdir(folder)) == 7
    for b, v in enumerate(values):
        assert torch.equal(cache.fetch(b, "h"), v)
    cache.drop(9, "h")  # a spilled span: its file goes
    assert len(os.listdir(folder)) == 6 and cache.resident_bytes() == 3 * 4000
    cache.drop(0, "h")  # a resident span frees budget for the next put, nothing moves back
    cache.put(10, "h", torch.ones(1000))
    assert cache.resident_bytes() == 3 * 4000 and len(os.listdir(folder)) == 6
    cache.close()
    assert not os.path.exists(folder)


def test_spill_keeps_views_shared_and_releases_kept_tensors(tmp_path: Path) -> None:
    cache = ActivationCache("cpu", max_memory=0)  # everything spills
    base = torch.randn(8, 16)
    ref = weakref.ref(base)
    value = (base, base[2:5], base.T, base[:, ::2])
    cache.put(0, "views", value)
    assert cache.resident_bytes() == 0 and len(os.listdir(cache.directory)) == 1
    got = cache.fetch(0, "views")
    for g, w in zip(got, value):
        assert (g.shape, g.stride()) == (w.shape, w.stride()) and torch.equal(g, w)
    assert got[1].untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()
    cache.put(0, "again", got)  # a fetched value put again reuses the spilled span
    assert len(os.listdir(cache.directory)) == 1
    del value, base, w  # w: the last view, whose ._base is base
    gc.collect()
    assert ref() is None, "a spilled tensor must not be kept alive by the cache"
    cache.close()


def test_spill_bounds_ram_over_50_batches(tmp_path: Path) -> None:
    n, numel, budget = 50, MB, 20 * MB  # 50 batches of 4 MiB under a 20 MiB budget
    with ActivationCache("cpu", max_memory=budget, offload_dir=tmp_path) as cache:
        before = rss()
        for b in range(n):
            cache.put(b, "hidden", torch.full((numel,), float(b)))
        written = n * numel * 4
        assert cache.resident_bytes() == 5 * numel * 4 and cache.disk_bytes() >= written - budget
        growth = rss() - before
        assert growth < budget + 0.2 * written, f"RSS grew {growth / MB:.0f} MiB"
        for b in (0, 4, 5, 49):
            assert torch.equal(cache.fetch(b, "hidden"), torch.full((numel,), float(b)))


def test_budget_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_memory.*offload='cpu'"):
        ActivationCache("disk", max_memory=10)
    with pytest.raises(ValueError, match="max_memory"):
        ActivationCache("cpu", max_memory=-1)
    with pytest.raises(ValueError, match="offload_dir"):
        ActivationCache("cpu", offload_dir=tmp_path)  # without a budget nothing would go there
    with pytest.raises(ValueError, match="needs offload='cpu'"):
        PipelineArgs(offload="disk", cache_max_memory=10)
    with pytest.raises(ValueError, match=r"cache_dtype='fp8'.*'bfloat16', 'float16'"):
        PipelineArgs(cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"store_dtype=torch.int8.*torch.bfloat16"):
        ActivationCache("cpu", store_dtype=torch.int8)
    with pytest.raises(ValueError, match="dedup_max_bytes"):
        ActivationCache("cpu", dedup_max_bytes=-1)
    with pytest.raises(ValueError, match="cache_max_memory='lots'"):
        oneshot(model=tiny_llama(), dataset=token_data(2), recipe="QuantizationModifier: {scheme: W4A16}",
                cache_max_memory="lots")  # fmt: skip


# ---- narrower storage dtype -------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_bfloat16_storage_round_trip(tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache(tier, tmp_path, monkeypatch, store_dtype=torch.bfloat16)
    h = torch.randn(6, 8) * 1000
    exact = {
        "ids": torch.arange(12).view(3, 4),
        "mask": torch.rand(3, 4) > 0.5,
        "half": torch.randn(4).half(),
        "bf16": torch.randn(4).bfloat16(),
    }
    value = {"h": h, "view": h[2:5], "T": h.T, "d": h.double(), **exact}
    cache.put(0, "x", value)
    got = cache.fetch(0, "x")
    for key in ("h", "view", "T", "d"):
        want = value[key]
        assert (got[key].dtype, got[key].shape, got[key].stride()) == (want.dtype, want.shape, want.stride())
        assert torch.equal(got[key], bf16(want)) and not torch.equal(got[key], want)
    for key, want in exact.items():
        assert got[key].dtype == want.dtype and torch.equal(got[key], want)
        if tier == "cpu":  # integer, bool and already narrow tensors are kept as they are
            assert got[key] is want
    # The view comes back as a view of the fetched h, with the same values as rounding the view itself.
    assert got["view"].untyped_storage().data_ptr() == got["h"].untyped_storage().data_ptr()
    before = held(cache)
    cache.put(0, "slice", h[1:3])  # another view of the stored storage: no new bytes
    cache.put(0, "passthrough", got["h"])  # a fetched value put again: no new bytes
    assert held(cache) == before
    assert torch.equal(cache.fetch(0, "slice"), bf16(h[1:3]))
    # The same bytes read as int32 are not a float32 value: stored exactly, not from the bfloat16 span.
    cache.put(0, "bits", h.view(torch.int32))
    assert torch.equal(cache.fetch(0, "bits"), h.view(torch.int32))
    cache.close()


@pytest.mark.parametrize("tier", TIERS)
def test_bfloat16_storage_halves_the_cache(
    tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exact = make_cache(tier, tmp_path / "a", monkeypatch, dedup_max_bytes=0)
    narrow = make_cache(tier, tmp_path / "b", monkeypatch, store_dtype=torch.bfloat16, dedup_max_bytes=0)
    for b in range(20):
        t = torch.randn(256, 64)  # 64 KiB
        exact.put(b, "hidden", t)
        narrow.put(b, "hidden", t)
    if tier == "disk":  # safetensors files add a small header each
        assert narrow.disk_bytes() < 0.55 * exact.disk_bytes() and narrow.resident_bytes() == 0
    else:
        assert narrow.resident_bytes() * 2 == exact.resident_bytes() == 20 * 256 * 64 * 4
    exact.close()
    narrow.close()


def test_float16_storage_keeps_masks_finite_and_infinities() -> None:
    """A plain cast would turn finfo(float32).min into -inf, and a fully masked row of attention into NaN."""
    with ActivationCache("cpu", store_dtype=torch.float16) as cache:
        mask = torch.full((4, 4), F32_MIN).triu(1)  # causal mask as transformers builds it
        special = torch.tensor([float("-inf"), float("inf"), float("nan"), 1e6, -1e6, 0.5])
        cache.put(0, "m", (mask, special))
        got_mask, got_special = cache.fetch(0, "m")
        fp16_min = torch.finfo(torch.float16).min
        assert torch.isfinite(got_mask).all() and (got_mask.triu(1) == fp16_min).sum() == 6
        assert torch.equal(got_mask.tril(), torch.zeros(4, 4))
        fully_masked = torch.randn(4) + got_mask[0, -1]  # a padding row: every position masked
        assert torch.isfinite(torch.softmax(fully_masked, -1)).all()
        plain = torch.randn(4) + torch.full((4,), F32_MIN).half().float()  # what a plain cast gives
        assert torch.softmax(plain, -1).isnan().all()
        assert got_special[0] == float("-inf") and got_special[1] == float("inf") and got_special[2].isnan()
        assert got_special[3] == torch.finfo(torch.float16).max and got_special[4] == fp16_min
        assert got_special[5] == 0.5


# ---- equal spans shared across batches ---------------------------------------------------------------------


def rotary_and_mask() -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """What subgraph 0 recomputes for every batch: fresh tensors, identical content."""
    angles = torch.arange(32.0)[:, None] * torch.arange(16.0)[None] / 16
    return (angles.cos()[None], angles.sin()[None]), torch.full((1, 1, 32, 32), F32_MIN).triu(1)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("store_dtype", [None, torch.bfloat16])
def test_equal_side_inputs_stored_once_across_batches(
    tier: str, store_dtype: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(tier, tmp_path, monkeypatch, store_dtype=store_dtype)
    rotary, mask = rotary_and_mask()
    cache.put(0, "rotary", rotary)
    cache.put(0, "mask", mask)
    one = held(cache)
    assert one >= (rotary[0].nbytes * 2 + mask.nbytes) // (2 if store_dtype else 1)
    for b in range(1, 6):
        fresh_rotary, fresh_mask = rotary_and_mask()
        cache.put(b, "rotary", fresh_rotary)
        cache.put(b, "mask", fresh_mask)
    assert held(cache) == one
    cache.drop(0, "rotary")  # the batch whose bytes the others share
    cache.drop_name("mask")
    assert cache.resident_bytes() + cache.disk_bytes() < one
    want = rotary if store_dtype is None else tuple(bf16(t) for t in rotary)
    for b in range(1, 6):
        got = cache.fetch(b, "rotary")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for b in range(1, 6):
        cache.drop(b, "rotary")
    assert cache.resident_bytes() == cache.disk_bytes() == 0
    cache.close()


@pytest.mark.parametrize("tier", TIERS)
def test_different_content_is_never_shared(
    tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(tier, tmp_path, monkeypatch)
    a = torch.arange(256, dtype=torch.uint8).repeat(4)
    b = a.clone()
    words = b.view(torch.int64)  # two 8-byte words of one chunk swapped: equal checksums, different bytes
    words[0], words[1] = a.view(torch.int64)[1], a.view(torch.int64)[0]
    assert _checksum(a) == _checksum(b) and not torch.equal(a, b)
    cache.put(0, "x", a)
    one = held(cache)
    cache.put(1, "x", b)
    cache.put(2, "x", a + 0)  # equal to batch 0: shared
    cache.put(3, "other-name", a + 0)  # equal bytes under another name: not compared
    assert held(cache) == 3 * one
    assert torch.equal(cache.fetch(1, "x"), b) and torch.equal(cache.fetch(2, "x"), a)
    # A shared span stays right when the tensor that matched it changes in place afterwards.
    c = a.clone()
    cache.put(4, "x", c)
    c[:10] = 0
    cache.put(5, "x", c)
    assert torch.equal(cache.fetch(4, "x"), a) and torch.equal(cache.fetch(5, "x"), c)
    cache.close()


def test_large_tensors_are_not_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(cache_module, "_checksum", lambda enc: calls.append(enc.numel()) or _checksum(enc))
    with ActivationCache("cpu") as cache:
        big = torch.zeros(DEDUP_MAX_BYTES // 4 + 1)  # just over the threshold, like a 75 MB hidden state
        cache.put(0, "hidden", big)
        cache.put(1, "hidden", big.clone())
        assert calls == [] and cache.resident_bytes() == 2 * big.nbytes
        small = torch.zeros(DEDUP_MAX_BYTES // 4)
        cache.put(0, "mask", small)
        cache.put(1, "mask", small.clone())
        assert calls == [small.nbytes] * 2 and cache.resident_bytes() == 3 * big.nbytes - 4
    with ActivationCache("cpu", dedup_max_bytes=0) as cache:  # off
        cache.put(0, "mask", torch.ones(8))
        cache.put(1, "mask", torch.ones(8))
        assert cache.resident_bytes() == 64


# ---- end to end -------------------------------------------------------------------------------------------


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[Any]:
    calls: list[Any] = []
    original = getattr(owner, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def quantized(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_oneshot_with_budget_and_bfloat16_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = token_data(6, 32)
    recipe = GPTQModifier(scheme="W4A16", ignore=["lm_head"])
    baseline = tiny_llama()
    # batch_size=1 pinned throughout: the runs compare bit for bit, and "auto" (the default on CUDA) forms
    # batches from the cache budget, which differs between them
    oneshot(model=baseline, dataset=data, recipe=recipe, max_seq_length=32, batch_size=1)
    writes = count_calls(monkeypatch, SpillFolder, "write")
    spilled = tiny_llama()
    oneshot(model=spilled, dataset=data, recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
            max_seq_length=32, cache_max_memory="1KB", batch_size=1)  # fmt: skip
    assert len(writes) > 10  # nearly every span went to disk
    want = quantized(baseline)
    got = quantized(spilled)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)  # lossless

    casts = count_calls(monkeypatch, cache_module, "_encode")
    out = tmp_path / "out"
    narrow = tiny_llama()
    oneshot(model=narrow, dataset=data, recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
            max_seq_length=32, output_dir=str(out), cache_max_memory=1000, cache_dtype="bfloat16",
            batch_size=1)  # fmt: skip
    assert any(args[-1] is torch.bfloat16 for args in casts)
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    got = quantized(narrow)
    weights = [k for k in want if k.endswith("proj.weight")]
    assert weights and any(not torch.equal(got[k], want[k]) for k in weights)  # lossy: it did change
    # ... but the quantized model is as close to the full-precision one as with the exact cache.
    reference = tiny_llama()
    assert _output_error(narrow, reference) < 1.15 * _output_error(baseline, reference)


def test_budget_is_not_part_of_the_resume_fingerprint() -> None:
    # oneshot fingerprints a run with repr(PipelineArgs): a lossless budget may change on resume, a dtype not.
    assert repr(PipelineArgs(cache_max_memory=10)) == repr(PipelineArgs())
    assert repr(PipelineArgs(cache_dtype="bfloat16")) != repr(PipelineArgs())


def test_cli_passes_cache_options() -> None:
    args = build_parser().parse_args(
        [
            "oneshot",
            "--model",
            "m",
            "--recipe",
            "r.yaml",
            "--cache-max-memory",
            "4GB",
            "--cache-dtype",
            "bfloat16",
        ]
    )
    assert (args.cache_max_memory, args.cache_dtype) == ("4GB", "bfloat16")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["oneshot", "--model", "m", "--recipe", "r", "--cache-dtype", "int8"])


# ---- freeing inputs as the last pass goes ----------------------------------------------------------------


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "layer-cut"])
def test_the_last_pass_frees_each_batchs_inputs_before_the_next_batch(
    one_pass: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass that stores a subgraph's outputs drops a batch's inputs past their last use right after that
    batch ran, and a calibration pass followed by a propagation pass stores nothing: the cache never holds a
    subgraph's inputs and its outputs for every batch at once (the peak it had when inputs were dropped at
    the end of the subgraph), and the quantized model is the same."""
    import seqcal.execution.executor as executor

    during: list[int] = []  # resident bytes after each put, inside the passes
    cuts: list[int] = []  # when a subgraph starts: what crosses the cut before it
    added: list[int] = []  # bytes one put added
    real_put, real_run_one = ActivationCache.put, executor.run_one

    def put(self: ActivationCache, batch: int, name: str, value: Any) -> None:
        before = self.resident_bytes()
        real_put(self, batch, name, value)
        during.append(self.resident_bytes())
        added.append(self.resident_bytes() - before)

    def run_one(
        runner: Any, sg: Any, batches: Any, modifiers: Any, cache: ActivationCache, *rest: Any
    ) -> Any:
        cuts.append(cache.resident_bytes())
        return real_run_one(runner, sg, batches, modifiers, cache, *rest)

    def run(model: torch.nn.Module) -> None:
        recipe = GPTQModifier(scheme="W4A16", ignore=["lm_head"])
        oneshot(
            model=model,
            dataset=token_data(8, 32),
            recipe=recipe,
            max_seq_length=32,
            one_pass=one_pass,
            batch_size=1,
        )  # per-sample batches, the default on the CPU, also where CUDA makes it "auto"

    baseline = tiny_llama()
    run(baseline)
    monkeypatch.setattr(ActivationCache, "put", put)
    monkeypatch.setattr(executor, "run_one", run_one)
    model = tiny_llama()
    run(model)
    assert during and cuts
    # at most one batch's values on top of the largest set of values that crosses a cut (dropped at the end
    # of each subgraph, and with both passes storing, this tiny model's cache peaked 1.6x above that with the
    # one-pass cut, 1.7x with the layer cut)
    assert max(during) <= max(cuts) + max(added)
    want, got = baseline.state_dict(), model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


class _CopiesAtOnce:
    """``seqcal.execution.cache.transfers.Transfers`` without CUDA: every copy done at once (a clone), its event a
    stand-in; counts what the cache asked for, so the cache's bookkeeping around the side streams runs on the CPU."""

    def __init__(self) -> None:
        self.out: list[int] = []  # batch of each copy to the host
        self.copied_in = self.used = self.settled = 0
        self.waited = 0.0

    def copy_out(self, batch: int, flat: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.out.append(batch)
        return flat.clone(), None

    def copy_in(self, host: torch.Tensor, ready: Any) -> tuple[torch.Tensor, str]:
        self.copied_in += 1
        return host.clone(), "copied"

    def use(self, event: str) -> None:
        assert event == "copied"
        self.used += 1

    def settle(self) -> None:
        self.settled += 1

    def finish(self) -> None:
        pass


def _with_side_streams(cache: ActivationCache, monkeypatch: pytest.MonkeyPatch) -> _CopiesAtOnce:
    """Make a cpu cache behave as on CUDA: values copied to host memory that counts as pinned, through the fake."""
    fake = _CopiesAtOnce()
    cache._transfers = fake
    monkeypatch.setattr(cache, "_stores_as_is", lambda t: False)
    return fake


def test_prefetched_values_are_fetched_from_their_copy_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    xs = [torch.randn(3, 5) for _ in range(3)]
    with ActivationCache(offload="cpu") as cache:
        fake = _with_side_streams(cache, monkeypatch)
        for b, x in enumerate(xs):
            cache.put(b, "h", (x, x[1:]))  # two views of one storage: one copy
        assert fake.out == [0, 1, 2]
        cache.prefetch(1, ["h", "never put"])
        cache.prefetch(1, ["h"])  # already on its way
        assert fake.copied_in == 1 and len(cache._prefetched) == 1
        got = cache.fetch(1, "h")
        assert fake.used == 1 and not cache._prefetched
        assert torch.equal(got[0], xs[1]) and torch.equal(got[1], xs[1][1:])
        cache.put(1, "again", got)  # a fetched value put again: the same bytes, no new copy
        assert fake.out == [0, 1, 2]
        assert (
            torch.equal(cache.fetch(1, "h")[0], xs[1]) and fake.used == 1
        )  # not prefetched: from the host copy
        cache.prefetch(2, ["h"])
        cache.drop(2, "h")  # freed with its entry
        assert not cache._prefetched
        cache.prefetch(0, ["h"])
        cache.settle()  # unread prefetches are let go
        assert not cache._prefetched and fake.settled == 1
        assert torch.equal(cache.fetch(0, "h")[0], xs[0])


def test_run_with_the_cache_copying_as_on_cuda_gives_the_same_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor's prefetch of the next batch (calibration from cached inputs, propagation passes) and its
    settle at the end of each pass, with copies done at once: the quantized weights of a plain run, bit for bit."""
    data = token_data(6, 32)
    baseline = tiny_llama()
    oneshot(model=baseline, dataset=data, recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
            max_seq_length=32, batch_size=1)  # fmt: skip
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    fakes: list[_CopiesAtOnce] = []
    init = ActivationCache.__init__

    def init_with_side_streams(self: ActivationCache, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        fakes.append(_with_side_streams(self, monkeypatch))

    monkeypatch.setattr(ActivationCache, "__init__", init_with_side_streams)
    copied = tiny_llama()
    oneshot(model=copied, dataset=data, recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
            max_seq_length=32, batch_size=1)  # fmt: skip
    run = max(fakes, key=lambda f: len(f.out))  # the calibration's cache (the partition check has its own)
    assert run.out and run.copied_in > 0 and run.used == run.copied_in and run.settled > 0
    want, got = quantized(baseline), quantized(copied)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
