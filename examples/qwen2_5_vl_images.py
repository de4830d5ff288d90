"""Qwen2.5-VL calibrated on images, written as llm-compressor's Qwen2.5-VL example with only the import changed.

Each image goes into a chat message as a base64 data URI, ``qwen_vl_utils.process_vision_info`` (Qwen's
helper, ``pip install qwen-vl-utils``) reads it back, and the processor turns text and image into
``input_ids``, ``pixel_values`` and ``image_grid_thw``; the collator makes one row a batch. The decoder layers
are the sequential targets; the vision tower stays in full precision; the processor is saved beside the
checkpoint. Like llm-compressor's, the example loads the processor with ``AutoProcessor``, which for
Qwen2.5-VL needs torchvision (its video part); seqcal's own routes (chat rows, ``seqcal oneshot --dataset
rows.jsonl``) do without it.

Run:
    python examples/qwen2_5_vl_images.py --model DIR --images FOLDER_OF_PNG_OR_JPG --output-dir out/qwen2_5_vl
"""

from __future__ import annotations

import argparse
import base64
from io import BytesIO
from pathlib import Path

import torch
from datasets import Dataset
from PIL import Image
from qwen_vl_utils import process_vision_info
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from seqcal import oneshot
from seqcal.modifiers import GPTQModifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", required=True, help="a Qwen2.5-VL directory or Hub id (with its processor)"
    )
    parser.add_argument("--images", required=True, help="a folder of calibration images")
    parser.add_argument("--scheme", default="W4A16")
    parser.add_argument("--num-calibration-samples", type=int, default=512)
    parser.add_argument("--max-seq-length", type=int, default=2048)
    parser.add_argument("--output-dir", default="out/examples/qwen2_5_vl")
    args = parser.parse_args()

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model, dtype="auto")
    processor = AutoProcessor.from_pretrained(args.model, trust_remote_code=True)

    files = sorted(p for p in Path(args.images).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    ds = Dataset.from_dict({"path": [str(p) for p in files[: args.num_calibration_samples]]})
    ds = ds.shuffle(seed=42)

    def preprocess_and_tokenize(example: dict) -> dict:
        buffered = BytesIO()
        Image.open(example["path"]).convert("RGB").save(buffered, format="PNG")
        encoded_image = base64.b64encode(buffered.getvalue()).decode("utf-8")
        base64_qwen = f"data:image;base64,{encoded_image}"
        messages = [{"role": "user", "content": [
            {"type": "image", "image": base64_qwen}, {"type": "text", "text": "What does the image show?"}]}]  # fmt: skip
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        image_inputs, video_inputs = process_vision_info(messages)
        return processor(text=[text], images=image_inputs, videos=video_inputs, padding=False,
                         max_length=args.max_seq_length, truncation=True)  # fmt: skip

    ds = ds.map(preprocess_and_tokenize, remove_columns=ds.column_names)

    def data_collator(batch: list[dict]) -> dict:
        assert len(batch) == 1
        return {key: torch.tensor(value) for key, value in batch[0].items()}

    recipe = [
        GPTQModifier(
            targets="Linear",
            scheme=args.scheme,
            sequential_targets=["Qwen2_5_VLDecoderLayer"],
            ignore=["lm_head", "re:visual.*", "re:model.visual.*"],
        ),
    ]
    oneshot(
        model=model,
        tokenizer=args.model,
        dataset=ds,
        recipe=recipe,
        max_seq_length=args.max_seq_length,
        num_calibration_samples=args.num_calibration_samples,
        data_collator=data_collator,
        output_dir=args.output_dir,
    )
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.output_dir)
    print(f"saved {args.output_dir}; reloads as {type(reloaded).__name__}")


if __name__ == "__main__":
    main()
