"""Host memory: a model loaded in RAM holds no checkpoint pages beside its quantized weights, and the host budget
(``max_host_memory``) picks the cache tier and the cut from the memory plan, or refuses before any weight is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from seqcal.entrypoint import ModelArgs, load_model, oneshot
from seqcal.modifiers import GPTQModifier
from test_oneshot import tiny_llama, token_data

MAPS = Path("/proc/self/maps")


def _mapped(path: Path) -> int:
    """Bytes of ``path`` mapped into this process (/proc/self/maps)."""
    total = 0
    for line in MAPS.read_text().splitlines():
        if line.endswith(str(path)):
            lo, _, hi = line.split()[0].partition("-")
            total += int(hi, 16) - int(lo, 16)
    return total


def _storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the model's parameters."""
    seen = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(seen.values())


@pytest.mark.skipif(not MAPS.is_file(), reason="reads /proc/self/maps (Linux)")
def test_a_model_in_ram_keeps_no_checkpoint_pages(tmp_path: Path) -> None:
    """The run in RAM replaces each quantized weight: the checkpoint's mapping must not outlive the load, or the
    process holds the original beside every quantized weight (RSS rising subgraph by subgraph)."""
    tiny_llama().save_pretrained(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    model, _, store = load_model(ModelArgs(str(tmp_path / "model")))
    assert store is None and _mapped(weights) == 0
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert _storage_bytes(model) == params
    oneshot(model=model, dataset=token_data(4), recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
            max_seq_length=32, output_dir=str(tmp_path / "out"))  # fmt: skip
    # every finished subgraph's weights replaced, nothing of the originals kept: the same bytes as before
    assert _mapped(weights) == 0 and _storage_bytes(model) == params
