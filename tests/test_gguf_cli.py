"""``seqcal oneshot ... --output-format gguf`` from a shell on checkpoints read from disk: a Gemma 3 model runs within
its host budget (the process's own peak, measured), a mixture-of-experts model the writer does not know is refused
in one sentence before anything is calibrated or written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tokenizer_helpers import FOX_TEXTS, fox_tokenizer

TEXTS = FOX_TEXTS
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=256, max_position_embeddings=256, bos_token_id=2, eos_token_id=1, pad_token_id=0)  # fmt: skip
BUDGET = 2 * 2**30


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Gemma 3 and a tiny Qwen3-MoE saved with a tokenizer, and the calibration text as a file."""
    tokenizer = fox_tokenizer()
    root = tmp_path_factory.mktemp("gguf-cli")
    torch.manual_seed(0)
    models = {
        "gemma3": Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=len(tokenizer), **SHAPE)),
        "qwen3_moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=len(tokenizer), moe_intermediate_size=256,
                                                        num_experts=4, num_experts_per_tok=2, **SHAPE)),
    }  # fmt: skip
    out = {}
    for kind, model in models.items():
        model.eval().save_pretrained(root / kind)
        tokenizer.save_pretrained(root / kind)
        out[kind] = root / kind
    (root / "calibration.txt").write_text("\n".join(TEXTS))
    out["data"] = root / "calibration.txt"
    return out


def _oneshot(model: Path, data: Path, out: Path, scheme: str) -> subprocess.CompletedProcess[str]:
    recipe = f"GPTQModifier: {{scheme: {scheme}, ignore: [lm_head]}}"
    args = ["oneshot", "--model", str(model), "--dataset", str(data), "--recipe", recipe, "--output-dir", str(out),
            "--output-format", "gguf", "--num-calibration-samples", "4", "--max-seq-length", "32",
            "--max-host-memory", str(BUDGET)]  # fmt: skip
    return subprocess.run([sys.executable, "-m", "seqcal.cli", *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))  # fmt: skip


def test_gemma3_runs_within_its_host_budget(folders: dict[str, Path], tmp_path: Path) -> None:
    done = _oneshot(folders["gemma3"], folders["data"], tmp_path / "out", "Q8_0")
    assert done.returncode == 0, done.stderr[-3000:]
    reader = gguf.GGUFReader(tmp_path / "out" / "model.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.ffn_down.weight"] == "Q8_0" and types["blk.0.attn_q_norm.weight"] == "F32"
    report = json.loads((tmp_path / "out" / "quantization_report.json").read_text())["host_memory"]
    assert report["max_host_memory"] == BUDGET
    assert report["measured_peak"] is not None and report["measured_peak"] <= BUDGET, report


def test_qwen3_moe_is_refused_in_one_sentence_before_calibrating(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    done = _oneshot(folders["qwen3_moe"], folders["data"], tmp_path / "out", "Q4_K_M")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = [s for s in done.stderr.splitlines() if s.startswith("seqcal: error:")]
    assert "not 'qwen3_moe'" in line and "compressed-tensors" in line and line.count(". ") == 0
    assert "calibrating" not in done.stderr and not (tmp_path / "out" / "model.gguf").exists()
