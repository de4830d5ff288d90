"""Whisper calibrated on audio, written as llm-compressor's Whisper example with only the import changed.

Each row is a waveform; the processor turns it into log-mel ``input_features`` and the decoder starts from
the model's start-of-transcript ids. The whole encoder-decoder is calibrated (its encoder kept), and the
checkpoint reloads as WhisperForConditionalGeneration.

Run:
    python examples/whisper_audio.py --model DIR --audio FOLDER_OF_NPY_WAVEFORMS --output-dir out/whisper
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from transformers import WhisperForConditionalGeneration, WhisperProcessor

from seqcal import oneshot
from seqcal.modifiers import GPTQModifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Whisper directory or Hub id (with its processor)")
    parser.add_argument("--audio", required=True, help="a folder of .npy mono waveforms at the model's rate")
    parser.add_argument("--scheme", default="W4A16")
    parser.add_argument("--num-calibration-samples", type=int, default=64)
    parser.add_argument("--max-seq-length", type=int, default=2048)
    parser.add_argument("--output-dir", default="out/examples/whisper")
    args = parser.parse_args()

    model = WhisperForConditionalGeneration.from_pretrained(args.model, dtype="auto")
    model.config.forced_decoder_ids = None
    processor = WhisperProcessor.from_pretrained(args.model)
    rate = processor.feature_extractor.sampling_rate

    files = sorted(Path(args.audio).glob("*.npy"))[: args.num_calibration_samples]
    ds = Dataset.from_dict(
        {"array": [np.load(f).tolist() for f in files], "sampling_rate": [rate] * len(files)}
    )

    def process(sample: dict) -> dict:
        features = processor(sample["array"], sampling_rate=sample["sampling_rate"], return_tensors="pt")
        decoder_input_ids = [[model.config.decoder_start_token_id]]  # the task context starts here
        return {"input_features": features.input_features, "decoder_input_ids": decoder_input_ids}

    ds = ds.map(process, remove_columns=ds.column_names)

    def data_collator(batch: list[dict]) -> dict:
        assert len(batch) == 1
        return {key: torch.tensor(value) for key, value in batch[0].items()}

    # proj_out is Whisper's output head, tied to the decoder's embeddings: it stays in full precision
    recipe = GPTQModifier(targets="Linear", scheme=args.scheme, ignore=["proj_out"])
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
    reloaded = WhisperForConditionalGeneration.from_pretrained(args.output_dir)
    print(f"saved {args.output_dir}; reloads as {type(reloaded).__name__}")


if __name__ == "__main__":
    main()
