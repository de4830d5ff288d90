"""ActivationCache: nested round trips, tensor dedup and refcounts, tiers, cleanup, errors, memory."""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import gc
import os
import pickle
from typing import Any

import numpy
import psutil
import pytest
import torch
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from seqcal.execution.cache.store import ActivationCache, CacheMissError

MB = 1 << 20
Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Pair:
    a: torch.Tensor
    b: Any = None

    def __post_init__(self) -> None:
        self.doubled = self.a * 2  # an attribute outside the fields must survive too


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    tag: str = "t"


class Opaque:
    """Stands for objects the cache cannot decompose; copying or pickling it fails the test."""

    def __init__(self) -> None:
        self.t = torch.ones(2)

    def __reduce__(self) -> Any:
        raise AssertionError("the cache pickled an opaque object")

    def __deepcopy__(self, memo: dict) -> Any:
        raise AssertionError("the cache copied an opaque object")


# cpu: host tensors kept as they are; cpu-copy: the path accelerator tensors take (copy to host RAM),
# forced on this CPU-only machine; disk: safetensors files.
TIERS = ["cpu", "cpu-copy", "disk"]


def make_cache(tier: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> ActivationCache:
    if tier == "disk":
        return ActivationCache("disk", offload_dir=tmp_path)
    cache = ActivationCache("cpu")
    if tier == "cpu-copy":
        monkeypatch.setattr(cache, "_stores_as_is", lambda t: False)
    return cache


@pytest.fixture(params=TIERS)
def cache(request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> ActivationCache:
    c = make_cache(request.param, tmp_path, monkeypatch)
    c.tier = request.param  # type: ignore[attr-defined]
    yield c
    c.close()


def assert_same(got: Any, want: Any) -> None:
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
        assert torch.equal(got, want)
    elif dataclasses.is_dataclass(want) and not isinstance(want, dict):
        assert vars(got).keys() == vars(want).keys()
        for key in vars(want):
            assert_same(getattr(got, key), getattr(want, key))
    elif isinstance(want, dict):
        assert list(got.keys()) == list(want.keys())
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    elif isinstance(want, slice):
        assert_same((got.start, got.stop, got.step), (want.start, want.stop, want.step))
    else:
        assert got == want


def nested_values() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, 4, generator=g)
    dd = collections.defaultdict(list, {"a": [t]})
    return {
        "tensor": t,
        "tuple": (t, t[0], (t.T, None)),
        "list": [t, [t * 2, 1.5], "text"],
        "dict": {"hidden": t, "mask": None, "inner": {"pos": torch.arange(4)}},
        "ordereddict": collections.OrderedDict(b=t, a=t + 1),
        "defaultdict": dd,
        "namedtuple": Point(x=t, y=(t, 3)),
        "structseq": t.max(dim=1),
        "dataclass": Pair(a=t, b=[t + 1]),
        "frozen_dataclass": Frozen(x=t),
        "model_output": BaseModelOutputWithPast(last_hidden_state=t, hidden_states=(t, t + 1)),
        "model_output_none_fields": CausalLMOutputWithPast(logits=t),
        "scalars": (None, True, 3, 2.5, 1 + 2j, "s", b"b", ...),
        "torch_constants": (torch.float16, torch.device("cpu"), torch.Size([2, 3])),
        "slices": (slice(1, None), slice(None, -1, 2), (slice(0, 2), Ellipsis)),
        "dtypes": (t.half(), t.bfloat16(), t > 0, t.long(), t.double()),
        "zero_dim_and_empty": (torch.tensor(7.0), torch.empty(0, 3), torch.empty(2, 0, 5)),
        "complex_conj": torch.randn(3, 2, dtype=torch.complex64, generator=g).conj(),
        "parameter": torch.nn.Parameter(t.clone()),
    }


@pytest.mark.parametrize("kind", list(nested_values()))
def test_nested_round_trip(cache: ActivationCache, kind: str) -> None:
    value = nested_values()[kind]
    cache.put(0, kind, value)
    got = cache.fetch(0, kind)
    if cache.tier == "cpu" and isinstance(value, torch.Tensor):  # kept as is, no copy
        assert got is value
    if kind == "parameter" and cache.tier != "cpu":  # a copied Parameter comes back as its data
        assert_same(got, value.data)
    else:
        assert_same(got, value)
    if kind == "defaultdict":
        assert got.default_factory is list
    assert_same(cache.fetch(0, kind), got)  # fetching does not consume the value


def test_opaque_objects_kept_by_reference_never_pickled(
    cache: ActivationCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pickle(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "dumps", no_pickle)
    monkeypatch.setattr(pickle, "dump", no_pickle)
    kv = DynamicCache()
    kv.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
    opaque = Opaque()
    cache.put(
        0, "x", (torch.ones(2), kv, {"o": opaque}, CausalLMOutputWithPast(logits=torch.ones(2), cache=kv))
    )
    got = cache.fetch(0, "x")
    assert got[1] is kv and got[2]["o"] is opaque and got[3]["cache"] is kv
    assert kv.get_seq_length() == 3
    if cache.directory is not None:  # only tensor bytes reach the disk, as safetensors
        assert sorted(os.listdir(cache.directory)) == ["0.safetensors", "1.safetensors"]


def test_views_round_trip_share_storage_and_are_stored_once(cache: ActivationCache) -> None:
    base = torch.randn(4, 8)
    small = torch.ones(1, 1, 3, 5)
    value = (base, base[1:3], base.T, base[:, ::2], base.view(torch.int32), small.expand(2, 1, 3, 5))
    cache.put(0, "views", value)
    got = cache.fetch(0, "views")
    assert_same(got, value)
    # One entry per storage: the expanded mask costs its 15 elements, not 30.
    expected = base.nbytes + small.nbytes
    if cache.directory is None:
        assert cache.resident_bytes() == expected
    else:
        assert len(os.listdir(cache.directory)) == 2 and cache.resident_bytes() == 0
    # Views of one stored storage come back as views of one fetched storage.
    assert got[1].untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()


def test_small_view_of_large_storage_copies_only_its_span(cache: ActivationCache) -> None:
    big = torch.randn(1000, 1000)
    cache.put(0, "row", big[3])
    assert_same(cache.fetch(0, "row"), big[3])
    if cache.directory is not None:
        assert cache.disk_bytes() < 2 * big[3].nbytes
    elif cache.resident_bytes() != big.nbytes:  # cpu keeps the tensor as is: the whole storage stays alive
        assert cache.resident_bytes() == big[3].nbytes


def test_same_tensor_under_100_keys_costs_one_tensor(cache: ActivationCache) -> None:
    mask = torch.randn(256, 256)  # 256 KiB
    cache.put(0, "first", mask)
    one = cache.resident_bytes() + cache.disk_bytes()
    assert one >= mask.nbytes
    keys = [(b, f"layer{i}.mask") for b in range(10) for i in range(10)]
    for batch, name in keys:
        cache.put(batch, name, (mask, {"again": mask[:, :3]}))
    assert cache.resident_bytes() + cache.disk_bytes() == one
    cache.drop(0, "first")
    for batch, name in keys[:-1]:
        cache.drop(batch, name)
    assert cache.resident_bytes() + cache.disk_bytes() == one  # the last key still needs it
    cache.drop(*keys[-1])
    assert cache.resident_bytes() == 0 and cache.disk_bytes() == 0 and len(cache) == 0
    if cache.directory is not None:
        assert os.listdir(cache.directory) == []


def test_drop_and_drop_name_free_bytes(cache: ActivationCache) -> None:
    for batch in range(3):
        cache.put(batch, "a", torch.randn(1000))
        cache.put(batch, "b", {"h": torch.randn(2000)})
    held = cache.resident_bytes() + cache.disk_bytes()
    assert held >= 3 * (4000 + 8000)
    cache.drop(1, "b")
    assert (1, "b") not in cache and (0, "b") in cache
    after_drop = cache.resident_bytes() + cache.disk_bytes()
    assert held - after_drop >= 8000
    cache.drop_name("a")
    assert cache.names() == {"b"} and (0, "a") not in cache
    after_name = cache.resident_bytes() + cache.disk_bytes()
    assert after_drop - after_name >= 3 * 4000
    cache.drop_name("never-stored")  # no-op
    cache.drop_name("b")
    assert cache.resident_bytes() == cache.disk_bytes() == 0 and cache.names() == set()


def test_put_replaces_and_frees_the_old_value(cache: ActivationCache) -> None:
    cache.put(0, "x", torch.randn(1000))
    first = cache.resident_bytes() + cache.disk_bytes()
    new = torch.randn(1000)
    cache.put(0, "x", new)
    assert cache.resident_bytes() + cache.disk_bytes() == first
    assert torch.equal(cache.fetch(0, "x"), new)


def test_copies_are_snapshots_not_fooled_by_reused_addresses_or_inplace_changes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for tier in ("cpu-copy", "disk"):
        with make_cache(tier, tmp_path, monkeypatch) as cache:
            x = torch.zeros(64)
            cache.put(0, "before", x)
            x.add_(1)  # in place after the copy: the next put must not reuse the stale bytes
            cache.put(0, "after", x)
            assert cache.fetch(0, "before").sum() == 0 and cache.fetch(0, "after").sum() == 64
            # A new tensor at a used address (what the allocator does with freed storages, made certain
            # here): same data_ptr, a fresh version counter, other values.
            buffer = numpy.zeros(64, dtype=numpy.float32)
            for batch in range(20):
                buffer[:] = batch
                t = torch.from_numpy(buffer)
                cache.put(batch, "h", t)
                del t
            for batch in range(20):
                assert torch.equal(cache.fetch(batch, "h"), torch.full((64,), float(batch)))


def test_fetched_value_put_again_is_not_stored_twice(cache: ActivationCache) -> None:
    cache.put(0, "h", (torch.randn(1000), torch.ones(10)))
    held = cache.resident_bytes() + cache.disk_bytes()
    got = cache.fetch(0, "h")
    cache.put(0, "passthrough", got)
    assert cache.resident_bytes() + cache.disk_bytes() == held
    if cache.tier == "cpu":  # kept as is: the fetched tensor is the stored one, nothing to compare
        return
    got[0].add_(1)  # modified after fetch (against the contract): its bytes are not the entry's any more
    cache.put(0, "modified", got[0])
    assert cache.resident_bytes() + cache.disk_bytes() > held


def test_errors_name_the_key_and_what_is_present(tmp_path: Any) -> None:
    cache = ActivationCache("cpu")
    cache.put(0, "hidden", torch.ones(1))
    cache.put(1, "mask", torch.ones(1))
    with pytest.raises(CacheMissError, match=r"batch 0, name 'mask'.*batch 0: \['hidden'\].*\[1\]"):
        cache.fetch(0, "mask")
    with pytest.raises(CacheMissError, match="drop"):
        cache.drop(2, "hidden")
    cache.close()
    cache.close()  # idempotent
    with pytest.raises(RuntimeError, match=r"put\(batch=0, name='x'\).*closed"):
        cache.put(0, "x", torch.ones(1))
    with pytest.raises(RuntimeError, match="closed"):
        cache.fetch(0, "hidden")
    with pytest.raises(
        ValueError, match=r"\['cpu', 'disk', 'device'\] or an accelerator's name such as 'cuda:1'"
    ):
        ActivationCache("gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device tier keeps everything on its device"):
        ActivationCache("device", max_memory=1 << 20)
    with pytest.raises(ValueError, match="offload_dir"):
        ActivationCache("cpu", offload_dir=tmp_path)


def test_failed_put_leaves_nothing_behind(cache: ActivationCache) -> None:
    cyclic: list[Any] = [torch.randn(100)]
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="contains itself"):
        cache.put(0, "x", (torch.randn(100), cyclic))
    assert (0, "x") not in cache and cache.resident_bytes() == cache.disk_bytes() == 0
    if cache.directory is not None:
        assert os.listdir(cache.directory) == []


def test_disk_folder_removed_on_close_error_and_garbage_collection(tmp_path: Any) -> None:
    cache = ActivationCache("disk", offload_dir=tmp_path / "new")
    cache.put(0, "x", torch.ones(10))
    folder = cache.directory
    assert os.path.isdir(folder) and os.path.dirname(folder) == str(tmp_path / "new")
    cache.close()
    assert not os.path.exists(folder)

    with pytest.raises(KeyError, match="boom"):
        with ActivationCache("disk", offload_dir=tmp_path) as cache:
            cache.put(0, "x", torch.ones(10))
            folder = cache.directory
            raise KeyError("boom")
    assert not os.path.exists(folder)

    cache = ActivationCache("disk", offload_dir=tmp_path)
    cache.put(0, "x", torch.ones(10))
    folder = cache.directory
    del cache
    gc.collect()
    assert not os.path.exists(folder)


def rss() -> int:
    """Process RSS after returning freed heap to the OS, so earlier tests' garbage does not blur it."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed blocks of MiB size otherwise
    except (OSError, AttributeError):  # not glibc: measure as is
        pass
    return psutil.Process().memory_info().rss


def test_disk_tier_memory_stays_flat_over_200_batches(tmp_path: Any) -> None:
    n, numel = 200, MB  # 200 batches of a 4 MiB float32 tensor
    with ActivationCache("disk", offload_dir=tmp_path) as cache:
        cache.put(-1, "warmup", torch.zeros(numel))
        cache.drop(-1, "warmup")
        before = rss()
        for batch in range(n):
            cache.put(batch, "hidden", torch.full((numel,), float(batch)))
        growth = rss() - before
        written = n * numel * 4
        assert cache.disk_bytes() >= written and cache.resident_bytes() == 0
        assert growth < 0.25 * written, f"RSS grew {growth / MB:.0f} MiB for {written / MB:.0f} MiB written"
        for batch in (0, 77, n - 1):
            assert torch.equal(cache.fetch(batch, "hidden"), torch.full((numel,), float(batch)))
        for batch in range(n):
            if batch % 10:
                cache.drop(batch, "hidden")
        assert len(os.listdir(cache.directory)) == n // 10 and cache.names() == {"hidden"}
        assert cache.disk_bytes() >= written // 10 and cache.disk_bytes() < written // 10 + n * 1024


@pytest.mark.parametrize("tier", ["cpu", "cpu-copy"])
def test_cpu_tier_holds_exactly_the_data(tier: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    n, numel = 100, MB
    with make_cache(tier, tmp_path, monkeypatch) as cache:
        before = rss()
        for batch in range(n):
            cache.put(batch, "hidden", torch.full((numel,), float(batch)))
        data = n * numel * 4
        assert cache.resident_bytes() == data and cache.disk_bytes() == 0
        # The same measurement that stays flat for the disk tier sees this tier's data.
        assert rss() - before > 0.75 * data
        for batch in range(n):
            if batch % 10:
                cache.drop(batch, "hidden")
        assert cache.resident_bytes() == data // 10
        assert all(
            torch.equal(cache.fetch(b, "hidden"), torch.full((numel,), float(b))) for b in range(0, n, 10)
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_cuda_round_trip(offload: str, tmp_path: Any) -> None:
    kwargs = {"offload_dir": tmp_path} if offload == "disk" else {}
    with ActivationCache(offload, device="cuda", **kwargs) as cache:
        h = torch.randn(4, 8, device="cuda")
        mask = torch.ones(1, 1, 3, 5, device="cuda").expand(2, 1, 3, 5)
        cache.put(0, "x", (h, h[1:], mask))
        cache.put(1, "x", (h, h[1:], mask))
        if offload == "cpu":
            assert cache.resident_bytes() == h.nbytes + mask.untyped_storage().nbytes()
        got = cache.fetch(1, "x")
        assert all(g.is_cuda for g in got)
        assert_same(got, (h, h[1:], mask))


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_values_read_back_from_files_keep_their_alignment(offload: str) -> None:
    """A file-backed copy sits at the address modulo 64 its tensor had: matmul kernels choose their code path by
    alignment, and a differently aligned operand can give other last bits (seen with MKL on AMD CPUs)."""
    from seqcal.execution.cache.entries import ALIGNMENT

    base = torch.randn(4, 100)
    values = {"whole": base, "shifted": base.view(-1)[3:].view(-1, 1)}  # a 12-byte offset into its storage
    with ActivationCache(offload=offload, max_memory=0 if offload == "cpu" else None) as cache:
        for name, value in values.items():
            cache.put(0, name, value)
        assert cache.disk_bytes() > 0
        for name, value in values.items():
            got = cache.fetch(0, name)
            assert torch.equal(got, value)
            assert got.data_ptr() % ALIGNMENT == value.data_ptr() % ALIGNMENT, name


def test_prefetch_and_settle_change_nothing_off_cuda() -> None:
    """Side-stream copies are for a CUDA device; on the CPU (or with overlap off) prefetch and settle do nothing
    and fetch returns what was put."""
    x = torch.randn(4, 8)
    for overlap in (True, False):
        with ActivationCache(offload="cpu", overlap=overlap) as cache:
            cache.put(0, "h", x)
            cache.put(1, "h", x * 2)
            cache.prefetch(1, ["h", "never put"])
            assert cache._transfers is None and not cache._prefetched
            cache.settle()
            assert torch.equal(cache.fetch(1, "h"), x * 2) and cache.fetch(0, "h") is x


def test_device_tier_keeps_values_where_they_were_made() -> None:
    """offload="device" keeps the execution device's tensors as they are (on the CPU: the cpu tier's behaviour);
    others are copied there. The name of a device works the same."""
    x = torch.randn(4, 8)
    for offload in ("device", "cpu"):
        with ActivationCache(offload=offload, device="cpu") as cache:
            cache.put(0, "h", (x, x[1:]))
            got = cache.fetch(0, "h")
            assert got[0] is x and torch.equal(got[1], x[1:]) and cache.resident_bytes() == x.nbytes
            assert cache.home == torch.device("cpu")
    assert ActivationCache(offload="disk").home is None
