"""seqcal vs llm-compressor 0.14.0.1 on a GPU: GPTQ W4A16 g64 on a SmolLM2-135M-shaped model.

A GPU machine without network cannot reach the Hub, and only small files travel with the repository, so the model is
SmolLM2-135M-Instruct's architecture (its config.json and tokenizer, carried) with random weights in bf16:
right for time and memory, meaningless for perplexity (quality is compared on CPU, benchmarks/RESULTS.md).
Each tool runs in its own process; the table gives wall time, the tool's own timer, peak device memory
(torch.cuda.max_memory_allocated) and peak host RSS.

Usage (benchmarks/gpu/gpu_check.sh runs it on the device machine):
    python benchmarks/gpu/gpu_bench.py --config-dir DIR --out results.json \\
        [--seqcal-python PY --seqcal-path P] [--peer-python PY --peer-path P] [--runs a,b] [--samples N]
        [--seq N] [--group-size G] [--reuse]

benchmarks/gpu/gpu_1b.sh runs it on a Llama-architecture model of about 1B parameters (GPTQ W4A16 g128, 256 x 2048).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEQCAL = ["benchmarks/_lib/run_seqcal.py", "--algo", "gptq", "--dtype", "bfloat16"]
RUNS = {
    "seqcal": [*SEQCAL],  # seqcal's defaults: batches sized by the memory plan on CUDA, column-loop graphs
    "seqcal-bs1": [*SEQCAL, "--batch-size", "1"],  # one sample per subgraph run
    "seqcal-eager": [*SEQCAL, "--eager-columns"],  # the GPTQ column loop without CUDA graphs
    "seqcal-sync": [*SEQCAL, "--copies-on-compute"],  # the cache's copies on the compute stream, no prefetch
    "seqcal-devcache": [*SEQCAL, "--offload", "device"],  # the activation cache in the GPU's memory
    "seqcal-register": [*SEQCAL, "--pinned-register-threads", "8"],  # new pinned memory paged in by 8 threads
    "seqcal-syncsave": [*SEQCAL, "--synchronous-save"],  # checkpoint files written before the next subgraph
    "llmc": ["benchmarks/_lib/run_llmcompressor.py", "--algo", "gptq", "--dtype", "bfloat16"],
    "seqcal-bs8": [*SEQCAL, "--batch-size", "8"],  # 8 samples per subgraph run: fewer, larger launches
    "seqcal-auto": [*SEQCAL, "--batch-size", "auto"],  # batches sized by the memory plan
    "seqcal-layers": [*SEQCAL, "--layer-cut"],
    "seqcal-profile": [*SEQCAL, "--profile", "{work}/seqcal.trace.json"],
    "seqcal-again": [*SEQCAL],
}


# Shapes other than the carried config's: "1b" is Llama 3.2 1B's (16 layers of 2048 -> 8192, 32 heads, 8 KV heads),
# keeping SmolLM2's vocabulary so that its carried tokenizer fits: 1.07B parameters.
SHAPES = {
    "config": {},
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}},
}  # fmt: skip


def build_model(
    config_dir: Path, work: Path, layers: int | None, samples: int, seq: int, shape: str = "config"
) -> tuple[Path, Path]:
    """Random-weight bf16 model of ``config_dir``'s architecture (resized to ``shape``), plus random tokens."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    for key, value in SHAPES[shape].items():
        setattr(config, key, value)
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model_dir = work / "model"
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (config_dir / name).is_file():
            shutil.copy(config_dir / name, model_dir / name)
    tokens = work / "tokens.safetensors"
    g = torch.Generator().manual_seed(1)
    save_file({"input_ids": torch.randint(0, config.vocab_size, (samples, seq), generator=g)}, str(tokens))
    return model_dir, tokens


def run(name: str, python: str, path: str, model: Path, tokens: Path, work: Path, timeout: int) -> dict:
    args = [a.format(work=work) for a in RUNS[name]]
    cmd = [python, "benchmarks/gpu/_gpu_child.py", *args, "--model", str(model), "--tokens", str(tokens),
           "--out", str(work / f"out-{name}")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": path} if path else dict(os.environ)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"run": name, "error": f"timed out after {timeout} s"}
    wall = time.perf_counter() - start
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        return {"run": name, "error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    found = dict(re.findall(r"\b(seconds|device_gb|host_gb) ([0-9.]+)", proc.stdout))
    return {"run": name, "wall_s": round(wall, 1), "tool_s": float(found.get("seconds", "nan")),
            "device_gb": float(found.get("device_gb", "nan")), "host_gb": float(found.get("host_gb", "nan"))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config-dir", required=True, type=Path, help="config.json and tokenizer files")
    parser.add_argument("--work", type=Path, default=Path("/tmp/seqcal-gpu-bench"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (quick checks)")
    parser.add_argument("--seqcal-python", default=sys.executable)
    parser.add_argument("--seqcal-path", default=os.environ.get("PYTHONPATH", ""))
    parser.add_argument("--peer-python", default=sys.executable)
    parser.add_argument("--peer-path", default="")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per run")
    parser.add_argument("--shape", choices=list(SHAPES), default="config", help="resize the carried config")
    parser.add_argument("--group-size", type=int, default=64, help="W4A16 group size of both tools")
    parser.add_argument(
        "--reuse", action="store_true", help="keep a model and tokens built by an earlier call"
    )
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ["SEQCAL_BENCH_GROUP_SIZE"] = str(
        args.group_size
    )  # read by benchmarks/_lib/scheme.py in each child
    built = args.work / "built.json"
    wanted = {"config": str(args.config_dir.resolve()), "layers": args.layers, "samples": args.samples,
              "seq": args.seq, "shape": args.shape}  # fmt: skip
    if args.reuse and built.is_file() and json.loads(built.read_text()) == wanted:
        model, tokens = args.work / "model", args.work / "tokens.safetensors"
    else:
        model, tokens = build_model(
            args.config_dir, args.work, args.layers, args.samples, args.seq, args.shape
        )
        built.write_text(json.dumps(wanted))
    rows = []
    for name in args.runs.split(","):
        peer = name.startswith("llmc")
        python, path = (args.peer_python, args.peer_path) if peer else (args.seqcal_python, args.seqcal_path)
        rows.append(run(name, python, path, model, tokens, args.work, args.timeout))
        print(json.dumps(rows[-1]), flush=True)
        args.out.write_text(json.dumps(rows, indent=1))
    print(f"\n{'run':<16}{'wall s':>8}{'tool s':>8}{'device GB':>11}{'host GB':>9}")
    for row in rows:
        if "error" in row:
            print(f"{row['run']:<16}  {row['error']}")
        else:
            print(f"{row['run']:<16}{row['wall_s']:>8.1f}{row['tool_s']:>8.1f}{row['device_gb']:>11.3f}"
                  f"{row['host_gb']:>9.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
