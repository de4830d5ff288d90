"""A weight read from a safetensors file (``sources.files.read_tensor``): the values safetensors reads, in memory of
its own (no mapping of the file left behind while it lives), one sentence for a truncated file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from seqcal.execution.store import WeightStore
from seqcal.sources.files import read_tensor


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        f"w.{dtype}".replace("torch.", ""): torch.randn(7, 5, generator=g).to(dtype)
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn)
    }
    out.update(
        ints=torch.randint(-100, 100, (3, 4, 2), generator=g, dtype=torch.int32),
        bytes=torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        mask=torch.rand(6, generator=g) > 0.5,
        scalar=torch.tensor(3.5),
        empty=torch.zeros(0, 4),
    )
    return out


def _mapped(path: Path) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    return any(str(path) in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_a_tensor_is_read_with_safetensors_values_into_memory_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    tensors = _tensors()
    save_file(tensors, str(path))
    read = {key: read_tensor(str(path), key) for key in tensors}
    for key, expected in tensors.items():
        got = read[key]
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        bits = got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)
        assert torch.equal(*bits), key
        with safe_open(str(path), framework="pt") as f:
            assert torch.equal(f.get_tensor(key).float(), got.float()), key
    assert not _mapped(path)  # every tensor alive, none of them in a mapping of the file
    store = WeightStore.from_checkpoint(tmp_path, dtype=torch.float32)
    assert store.read("w.bfloat16").dtype == torch.float32 and store.read("ints").dtype == torch.int32


def test_a_truncated_file_is_one_sentence(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(path))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(OSError, match="ends early; the file is truncated"):
        read_tensor(str(path), "w")


def test_one_experts_slice_of_a_fused_tensor_is_read_into_memory_of_its_own(tmp_path: Path) -> None:
    """A parameter stored as one expert's slice of a fused tensor (``WeightStore.views``): that slice's values, and
    no mapping of the file left behind while it lives."""
    path = tmp_path / "model.safetensors"
    # 256 KiB an expert: each read gets an anonymous mapping (sources.files.OWN_MAPPING_BYTES)
    fused = torch.randn(4, 256, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    save_file({"experts.gate_up_proj": fused}, str(path))
    store = WeightStore.from_checkpoint(tmp_path)
    store.views["experts.2.gate_up_proj.weight"] = ("experts.gate_up_proj", lambda s: s[2])
    got = store.read("experts.2.gate_up_proj.weight")
    assert got.dtype == torch.bfloat16 and torch.equal(got, fused[2])
    assert not _mapped(path)
