"""SHA-256 of every tensor of the checkpoints the recipes below write for a tiny random Llama: a quick guard that a
refactor keeps every byte (benchmarks/checkpoint_hashes.py is the SmolLM2 one, minutes per recipe).

Usage: run it with two checkouts' sources and compare the two JSON files:
    PYTHONPATH=<checkout>/src .venv/bin/python benchmarks/tiny_bytes.py --out a.json
    cmp a.json b.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

RECIPES = {
    "gptq_w4a16_g32": "GPTQModifier: {ignore: [lm_head], config_groups: {g: {targets: [Linear], weights: "
    "{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}}}}",
    "awq_w4a16_asym": "AWQModifier: {scheme: W4A16_ASYM, ignore: [lm_head], n_grid: 6, config_groups: null}",
    "smoothquant_gptq_w8a8": "SmoothQuantModifier: {smoothing_strength: 0.5}\n"
    "GPTQModifier: {scheme: W8A8, ignore: [lm_head]}",
    "gptq_nvfp4": "GPTQModifier: {scheme: NVFP4, ignore: [lm_head]}",
    "sparsegpt_2of4_gptq_w4a16": "SparseGPTModifier: {sparsity: 0.5, mask_structure: '2:4', ignore: [lm_head]}\n"
    "GPTQModifier: {scheme: W4A16, ignore: [lm_head]}",
    "imatrix_w4a16": "QuantizationModifier: {scheme: W4A16, ignore: [lm_head], weight_observer: imatrix_mse}",
    "wanda_50": "WandaPruningModifier: {sparsity: 0.5, ignore: [lm_head]}",
    "fp8_static_kv_fp8": "QuantizationModifier: {scheme: FP8, ignore: [lm_head], kv_cache_scheme: {num_bits: 8, "
    "type: float, strategy: tensor, dynamic: false, symmetric: true}}",
}


def _pad_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose only use here is its pad token (id 0): the rows are token ids already."""
    backend = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "[UNK]": 1}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="<pad>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ragged", action="store_true", help="rows of 9 to 24 tokens, 3 per padded batch")
    args = parser.parse_args()
    from seqcal import oneshot

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    rows = [
        {
            "input_ids": (
                torch.randint(-3, 4, (24 - 3 * i * args.ragged,), generator=g).cumsum(0) % 256
            ).tolist()
        }
        for i in range(6)
    ]
    out: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama"
        LlamaForCausalLM(config).save_pretrained(model_dir)
        if args.ragged:  # batches of 3 rows padded to the longest need a pad token
            _pad_tokenizer().save_pretrained(model_dir)
        for name, recipe in RECIPES.items():
            target = Path(tmp) / name
            oneshot(model=str(model_dir), dataset=rows, recipe=recipe, max_seq_length=24, output_dir=str(target),
                    batch_size=3 if args.ragged else None)  # fmt: skip
            hashes = {}
            for file in sorted(target.glob("*.safetensors")):
                with safe_open(str(file), "pt") as f:
                    for key in f.keys():
                        raw = f.get_tensor(key).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                        hashes[key] = hashlib.sha256(raw).hexdigest()
            out[name] = hashes
            print(name, len(hashes), "tensors", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
