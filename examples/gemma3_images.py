"""Gemma 3 calibrated on images, written as llm-compressor's Gemma 3 example with only the import changed.

The rows are mapped through the model's processor (chat template with an image, then the processor), the
collator turns one row into a batch, and every input (pixel_values, token_type_ids, ...) reaches the model.
The vision tower and projector stay in full precision; the processor is saved beside the checkpoint.

Run:
    python examples/gemma3_images.py --model DIR --images FOLDER_OF_PNG_OR_JPG --output-dir out/gemma3
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from datasets import Dataset
from PIL import Image
from transformers import AutoProcessor, Gemma3ForConditionalGeneration

from seqcal import oneshot
from seqcal.modifiers import GPTQModifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Gemma 3 directory or Hub id (with its processor)")
    parser.add_argument("--images", required=True, help="a folder of calibration images")
    parser.add_argument("--scheme", default="W4A16")
    parser.add_argument("--num-calibration-samples", type=int, default=64)
    parser.add_argument("--max-seq-length", type=int, default=2048)
    parser.add_argument("--output-dir", default="out/examples/gemma3")
    args = parser.parse_args()

    model = Gemma3ForConditionalGeneration.from_pretrained(args.model, dtype="auto")
    processor = AutoProcessor.from_pretrained(args.model)

    files = sorted(p for p in Path(args.images).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    ds = Dataset.from_dict({"path": [str(p) for p in files[: args.num_calibration_samples]]})

    def preprocess_and_tokenize(example: dict) -> dict:
        messages = [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "What does the image show?"}]}]  # fmt: skip
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        image = Image.open(example["path"]).convert("RGB")
        return processor(text=text, images=image, max_length=args.max_seq_length, truncation=True)

    ds = ds.map(preprocess_and_tokenize, remove_columns=ds.column_names)

    def data_collator(batch: list[dict]) -> dict:
        assert len(batch) == 1
        return {key: torch.tensor(value) for key, value in batch[0].items()}

    recipe = GPTQModifier(
        targets="Linear",
        scheme=args.scheme,
        ignore=["lm_head", r"re:model\.vision_tower.*", r"re:model\.multi_modal_projector.*"],
    )
    oneshot(
        model=model,
        processor=processor,
        dataset=ds,
        recipe=recipe,
        max_seq_length=args.max_seq_length,
        num_calibration_samples=args.num_calibration_samples,
        data_collator=data_collator,
        output_dir=args.output_dir,
    )
    reloaded = Gemma3ForConditionalGeneration.from_pretrained(args.output_dir)
    print(f"saved {args.output_dir}; reloads as {type(reloaded).__name__}")


if __name__ == "__main__":
    main()
