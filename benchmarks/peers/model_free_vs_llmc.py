"""Model-free W4A16 on a synthetic checkpoint: `seqcal model-free` against llm-compressor 0.14's `model_free_ptq`.

The checkpoint is a random Llama (transformers' LlamaConfig: hidden 2048, intermediate 5632, 4 layers, vocabulary
32000, bfloat16, about 0.67 GB) saved in files of 200 MB, written once to benchmarks/.work/model_free/source.
Each tool quantizes it with W4A16 (lm_head ignored) on the CPU, as a separate command, N workers each
(seqcal: processes; llm-compressor: threads), with OMP_NUM_THREADS threads per command. Wall seconds are the
command's, CPU seconds those of the processes it waited for (user + system; a worker's are counted when its
parent waits for it); peak RSS is the largest sum of the resident memory of the command's whole process tree, sampled every
50 ms (GNU time reports one process's, which undercounts seqcal's worker processes). The script then counts the
quantized tensors whose bytes are equal in both outputs (weight_packed, weight_scale).

Usage (from the repo root; llm-compressor in .peer-venv, made by benchmarks/setup_peer.sh):
    .venv/bin/python benchmarks/peers/model_free_vs_llmc.py [--workers 1 2] [--threads 2] [--layers 4]
        [--budget 2GB]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / ".work" / "model_free"
PEER = ROOT / ".peer-venv" / "bin" / "python"
LLMC = """
import sys
from llmcompressor import model_free_ptq
model_free_ptq(sys.argv[1], sys.argv[2], scheme="W4A16", ignore=["lm_head"], max_workers=int(sys.argv[3]),
               device="cpu")
"""


def make_source(layers: int) -> Path:
    """The synthetic checkpoint (written once)."""
    path = WORK / f"source-{layers}"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="200MB")
    return path


def run(cmd: list[str], threads: int) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of the processes it waited for, peak RSS of the process tree in GB) of ``cmd``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT / "src")}  # fmt: skip
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:  # a process ended while being read
            pass
        time.sleep(0.05)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu, peak / 1e9


def same_tensors(a: Path, b: Path) -> tuple[int, int]:
    """(equal, compared) weight_packed / weight_scale tensors of two outputs."""
    from safetensors import safe_open

    def tensors(d: Path) -> dict:
        out = {}
        for file in d.glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                out.update(
                    {k: f.get_tensor(k) for k in f.keys() if k.endswith(("weight_packed", "weight_scale"))}
                )
        return out

    x, y = tensors(a), tensors(b)
    keys = sorted(set(x) & set(y))
    return sum(
        x[k].dtype == y[k].dtype and x[k].shape == y[k].shape and bool((x[k] == y[k]).all()) for k in keys
    ), len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--budget", default=None, help="also run seqcal with --max-host-memory BUDGET and the most "
                        "workers: its peak must stay under it")  # fmt: skip
    args = parser.parse_args()
    source = make_source(args.layers)
    size = sum(p.stat().st_size for p in source.glob("*.safetensors")) / 1e9
    print(f"source: {source} ({size:.2f} GB bfloat16, {len(list(source.glob('*.safetensors')))} files)")
    print("| tool | workers | wall s | CPU s | peak RSS GB (process tree) |\n|---|---|---|---|---|")
    outs = {}
    for workers in args.workers:
        for tool in ("seqcal", "llm-compressor"):
            out = WORK / f"{tool}-w{workers}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            if tool == "seqcal":
                cmd = [str(ROOT / ".venv/bin/python"), "-m", "seqcal.cli", "model-free", "--model", str(source),
                       "--output-dir", str(out), "--scheme", "W4A16", "--ignore", "lm_head", "--max-workers",
                       str(workers), "--threads", str(args.threads)]  # fmt: skip
            else:
                cmd = [str(PEER), "-c", LLMC, str(source), str(out), str(workers)]
            wall, cpu, rss = run(cmd, args.threads)
            outs[(tool, workers)] = out
            print(f"| {tool} | {workers} | {wall:.1f} | {cpu:.1f} | {rss:.2f} |", flush=True)
    if args.budget:
        out = WORK / "seqcal-budget"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        cmd = [str(ROOT / ".venv/bin/python"), "-m", "seqcal.cli", "model-free", "--model", str(source), "--output-dir",
               str(out), "--scheme", "W4A16", "--ignore", "lm_head", "--max-workers", str(max(args.workers)),
               "--threads", str(args.threads), "--max-host-memory", args.budget]  # fmt: skip
        wall, cpu, rss = run(cmd, args.threads)
        budget = f"seqcal, --max-host-memory {args.budget}"
        print(f"| {budget} | up to {max(args.workers)} | {wall:.1f} | {cpu:.1f} | {rss:.2f} |", flush=True)
    if len(outs) < 2:
        return
    equal, total = same_tensors(outs[("seqcal", args.workers[0])], outs[("llm-compressor", args.workers[0])])
    print(f"\nweight_packed / weight_scale tensors with equal bytes in both outputs: {equal} of {total}")


if __name__ == "__main__":
    main()
