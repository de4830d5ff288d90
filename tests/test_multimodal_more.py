"""More vision-language and speech architectures calibrated on images or audio through seqcal's own route.

Idefics3, Mistral 3 (Pixtral vision), Qwen3-VL (deepstack), Mllama (images through cross-attention) and
Qwen2-Audio: chat rows with image or audio items, two rows per batch (images or audio of different sizes), go
through each model's processor. The checkpoint must reload with the model's own class and give seqcal's
fake-quantized logits; only the language model's Linears are quantized, the vision or audio tower and the
projector are stored as they were. The media reach the language model: Mllama's cross-attention keys and
values are calibrated on the image features, and silent audio gives Qwen2-Audio another checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import mm_helpers as mh
from mm_more import IMAGE_SIDE
from seqcal import oneshot
from seqcal.multimodal.rows import batches, media_rows, sampling_rate
from test_multimodal import tensors

# model -> (modules the recipe keeps in full precision, a part of every quantized Linear's name)
IGNORED = {
    "idefics3": (["re:.*vision_model.*", "re:.*connector.*"], "text_model"),
    "mistral3": (["re:.*vision_tower.*", "re:.*multi_modal_projector.*"], "language_model"),
    "qwen3_vl": (["re:.*visual.*"], "language_model"),
    "mllama": (["re:.*vision_model.*", "re:.*multi_modal_projector.*"], "language_model"),
    "qwen2_audio": (["re:.*audio_tower.*", "re:.*multi_modal_projector.*"], "language_model"),
}
KEPT = ("vision_model", "connector", "vision_tower", "multi_modal_projector", "visual", "audio_tower")


def recipe(arch: str) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}
    return {"GPTQModifier": {"targets": "Linear", "ignore": ["lm_head", *IGNORED[arch][0]],
                             "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}}  # fmt: skip


def chat_rows(arch: str, n: int, blank: bool = False) -> list[dict]:
    """``n`` chat rows, each one image (two sizes alternating) or one clip of audio (two lengths), then text."""
    rows = []
    for i in range(n):
        if arch == "qwen2_audio":
            samples = 1600 if i % 2 == 0 else 800
            media = (
                np.zeros(samples, "f4")
                if blank
                else np.random.default_rng(i).normal(size=samples).astype("f4")
            )
            item = {"type": "audio", "audio": media}
        else:
            side = IMAGE_SIDE[arch] // (1 if i % 2 == 0 else 2)
            item = {"type": "image", "image": mh.image(i, side, blank)}
        words = " ".join(mh.WORDS[(i + k) % len(mh.WORDS)] for k in range(3 + i % 3))
        content = [item, {"type": "text", "text": f"{mh.PROMPT} {words}"}]
        rows.append({"messages": [{"role": "user", "content": content}]})
    return rows


def calibrate(arch: str, root: Path, blank: bool = False) -> tuple[Path, torch.nn.Module, Path, object]:
    path, proc = mh.save_tiny(arch, root)
    cls = getattr(transformers, json.loads((path / "config.json").read_text())["architectures"][0])
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    out = root / ("blank" if blank else "out")
    quantized = oneshot(model=model, processor=proc, dataset=chat_rows(arch, 4, blank), recipe=recipe(arch),
                        output_dir=str(out), max_seq_length=64, batch_size=2)  # fmt: skip
    return path, quantized, out, proc


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], tuple[Path, torch.nn.Module, Path, object]]:
    """``runs(arch)``: ``calibrate(arch)`` once per module (the tests share each run)."""
    done: dict[str, tuple[Path, torch.nn.Module, Path, object]] = {}

    def run(arch: str) -> tuple[Path, torch.nn.Module, Path, object]:
        if arch not in done:
            done[arch] = calibrate(arch, tmp_path_factory.mktemp(arch))
        return done[arch]

    return run


@pytest.mark.parametrize("arch", list(IGNORED))
def test_calibrated_on_chat_rows_reloads_with_its_class(arch: str, runs) -> None:
    path, quantized, out, proc = runs(arch)
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(quantized).__name__]
    saved, original = tensors(out), tensors(path)
    packed = [k for k in saved if k.endswith("weight_packed")]
    assert packed and all(IGNORED[arch][1] in k and not any(p in k for p in KEPT) for k in packed)
    kept = [k for k in original if any(part in k for part in KEPT)]
    assert kept and all(torch.equal(saved[k], original[k]) for k in kept)  # the tower and projector untouched

    reloaded = type(quantized).from_pretrained(out, dtype=torch.float32).eval()
    rows = chat_rows(arch, 2)
    batch = batches(media_rows(rows, ["r0", "r1"], None, sampling_rate(proc)), proc, quantized, 2)[0]
    with torch.no_grad():
        want, got = quantized(**batch).logits, reloaded(**batch).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_mllama_cross_attention_is_calibrated_on_the_image_features(runs) -> None:
    """The cross-attention keys and values see the vision tokens: 4 images x (2x2 patches + class token)."""
    _, _, out, _ = runs("mllama")
    modules = json.loads((out / "quantization_report.json").read_text())["modules"]
    cross = {k: v["tokens"] for k, v in modules.items() if ".cross_attn." in k}
    assert cross["model.language_model.layers.1.cross_attn.k_proj"] == 4 * (2 * 2 + 1)
    assert cross["model.language_model.layers.1.cross_attn.v_proj"] == 4 * (2 * 2 + 1)
    assert all(modules[k]["gptq_loss"] > 0 for k in cross)


def test_silent_audio_gives_another_checkpoint(runs, tmp_path: Path) -> None:
    _, _, real, _ = runs("qwen2_audio")
    _, _, blank, _ = calibrate("qwen2_audio", tmp_path, blank=True)
    a, b = tensors(real), tensors(blank)
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], b[k]) for k in a if k.endswith("weight_packed"))
    assert all(torch.equal(a[k], b[k]) for k in a if any(p in k for p in KEPT))


def test_an_offloaded_siglip_tower_with_its_pooling_head_runs() -> None:
    """SigLIP's pooling head is an nn.MultiheadAttention, whose forward reads out_proj.weight without calling
    out_proj: run offloaded, the safety hooks must onload it whole (it failed with "meta vs cpu" before)."""
    import copy

    from seqcal.execution.store import stage_in_memory
    from seqcal.execution.weights import safety_hooks

    config = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, image_size=8, patch_size=4)  # fmt: skip
    torch.manual_seed(0)
    eager = transformers.SiglipVisionModel(config).eval()
    assert type(eager.get_submodule("head.attention")).__name__ == "MultiheadAttention"
    model = copy.deepcopy(eager)
    store = stage_in_memory(model)  # every parameter on meta, its value in the store
    pixels = torch.randn(2, 3, 8, 8)
    with torch.no_grad(), safety_hooks(model, store, torch.device("cpu")):
        got = model(pixel_values=pixels).pooler_output
    with torch.no_grad():
        want = eager(pixel_values=pixels).pooler_output
    torch.testing.assert_close(got, want)
    assert all(p.device.type == "meta" for p in model.parameters())  # given back after the call
