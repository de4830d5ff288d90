"""The llm-compressor 0.14 side of ``benchmarks/peers/moe_peer_layout.py``; runs inside ``.peer-venv``.

Loads a tiny MoE checkpoint with ``from_pretrained``, runs ``oneshot`` with the
recipe and the pre-tokenized calibration samples it is given (oneshot linearizes the fused experts into
per-expert Linears itself and calibrates every expert on every token), and saves with ``save_compressed=True``.
It prints one line ``PEER {json}`` with the outcome (or the error) for the orchestrator.

Usage (by the orchestrator): ``.peer-venv/bin/python benchmarks/peers/_peer_moe.py --model DIR --tokens FILE
--recipe FILE --out DIR``
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from datasets import Dataset
from llmcompressor import oneshot
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast


def tokenizer() -> PreTrainedTokenizerFast:
    """A stand-in tokenizer: oneshot insists on a processor, though the samples are token ids already."""
    vocab = {f"t{i}": i for i in range(256)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", pad_token="t0")


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--tokens", "--recipe", "--out"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    tokens = load_file(args.tokens)["input_ids"]
    ds = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
    # oneshot linearizes the experts after loading (``linearize_moe``); ``load_quantizable_moe`` cannot be
    # used here: its patching imports every transformers module, vision processors (torchvision) included
    model, info = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, output_loading_info=True
    )
    bad = {
        k: sorted(v)
        for k, v in info.items()
        if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    start = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=args.recipe, num_calibration_samples=len(tokens), processor=tokenizer(),
            max_seq_length=tokens.shape[1], moe_calibrate_all_experts=True)  # fmt: skip
    seconds = time.perf_counter() - start
    model.save_pretrained(args.out, save_compressed=True)
    print("PEER " + json.dumps({"seconds": round(seconds, 1), "load_problems": bad}), flush=True)


if __name__ == "__main__":
    main()
