"""The scripts in examples/ run end to end on a tiny Llama directory, and do what their docstrings say.

Each example runs as a user would run it (``python examples/X.py --model DIR ...``, a subprocess with the
environment inherited), on a 2-layer Llama with random weights and a byte-level BPE tokenizer trained
offline, so the whole file takes seconds per example and reaches no network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from seqcal.data.sources import default_calibration_text
from tokenizer_helpers import byte_level_bpe

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# Small enough for seconds on a CPU, large enough for group size 128 and a meaningful 4-bit error.
SMALL = ["--num-calibration-samples", "8", "--max-seq-length", "64"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the embedded calibration text: any string encodes, offline."""
    tok = byte_level_bpe(default_calibration_text().split("\n\n"), vocab_size=384)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )


def make_tiny_llama_dir(path: Path) -> Path:
    """A model directory as users have them: config.json, model.safetensors and the tokenizer files."""
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


def run_example(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run examples/<name> as a user would; fail with its output when it exits non-zero."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def reload_logits(out: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_quantize_with_recipe_saves_a_checkpoint_that_reloads(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    proc = run_example("quantize_with_recipe.py", "--model", str(tiny_dir), "--output-dir", str(out), *SMALL,
                       cwd=tmp_path)  # fmt: skip
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"]) == (4, 64)  # the default recipe, gptq_w4a16_g64.yaml
    assert "GPTQModifier" in (out / "recipe.yaml").read_text()
    assert "reloaded LlamaForCausalLM" in proc.stdout
    ids = torch.tensor([[2, 40, 41, 42, 43, 44]])
    assert torch.isfinite(reload_logits(out, ids)).all()


