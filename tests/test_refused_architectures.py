"""Architectures a sequential run cannot cut as they are: each refused before calibration with a sentence that says
why and what runs instead, and that alternative calibrated and reloaded.

Dory and HRM loop over their layers (recurrent depth: the same weights run several times in one forward), so no
subgraph order gives each layer its one input; pipeline="basic" calibrates them in one forward. HRM's checkpoint
also stores q/k/v/gate and gate/up fused, which transformers splits as it loads. The text-only Mllama skips its
cross-attention layers on a runtime test; the error names the layers to target. BLT and xLSTM trace (their partitions
equal eager execution: tests/test_trace_equivalence.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from autozoo import build, candidates
from seqcal.entrypoint import oneshot
from seqcal.errors import ModelLoadError
from seqcal.modifiers import GPTQModifier
from seqcal.tracing import TracingError
from sources_helpers import token_data
from zoo import ARCHS

W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}


def gptq(path: str | torch.nn.Module, out: Path, **kwargs: object) -> None:
    recipe = GPTQModifier(config_groups={"w4": {"targets": ["Linear"], "weights": W4}}, ignore=["lm_head"])
    oneshot(
        model=path, dataset=token_data(2, 16), recipe=recipe, output_dir=str(out), max_seq_length=16, **kwargs
    )


def saved(model: torch.nn.Module, path: Path) -> str:
    model.save_pretrained(path)
    return str(path)


def test_a_model_looping_over_its_layers_is_refused_then_runs_in_one_forward(tmp_path: Path) -> None:
    source = saved(build(candidates()["dory"]), tmp_path / "dory")
    with pytest.raises(
        TracingError, match=r"called 2 times in one forward \(a layer shared, or looped over"
    ) as err:
        gptq(source, tmp_path / "refused")
    assert "pipeline='basic'" in str(err.value)
    assert not (tmp_path / "refused" / "config.json").exists()
    gptq(source, tmp_path / "out", pipeline="basic")
    model = transformers.DoryForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert model(torch.tensor([token_data(1, 8)[0]["input_ids"]])).logits.isfinite().all()


def test_hrm_fused_checkpoint_and_loops_are_refused_with_their_reasons(tmp_path: Path) -> None:
    model = build(candidates()["hrm_text"])
    with pytest.raises(ModelLoadError, match="transformers merges or splits as it loads") as err:
        gptq(saved(model, tmp_path / "hrm"), tmp_path / "from-dir")
    assert "gate_up_proj" in str(err.value) and "from_pretrained(path)" in str(err.value)
    with pytest.raises(TracingError, match="looped over as in recurrent-depth models"):
        gptq(model, tmp_path / "in-memory")


def test_text_only_mllama_names_the_layers_that_run_and_calibrates_them(tmp_path: Path) -> None:
    source = saved(ARCHS["mllama_text"].build(), tmp_path / "mllama")
    with pytest.raises(TracingError, match=r"sequential_targets=\['MllamaSelfAttentionDecoderLayer'\]"):
        gptq(source, tmp_path / "refused")
    gptq(source, tmp_path / "out", sequential_targets=["MllamaSelfAttentionDecoderLayer"])
    model = transformers.MllamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert model(torch.tensor([token_data(1, 8)[0]["input_ids"]])).logits.isfinite().all()
