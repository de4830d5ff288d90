"""The command line on the tiny vision-language and speech models: ``seqcal oneshot --model DIR --dataset
rows.jsonl``, the rows naming image or audio files relative to the file, the processor read from ``DIR``.

Each checkpoint must hold the language model's Linears packed and the vision or audio tower as it was, reload
with the model's own class, and carry the processor's files. Qwen2.5-VL's and Qwen3-VL's processors need
torchvision for their video part; where it is missing (as on a CPU-only torch) seqcal loads them without it,
and the inputs they make must be exactly those of the image processor and tokenizer they are made of.
(Mistral 3's and Llama 4's processors need torchvision as a whole: they are calibrated through Python in
``test_multimodal_more`` and ``test_multimodal``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import mm_helpers as mh
import mm_more
import test_multimodal
import test_multimodal_more
from seqcal.cli import main
from seqcal.multimodal.processor import load_processor
from test_multimodal import tensors

QWEN_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
# The models and recipes of the Python-route tests (Llava's command line is tested in test_multimodal_rows;
# Mistral 3's Pixtral processor needs torchvision as a whole).
ARCHS = ["gemma3", "idefics3", "mllama", "qwen2_5_vl", "qwen3_vl", "whisper", "qwen2_audio"]
KEPT = (*test_multimodal.SKIPPED, *test_multimodal_more.KEPT)  # parts of the names of what stays unquantized


def recipe(arch: str) -> dict:
    return (
        test_multimodal.recipe(arch) if arch in test_multimodal.IGNORED else test_multimodal_more.recipe(arch)
    )


def quantized_part(arch: str) -> str:
    """A part of every quantized Linear's name in the checkpoint."""
    return {**test_multimodal.IGNORED, **test_multimodal_more.IGNORED}[arch][1]


SIDE = {**mm_more.IMAGE_SIDE, **mh.IMAGE_SIDE}


def save_with_processor(arch: str, root: Path) -> tuple[Path, object]:
    """The tiny model's directory with its processor's files in it, as a Hub snapshot holds them.

    The Qwen processors built here are their parts (their own class needs torchvision to be built): the
    files written are what transformers writes for the real one (image processor config naming the processor
    class, tokenizer, chat template)."""
    path, proc = mh.save_tiny(arch, root)
    if arch in ("qwen2_5_vl", "qwen3_vl"):
        config = path / "preprocessor_config.json"
        name = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}[arch]
        config.write_text(json.dumps({**json.loads(config.read_text()), "processor_class": name}))
        (path / "chat_template.jinja").write_text(qwen_template())
    return path, proc


def qwen_template() -> str:
    return mm_more.template("qwen3_vl").replace(mm_more.MARKERS["qwen3_vl"], QWEN_MARKER)


def rows_file(arch: str, folder: Path) -> Path:
    """Three JSON lines, each naming a file (relative to the file) in its own row shape."""
    (folder / "media").mkdir()
    rows = []
    for i in range(3):
        words = " ".join(mh.WORDS[(i + k) % len(mh.WORDS)] for k in range(3 + i))
        if arch in ("whisper", "qwen2_audio"):
            rate = 1600 if arch == "whisper" else 16000
            mh.write_wav(
                folder / "media" / f"{i}.wav", np.random.default_rng(i).uniform(-0.5, 0.5, rate), rate
            )
            item = {"type": "audio", "audio": f"media/{i}.wav"}
            if arch == "whisper":  # a speech model's row: the audio and its transcript
                rows.append({"audio": f"media/{i}.wav", "text": words})
                continue
        else:
            mh.image(i, SIDE[arch]).save(folder / "media" / f"{i}.png")
            item = {"type": "image", "image": f"media/{i}.png"}
        content = [item, {"type": "text", "text": f"{mh.PROMPT} {words}"}]
        rows.append({"messages": [{"role": "user", "content": content}]})
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "rows.jsonl"


@pytest.mark.parametrize("arch", ARCHS)
def test_jsonl_rows_calibrate_from_the_command_line(arch: str, tmp_path: Path) -> None:
    path, _ = save_with_processor(arch, tmp_path)
    (tmp_path / "r.json").write_text(json.dumps(recipe(arch)))
    out = tmp_path / "out"
    assert main(["oneshot", "--model", str(path), "--dataset", str(rows_file(arch, tmp_path)), "--recipe",
                 str(tmp_path / "r.json"), "--output-dir", str(out), "--max-seq-length", "128",
                 "--plot", "none"]) == 0  # fmt: skip

    saved, original = tensors(out), tensors(path)
    packed = [k for k in saved if k.endswith("weight_packed")]
    assert packed and all(quantized_part(arch) in k and not any(p in k for p in KEPT) for k in packed)
    kept = [k for k in original if any(p in k for p in KEPT)]
    assert kept and all(torch.equal(saved[k], original[k]) for k in kept)
    cls = getattr(transformers, json.loads((path / "config.json").read_text())["architectures"][0])
    assert json.loads((out / "config.json").read_text())["architectures"] == [cls.__name__]
    reloaded = cls.from_pretrained(out, dtype=torch.float32)
    assert not any(p.is_meta for p in reloaded.parameters())
    assert any((out / name).is_file() for name in ("preprocessor_config.json", "processor_config.json"))


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_processors_load_without_their_video_part(arch: str, tmp_path: Path) -> None:
    """Without torchvision: the processor's own class, no video processor, and the inputs of its parts."""
    path, parts = save_with_processor(arch, tmp_path)
    processor = load_processor(path)
    name = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}[arch]
    assert isinstance(processor, getattr(transformers, name))
    image, text = mh.image(3, SIDE[arch]), f"{QWEN_MARKER} {mh.PROMPT}"
    got = processor(text=text, images=image)
    want = parts(text=text.replace(QWEN_MARKER, parts_marker(arch)), images=image)
    for key in ("input_ids", "pixel_values", "image_grid_thw"):
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))


def parts_marker(arch: str) -> str:
    """The marker the test's processor of ``arch`` expands (with or without spaces)."""
    return {"qwen2_5_vl": "<|vision_start|> <|image_pad|> <|vision_end|>", "qwen3_vl": QWEN_MARKER}[arch]


def test_trace_takes_qwen_image_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``seqcal trace --dataset rows.jsonl`` on Qwen2.5-VL: the vision tower is in the graph, checked on rows."""
    path, _ = save_with_processor("qwen2_5_vl", tmp_path)
    rows = rows_file("qwen2_5_vl", tmp_path)
    assert (
        main(["trace", "--model", str(path), "--dataset", str(rows), "--check", "--max-seq-length", "64"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "pixel_values" in printed and "OK" in printed


def test_trace_without_rows_traces_a_vlm_on_text_and_refuses_a_speech_model(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    vlm, _ = save_with_processor("qwen2_5_vl", tmp_path)
    assert main(["trace", "--model", str(vlm)]) == 0
    captured = capsys.readouterr()
    assert "Qwen2_5_VLForConditionalGeneration: 3 targets" in captured.out
    assert "traced on text alone" in captured.err
    speech, _ = save_with_processor("whisper", tmp_path)
    assert main(["trace", "--model", str(speech)]) == 2
    assert "is a speech model (WhisperConfig): its forward needs audio" in capsys.readouterr().err
