"""Model-free rounds a weight a chunk of rows at a time and copies untouched tensors through a buffer: the same
codes and bytes as rounding it whole and reading it whole, for every scheme, with chunks small enough that every
weight of the tiny models is cut."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme
from transformers import LlamaConfig, LlamaForCausalLM

import seqcal.modelfree.memory as memory
import seqcal.modelfree.rows as rows
from seqcal import model_free_ptq, oneshot
from seqcal.modifiers.round_to_nearest import rtn_quantize_weight

PRESETS = ["W4A16", "W4A16_ASYM", "W8A16", "FP8_DYNAMIC", "FP8", "FP8_BLOCK", "NVFP4A16", "MXFP4A16"]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and a.view(torch.uint8).equal(b.view(torch.uint8))


@pytest.mark.parametrize("name", [*PRESETS, "W3_mse"])
def test_rows_give_the_codes_of_the_whole_weight(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "ROW_CHUNK", 128 * 256)
    if name == "W3_mse":  # a range search per group: still a row's own
        args = QuantizationArgs(num_bits=3, strategy="group", group_size=64, symmetric=False, observer="mse")
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
    else:
        scheme = preset_name_to_scheme(name, ["Linear"])
    torch.manual_seed(0)
    W = (torch.randn(640, 256) * 0.05).to(torch.bfloat16)
    step = rows.rows_per_chunk(W.shape, scheme)
    assert step == (640 if name == "FP8" else 128)  # a scale per tensor: rounded whole
    chunked, whole = rows.rtn_by_rows(W, scheme), rtn_quantize_weight(W, scheme)
    for field in ("q", "scale", "zero_point", "global_scale"):
        assert _same(getattr(chunked, field), getattr(whole, field)), field


@pytest.mark.parametrize("scheme", ["W4A16", "FP8_BLOCK", "NVFP4A16"])
def test_chunked_model_free_bytes_equal_oneshot(
    tmp_path: Path, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "llama")
    ref = tmp_path / "oneshot"
    oneshot(model=str(tmp_path / "llama"), recipe=f"QuantizationModifier: {{scheme: {scheme}, ignore: [lm_head]}}",
            pipeline="datafree", output_dir=str(ref))  # fmt: skip
    # one worker runs here: the chunks of rows and the copy buffer small enough to cut every tensor
    monkeypatch.setattr(rows, "ROW_CHUNK", 128 * 128)
    monkeypatch.setattr(memory, "COPY_BUFFER", 4096)
    monkeypatch.setattr("seqcal.modelfree.stored.COPY_BUFFER", 4096)
    out = model_free_ptq(tmp_path / "llama", tmp_path / "mf", scheme=scheme, ignore=["lm_head"])
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
