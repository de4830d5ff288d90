"""GGUF files of SmolLM2-135M-Instruct: seqcal GPTQ on llama.cpp's grids against llama.cpp's own quantizer.

Runs (each skipped when its file exists; results to ``benchmarks/.work/gguf/results.json`` after every step):

    f32              the fp32 model as GGUF (seqcal.gguf.stream.export_gguf), llama-quantize's input
    seqcal-Q4_K_M    oneshot GPTQ, scheme Q4_K_M, output_format gguf (calibration: WikiText-2 validation windows)
    seqcal-Q4_0      the same with scheme Q4_0
    llama-Q4_K_M     llama-quantize f32 -> Q4_K_M, no importance matrix
    llama-Q4_K_M-imatrix  llama-imatrix on the same calibration text (same windows: --chunks N, -c length),
                     then llama-quantize --imatrix
    llama-Q4_0, llama-Q4_0-imatrix   the same for Q4_0

Every file's perplexity is measured by ``llama-perplexity`` on WikiText-2 test (-c 2048, --chunks K), and its
size is the file's size. All files share seqcal's tokenizer metadata (the f32 file's), so the text is tokenized
the same way for every row.

Usage (from the repo root; LLAMA_CPP_BIN: the folder of llama-quantize, llama-imatrix, llama-perplexity):
    LLAMA_CPP_BIN=/path/bin .venv/bin/python benchmarks/formats/gguf_llamacpp.py [--samples 64] [--seq 512]
        [--chunks 40] [--threads 2] [--runs name,...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
from harness import WIKI, WORK  # noqa: E402

OUT = WORK / "gguf"
BIN = Path(os.environ.get("LLAMA_CPP_BIN", "/work/peers/llamacpp-build/bin"))
RUNS = ["f32", "seqcal-Q4_K_M", "seqcal-Q4_0", "llama-Q4_K_M", "llama-Q4_K_M-imatrix", "llama-Q4_0",
        "llama-Q4_0-imatrix"]  # fmt: skip


def _seqcal(scheme: str, out: Path, args: argparse.Namespace) -> None:
    import torch

    from seqcal import oneshot
    from seqcal.modifiers import GPTQModifier

    torch.set_num_threads(args.threads)
    oneshot(model="default", dataset=str(WIKI / "wiki.valid.raw"), recipe=GPTQModifier(scheme=scheme,
            ignore=["lm_head"]), num_calibration_samples=args.samples, max_seq_length=args.seq, concatenate=True,
            dtype="float32", output_dir=str(out), output_format="gguf", overwrite=True)  # fmt: skip


def _run(cmd: list[str], log: Path) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log.write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    return proc.stdout + proc.stderr


def _llama(name: str, f32: Path, args: argparse.Namespace) -> Path:
    kind = name.split("-")[1]
    target = OUT / name / "model.gguf"
    target.parent.mkdir(parents=True, exist_ok=True)
    extra = []
    if name.endswith("imatrix"):
        imatrix = OUT / "imatrix.gguf"
        if not imatrix.exists():
            _run([str(BIN / "llama-imatrix"), "-m", str(f32), "-f", str(WIKI / "wiki.valid.raw"), "-c", str(args.seq),
                  "--chunks", str(args.samples), "-t", str(args.threads), "-o", str(imatrix)],
                 OUT / "imatrix.log")  # fmt: skip
        extra = ["--imatrix", str(imatrix)]
    _run([str(BIN / "llama-quantize"), *extra, str(f32), str(target), kind, str(args.threads)],
         target.parent / "quantize.log")  # fmt: skip
    return target


def perplexity(path: Path, args: argparse.Namespace) -> float:
    text = _run([str(BIN / "llama-perplexity"), "-m", str(path), "-f", str(WIKI / "wiki.test.raw"), "-c", "2048",
                 "--chunks", str(args.chunks), "-t", str(args.threads), "-b", "2048"],
                path.parent / "perplexity.log")  # fmt: skip
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", text).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64, help="calibration windows (both tools)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per calibration window")
    parser.add_argument(
        "--chunks", type=int, default=40, help="2048-token windows of WikiText-2 test evaluated"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", default=",".join(RUNS))
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    results_path = OUT / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    f32 = OUT / "f32" / "model.gguf"
    for name in args.runs.split(","):
        target = OUT / name / "model.gguf"
        start = time.perf_counter()
        if not target.exists():
            if name == "f32":
                _export(f32.parent)
            elif name.startswith("seqcal-"):
                _seqcal(name.split("-", 1)[1], target.parent, args)
            else:
                _llama(name, f32, args)
            results.setdefault(name, {})["quantize_wall_s"] = round(time.perf_counter() - start, 1)
        row = results.setdefault(name, {})
        row.update(size_mb=round(target.stat().st_size / 1e6, 2), ppl=perplexity(target, args), chunks=args.chunks,
                   samples=args.samples, seq=args.seq, threads=args.threads)  # fmt: skip
        print(f"{name:<22} {row['size_mb']:8.2f} MB  ppl {row['ppl']:.3f}", flush=True)
        results_path.write_text(json.dumps(results, indent=1))


def _export(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seqcal.gguf.stream import export_gguf
    from seqcal.models import default_model_dir

    path = default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    export_gguf(model, AutoTokenizer.from_pretrained(path), folder)


if __name__ == "__main__":
    main()