def test_quantize_from_python_saves_the_modifier_as_recipe(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    run_example("quantize_from_python.py", "--model", str(tiny_dir), "--scheme", "W8A16", "--output-dir", str(out),
                *SMALL, cwd=tmp_path)  # fmt: skip
    recipe = (out / "recipe.yaml").read_text()
    assert "GPTQModifier" in recipe and "W8A16" in recipe
    weights = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert weights["weights"]["num_bits"] == 8
    assert torch.isfinite(reload_logits(out, torch.tensor([[2, 50, 51, 52]]))).all()


def test_trace_and_inspect_prints_subgraphs_exports_and_reads_errors(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "inspect"
    proc = run_example("trace_and_inspect.py", "--model", str(tiny_dir), "--format", "json",
                       "--output-dir", str(out), *SMALL, cwd=tmp_path)  # fmt: skip
    assert "2 targets -> 3 subgraphs" in proc.stdout
    assert "targets: ['model.layers.0', 'model.layers.1']" in proc.stdout
    diff = float(proc.stdout.split("max |diff| = ")[1].split()[0])
    assert diff <= 1e-5
    graph = json.loads((out / "graph.json").read_text())
    assert len(graph["subgraphs"]) == 3
    report = json.loads((out / "checkpoint" / "quantization_report.json").read_text())
    assert "model.layers.1.mlp.down_proj" in report["modules"]
    # Every per-subgraph error the report holds is printed (one line per subgraph).
    for row in report["subgraphs"]:
        if row.get("rel_error") is not None:
            assert f"{row['rel_error']:.3e}" in proc.stdout
    assert "largest GPTQ losses:" in proc.stdout


def test_compare_schemes_reports_perplexity_of_both(tiny_dir: Path, tmp_path: Path) -> None:
    numbers = tmp_path / "ppl.json"
    proc = run_example("compare_schemes.py", "--model", str(tiny_dir), "--schemes", "rtn:W8A16", "rtn:W4A16",
                       "--eval-seq-length", "64", "--eval-windows", "4", "--json", str(numbers), *SMALL,
                       cwd=tmp_path)  # fmt: skip
    ppl = json.loads(numbers.read_text())
    assert list(ppl) == ["full precision", "rtn W8A16", "rtn W4A16"]
    assert all(value > 1 and value < 1e6 for value in ppl.values())
    # 8-bit weights stay closer to full precision than 4-bit ones.
    assert abs(ppl["rtn W8A16"] - ppl["full precision"]) < abs(ppl["rtn W4A16"] - ppl["full precision"])
    assert "rtn W4A16" in proc.stdout and "embedded calibration text" in proc.stdout


def test_compare_schemes_rejects_an_unknown_algorithm(tmp_path: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "compare_schemes.py"), "--schemes", "awq:W4A16", "rtn:W4A16"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "'awq:W4A16': write ALGORITHM:PRESET with ALGORITHM in ['gptq', 'rtn']" in proc.stderr


def test_custom_modifier_beats_rtn_and_its_checkpoint_reloads(tiny_dir: Path, tmp_path: Path) -> None:
    out, numbers = tmp_path / "ckpt", tmp_path / "numbers.json"
    run_example("custom_modifier.py", "--model", str(tiny_dir), "--output-dir", str(out), "--json", str(numbers),
                cwd=tmp_path)  # fmt: skip
    result = json.loads(numbers.read_text())
    assert result["weight_error"]["mse_clip"] < 0.95 * result["weight_error"]["rtn_minmax"]
    assert result["output_error"]["mse_clip"] < result["output_error"]["rtn_minmax"]
    assert result["reload_max_abs_diff"] <= 1e-5
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["strategy"]) == (4, "channel")
    assert "MSEClipModifier" in (out / "recipe.yaml").read_text()


def eval_ppl(model: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-m", "seqcal.cli", "eval", "ppl", "--model", str(model), "--eval-seq-length", "32",
         "--eval-windows", "2"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc


def test_eval_ppl_without_wikitext_uses_the_embedded_text_and_says_so(tiny_dir: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"  # no shared/data next to it: the command falls back to the embedded text
    repo.mkdir()
    proc = eval_ppl(tiny_dir, repo)
    assert "perplexity on the embedded calibration text" in proc.stdout
    assert "not WikiText-2" in proc.stdout and "quantization loss looks smaller" in proc.stdout


def test_eval_ppl_reads_wikitext_next_to_the_repository_when_there(tiny_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "shared" / "data" / "wiki.test.raw").write_text(" = Title = \n" + default_calibration_text())
    proc = eval_ppl(tiny_dir, tmp_path / "repo")
    assert "perplexity on " + str(tmp_path / "shared" / "data" / "wiki.test.raw") in proc.stdout
    assert "embedded" not in proc.stdout


def test_custom_transform_folds_into_the_norms_and_its_checkpoint_reloads(
    tiny_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "ckpt"
    proc = run_example(
        "custom_transform.py", "--model", str(tiny_dir), "--output-dir", str(out), cwd=tmp_path
    )
    error = float(proc.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1])
    assert error < 0.05  # int8 weights and activations on equalized inputs: close to full precision
    saved, original = load_file(out / "model.safetensors"), load_file(tiny_dir / "model.safetensors")
    for norm in ("input_layernorm", "post_attention_layernorm"):
        key = f"model.layers.1.{norm}.weight"
        assert not torch.equal(saved[key], original[key])  # the folded scales were saved
    assert "SqrtEqualize" in (out / "recipe.yaml").read_text()


def test_learned_rounding_lowers_the_mlp_error_and_its_checkpoint_reloads(
    tiny_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "ckpt"
    proc = run_example(
        "learned_rounding.py", "--model", str(tiny_dir), "--output-dir", str(out), cwd=tmp_path
    )
    words = proc.stdout.strip().splitlines()[-1].replace(",", "").split()
    rtn, learned = float(words[words.index("nearest") + 1]), float(words[-1])
    assert learned < 0.9 * rtn  # the signed descent found better roundings than round to nearest
    saved = load_file(out / "model.safetensors")
    assert "model.layers.0.mlp.down_proj.weight_packed" in saved
    assert "model.layers.0.self_attn.q_proj.weight" in saved  # not targeted: full precision
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    reference = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    got = reload_logits(out, ids)
    assert ((got - want).norm() / want.norm()).item() < 0.1


def test_gemma3_and_whisper_examples_calibrate_on_images_and_audio(tmp_path: Path) -> None:
    import numpy as np

    import mm_helpers as mh

    gemma, _ = mh.save_tiny("gemma3", tmp_path)
    (tmp_path / "images").mkdir()
    for i in range(2):
        mh.image(i, 16).save(tmp_path / "images" / f"{i}.png")
    scheme = ["--scheme", "W8A8", "--num-calibration-samples", "2", "--max-seq-length", "64"]
    proc = run_example("gemma3_images.py", "--model", str(gemma), "--images", str(tmp_path / "images"),
                       "--output-dir", str(tmp_path / "g"), *scheme, cwd=tmp_path)  # fmt: skip
    assert "reloads as Gemma3ForConditionalGeneration" in proc.stdout
    whisper, _ = mh.save_tiny("whisper", tmp_path)
    (tmp_path / "audio").mkdir()
    for i in range(2):
        np.save(tmp_path / "audio" / f"{i}.npy", np.random.default_rng(i).normal(size=1600).astype("f4"))
    proc = run_example("whisper_audio.py", "--model", str(whisper), "--audio", str(tmp_path / "audio"),
                       "--output-dir", str(tmp_path / "w"), *scheme, cwd=tmp_path)  # fmt: skip
    assert "reloads as WhisperForConditionalGeneration" in proc.stdout


def _qwen_example_runs_here() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("torchvision", "qwen_vl_utils"))


@pytest.mark.skipif(
    not _qwen_example_runs_here(),
    reason="the Qwen2.5-VL example loads Qwen's processor with AutoProcessor, which needs torchvision, and "
    "reads images with qwen_vl_utils; neither is installed (CPU-only torch)",
)
def test_qwen2_5_vl_example_calibrates_on_images(tmp_path: Path) -> None:
    """Needs torchvision for the processor as the example builds it; seqcal's own routes do without it."""
    import transformers

    import mm_helpers as mh
    from test_multimodal_cli import qwen_template

    model, _ = mh.save_tiny("qwen2_5_vl", tmp_path)
    images = transformers.Qwen2VLImageProcessor(patch_size=2, merge_size=2, temporal_patch_size=2,
                                                min_pixels=64, max_pixels=64)  # fmt: skip
    video = transformers.Qwen2VLVideoProcessor(patch_size=2, merge_size=2, temporal_patch_size=2)
    transformers.Qwen2_5_VLProcessor(image_processor=images, tokenizer=mh.tokenizer("qwen2_5_vl"),
                                     video_processor=video, chat_template=qwen_template()).save_pretrained(str(model))  # fmt: skip
    (tmp_path / "images").mkdir()
    for i in range(2):
        mh.image(i, 32).save(tmp_path / "images" / f"{i}.png")
    proc = run_example("qwen2_5_vl_images.py", "--model", str(model), "--images", str(tmp_path / "images"),
                       "--output-dir", str(tmp_path / "q"), "--scheme", "W8A8", "--num-calibration-samples",
                       "2", "--max-seq-length", "64", cwd=tmp_path)  # fmt: skip
    assert "reloads as Qwen2_5_VLForConditionalGeneration" in proc.stdout
