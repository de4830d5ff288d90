"""auto-round 0.16.1's GGUF export (``format="gguf:q4_k_m"``) on given calibration windows, for
``gguf_llamacpp.py``'s peer row. Run in auto-round's own venv.

auto-round at its defaults for this format (SignRound, its default steps, learning rate and batch), on the CPU with
torch.compile off (``--iters 0``: its optimized round to nearest, the ``auto-round-opt-rtn`` recipe); the calibration is set: the windows ``gguf_llamacpp.py`` gives every tool, passed as token
tensors of shape [1, seq] so that auto-round sees exactly those windows (their count as ``nsamples``, their length
as ``seqlen``). Prints one JSON line.

Usage:
    /path/to/autoround-venv/bin/python benchmarks/formats/gguf_autoround.py --model DIR --tokens calib.jsonl
        --out DIR [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a transformers model directory")
    parser.add_argument("--tokens", required=True, help="JSON lines of {'input_ids': [...]}, one window each")
    parser.add_argument("--out", required=True)
    parser.add_argument("--format", default="gguf:q4_k_m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=None, help="tuning steps; default: auto-round's (200)")
    parser.add_argument("--no-amp", action="store_true", help="search in float32 (amp=False), not bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line)["input_ids"] for line in open(args.tokens, encoding="utf-8") if line.strip()]
    data = [torch.tensor([row]) for row in rows]
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    steps = {} if args.iters is None else {"iters": args.iters}  # 0: auto-round's optimized round to nearest
    if args.no_amp:  # on a CPU without bfloat16 instructions its default bf16 search is emulated, and very slow
        steps["amp"] = False
    ar = AutoRound(model, tokenizer=tokenizer, scheme=args.format, dataset=data, nsamples=len(data),
                   seqlen=len(rows[0]), device_map="cpu", enable_torch_compile=False, **steps)  # fmt: skip
    ar.quantize_and_save(args.out, format=args.format)
    seconds = time.perf_counter() - start
    print(json.dumps({"tool": "auto-round", "format": args.format, "iters": args.iters, "amp": not args.no_amp,
                      "seconds": round(seconds, 1),
                      "windows": len(rows), "seq": len(rows[0])}))  # fmt: skip


if __name__ == "__main__":
    main()
