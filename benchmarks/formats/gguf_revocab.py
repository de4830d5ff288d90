"""One GGUF file's tensors under another's metadata: auto-round's file read with the tokenizer every other row has.

auto-round 0.16.1's GGUF converter writes SmolLM2's pre-tokenizer as ``smollm`` where seqcal's writer (and so the
f32 file ``llama-quantize`` starts from) writes ``gpt-2``; llama.cpp then cuts WikiText-2 test into other tokens
(304,830 against 304,839), so the windows ``llama-perplexity`` scores are not the same and the perplexities do not
compare. This writes ``--tensors``' tensors, bytes and types as they are, under ``--metadata``'s key-value pairs
(``general.file_type`` kept from ``--tensors``), so that every row is scored on the same tokens.

Usage (from the repo root):
    .venv/bin/python benchmarks/formats/gguf_revocab.py --metadata benchmarks/.work/gguf/f32/model.gguf \
        --tensors benchmarks/.work/gguf/autoround-q4_k_m/model.gguf --out benchmarks/.work/gguf/autoround-q4_k_m-vocab/model.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf

KEEP_FROM_TENSORS = ("general.file_type", "general.quantization_version")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metadata", required=True, type=Path)
    parser.add_argument("--tensors", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    meta, data = gguf.GGUFReader(args.metadata), gguf.GGUFReader(args.tensors)
    arch = meta.fields["general.architecture"].contents()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(args.out, arch)
    for source, keys in ((meta, [k for k in meta.fields if k not in KEEP_FROM_TENSORS]),
                         (data, [k for k in KEEP_FROM_TENSORS if k in data.fields])):  # fmt: skip
        for key in keys:
            field = source.fields[key]
            if key.startswith("GGUF.") or key == "general.architecture":
                continue  # written by the writer itself
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    for tensor in data.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape,
                          raw_dtype=tensor.tensor_type)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.out}: {len(data.tensors)} tensors of {args.tensors} under {args.metadata}'s metadata")


if __name__ == "__main__":
    main()
