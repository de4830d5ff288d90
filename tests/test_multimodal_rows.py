"""seqcal's own route for images and audio: raw rows (chat messages with image or audio items, image or audio
columns beside the text, JSON lines naming files) through the model's processor and chat template.

The batches must be exactly what the processor makes of the rendered chat and the images; a JSON lines file
calibrates from the command line with paths relative to it; images the processor cannot batch together are
grouped by size; a missing file is named with its line before anything is written. No network: URLs are
only checked to be fetched by transformers' loader when given.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import mm_helpers as mh
from seqcal import oneshot
from seqcal.cli import main
from seqcal.data.args import CalibrationDataError, DataArgs, PreparedBatches
from seqcal.multimodal.run import own_route
from test_multimodal import recipe, tensors

QUESTION = "what does this image shows"


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, torch.nn.Module]:
    """The tiny Llava directory (processor with a chat template), its processor and model."""
    path, proc = mh.save_tiny("llava", tmp_path_factory.mktemp("llava"))
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, proc, model


def chat(image: object) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": QUESTION}]}]}  # fmt: skip


def route(dataset: object, model: torch.nn.Module, proc: object = None, source: Path | None = None, **kw):
    args = DataArgs(
        dataset,
        num_calibration_samples=kw.pop("n", 8),
        max_seq_length=64,
        shuffle_calibration_samples=False,
        **kw,
    )
    return own_route(args, model, proc, source).dataset


def test_chat_rows_become_exactly_the_processors_inputs(llava) -> None:
    path, proc, model = llava
    images = [mh.image(0, 8), mh.image(1, 8)]
    got = route([chat(im) for im in images], model, proc, batch_size=2)
    assert isinstance(got, PreparedBatches) and len(got) == 1
    text = proc.apply_chat_template(chat(None)["messages"], tokenize=False)
    want = proc(text=[text, text], images=images, return_tensors="pt", padding=True)
    assert set(got[0]) == set(want) and {"pixel_values", "input_ids"} <= set(want)
    assert all(torch.equal(got[0][k], want[k]) for k in want)
    # An image column beside the text is the same chat, wrapped in one user turn.
    column = route([{"text": QUESTION, "image": im} for im in images], model, proc, batch_size=2)
    assert all(torch.equal(column[0][k], want[k]) for k in want)


def test_a_datasets_dataset_with_an_image_column(llava, tmp_path: Path) -> None:
    from datasets import Dataset

    _, proc, model = llava
    mh.image(0, 8).save(tmp_path / "a.png")
    ds = Dataset.from_list(
        [{"text": QUESTION, "image": str(tmp_path / "a.png")}, {"text": QUESTION, "image": None}]
    )
    got = route(ds, model, proc, batch_size=1)
    assert (
        len(got) == 2 and "pixel_values" in got[0] and "pixel_values" not in got[1]
    )  # a text row in between
    want = route([chat(mh.image(0, 8))], model, proc)[0]
    assert all(torch.equal(got[0][k], want[k]) for k in want)


def test_a_preprocessing_function_maps_raw_rows_itself(llava) -> None:
    """With preprocessing_func= (llm-compressor's route) the rows are the function's, not seqcal's to map."""
    from seqcal.multimodal.inputs import MediaArgs
    from seqcal.multimodal.run import prepare_media

    _, proc, model = llava
    seen = []

    def preprocess(row: dict) -> dict:
        seen.append(row["text"])
        return dict(proc(text=f"<image> {row['text']}", images=row["image"], return_tensors="pt"))

    rows = [{"text": QUESTION, "image": mh.image(0, 8)}]
    args = DataArgs(rows, num_calibration_samples=1, max_seq_length=64, batch_size=1)
    got = prepare_media(args, model, MediaArgs(preprocessing_func=preprocess), proc, None).data_args.dataset
    assert seen == [QUESTION] and len(got) == 1 and "pixel_values" in got[0]


def test_images_the_processor_cannot_batch_are_grouped_by_size(llava) -> None:
    _, _, model = llava
    raw = mh.processor("llava")
    raw.image_processor.do_resize = raw.image_processor.do_center_crop = False  # sizes kept: not stackable
    images = [mh.image(0, 8), mh.image(1, 12), mh.image(2, 8)]
    got = route([chat(im) for im in images], model, raw, batch_size=3)
    assert sorted(tuple(b["pixel_values"].shape) for b in got) == [(1, 3, 12, 12), (2, 3, 8, 8)]
    assert sum(b["input_ids"].shape[0] for b in got) == 3  # every row in one of the groups


def test_a_url_is_fetched_only_when_given(llava, monkeypatch: pytest.MonkeyPatch) -> None:
    _, proc, model = llava
    fetched = []
    monkeypatch.setattr(
        transformers.image_utils, "load_image", lambda url: fetched.append(url) or mh.image(0, 8)
    )
    route([chat(mh.image(1, 8))], model, proc)
    assert fetched == []
    route([chat("https://example.org/cat.png")], model, proc)
    assert fetched == ["https://example.org/cat.png"]


def test_jsonl_rows_calibrate_from_the_command_line(llava, tmp_path: Path) -> None:
    path, _, _ = llava
    (tmp_path / "img").mkdir()
    for i, side in enumerate((8, 12, 16)):
        mh.image(i, side).save(tmp_path / "img" / f"{i}.png")
    rows = [
        chat("img/0.png"),
        chat(str(tmp_path / "img" / "1.png")),
        {"text": QUESTION, "image": "img/2.png"},
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "r.json").write_text(json.dumps(recipe("llava")))
    out = tmp_path / "out"
    assert main(["oneshot", "--model", str(path), "--dataset", str(tmp_path / "rows.jsonl"), "--recipe",
                 str(tmp_path / "r.json"), "--output-dir", str(out), "--batch-size", "2",
                 "--max-seq-length", "64", "--plot", "none"]) == 0  # fmt: skip
    saved = tensors(out)
    assert any(k.endswith("weight_packed") and "language_model" in k for k in saved)
    assert (out / "processor_config.json").is_file()


def test_a_missing_image_is_named_with_its_line_before_anything_is_written(llava, tmp_path: Path) -> None:
    path, _, _ = llava
    mh.image(0, 8).save(tmp_path / "a.png")
    (tmp_path / "rows.jsonl").write_text(
        json.dumps(chat("a.png")) + "\n\n" + json.dumps(chat("gone.png")) + "\n"
    )
    out = tmp_path / "never"
    from seqcal import oneshot

    with pytest.raises(CalibrationDataError, match=r"rows\.jsonl:3: a 'image' item names the file 'gone\.png', "
                       r"which does not exist \(relative paths are read from "):  # fmt: skip
        oneshot(model=str(path), dataset=str(tmp_path / "rows.jsonl"), recipe=recipe("llava"),
                output_dir=str(out), max_seq_length=64)  # fmt: skip
    assert not out.exists()


def test_a_directory_without_a_processor_is_refused_for_image_rows(llava, tmp_path: Path) -> None:
    _, _, model = llava
    with pytest.raises(
        CalibrationDataError, match="hold images or audio, but the directory .* has no processor"
    ):
        route([chat(mh.image(0, 8))], model, None, tmp_path)


def test_chat_rows_need_a_chat_template(llava) -> None:
    _, _, model = llava
    raw = mh.processor("llava")
    raw.chat_template = None
    with pytest.raises(CalibrationDataError, match="row 0: chat rows need the processor's chat template"):
        route([chat(mh.image(0, 8))], model, raw)


def test_a_row_the_processor_refuses_is_named_with_the_reason(llava) -> None:
    _, _, model = llava
    raw = mh.processor("llava")
    raw.chat_template = None  # the text is used as given: without the <image> marker, the image has no place
    with pytest.raises(CalibrationDataError, match=r"row 0: the processor LlavaProcessor could not process the "
                       r"row \(.*image"):  # fmt: skip
        route([{"text": QUESTION, "image": mh.image(0, 8)}], model, raw)


def test_audio_rows_give_features_and_decoder_ids(tmp_path: Path) -> None:
    path, proc = mh.save_tiny("whisper", tmp_path)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(path).eval()
    wave_ = np.random.default_rng(0).uniform(-0.5, 0.5, 1600).astype("f4")
    mh.write_wav(tmp_path / "a.wav", wave_, 3200)  # twice the processor's rate: resampled to 1600 Hz
    rows = [
        {"audio": str(tmp_path / "a.wav"), "text": "the cat"},
        {"audio": {"array": wave_, "sampling_rate": 1600}},
    ]
    got = route(rows, model, None, path)  # the processor from the directory
    start = model.config.decoder_start_token_id
    assert got[0]["decoder_input_ids"].tolist() == [[start, *proc.tokenizer("the cat").input_ids]]
    assert got[1]["decoder_input_ids"].tolist() == [[start]]
    want = proc.feature_extractor(wave_, sampling_rate=1600, return_tensors="pt").input_features
    assert torch.equal(got[1]["input_features"], want)
    resampled = got[0]["input_features"]  # 800 samples read back at 16 bits, resampled: close, not equal
    assert resampled.shape == want.shape and not torch.equal(resampled, want)


def test_trace_takes_image_rows_and_checks_the_partition_on_them(llava, tmp_path: Path, capsys) -> None:
    path, _, _ = llava
    mh.image(0, 8).save(tmp_path / "a.png")
    mh.image(1, 12).save(tmp_path / "b.png")
    rows = [chat("a.png"), {"text": f"{QUESTION} the red cat", "image": "b.png"}]  # two lengths: padded
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    graph = tmp_path / "graph.json"
    assert main(["trace", "--model", str(path), "--dataset", str(tmp_path / "rows.jsonl"), "--check",
                 "--export", str(graph)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "check on a padded batch of (2, " in out and "OK" in out
    inputs = {
        n["name"]: n["shapes"] for n in json.loads(graph.read_text())["nodes"] if n["op"] == "placeholder"
    }
    assert inputs["pixel_values"] == [[1, 3, 8, 8]]  # traced on the first row's image


def test_plan_takes_the_image_rows_lengths(llava, tmp_path: Path, capsys) -> None:
    """``seqcal plan --dataset rows.jsonl``: the plan is made at the rows' count and their longest length with the
    images' tokens, as the processor expands them (reading no weights)."""
    path, proc, _ = llava
    mh.image(0, 8).save(tmp_path / "a.png")
    rows = [chat("a.png"), {"text": f"{QUESTION} the red cat on a blue photo", "image": "a.png"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "r.json").write_text(json.dumps(recipe("llava")))
    longest = len(
        proc(text=f"<image> {QUESTION} the red cat on a blue photo", images=mh.image(0, 8))["input_ids"][0]
    )
    assert longest > len(f"{QUESTION} the red cat on a blue photo".split()) + 1  # the image's tokens counted
    assert main(["plan", "--model", str(path), "--recipe", str(tmp_path / "r.json"), "--dataset",
                 str(tmp_path / "rows.jsonl"), "--max-seq-length", "64"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "2 image or audio rows" in out and f"planned at 2 x {longest}\n" in out
    want = oneshot(model=str(path), recipe=recipe("llava"), num_calibration_samples=2, max_seq_length=longest,
                   dry_run=True, dataset=[]).table()  # fmt: skip
    assert want in out


def test_plan_refuses_a_row_longer_than_max_seq_length(llava, tmp_path: Path, capsys) -> None:
    path, _, _ = llava
    mh.image(0, 8).save(tmp_path / "a.png")
    (tmp_path / "rows.jsonl").write_text(json.dumps(chat("a.png")) + "\n")
    (tmp_path / "r.json").write_text(json.dumps(recipe("llava")))
    assert main(["plan", "--model", str(path), "--recipe", str(tmp_path / "r.json"), "--dataset",
                 str(tmp_path / "rows.jsonl"), "--max-seq-length", "4"]) != 0  # fmt: skip
    assert "more than max_seq_length=4" in capsys.readouterr().err
