"""A DeepSeek-V3-shaped FP8-block checkpoint of a few GB: calibrated GPTQ, and model-free against the peers.

Writes the synthetic checkpoint once (``_dsv3_fp8.py``: DeepSeek-V3's widths and FP8 block layout, fewer heads,
layers and experts; tensor by tensor, never the model in RAM), then, each as its own command under the same
OMP_NUM_THREADS, with the peak RSS of the command's whole process tree sampled every 50 ms:

* ``gptq``: ``seqcal oneshot`` GPTQ W4A16 (``ignore: [lm_head]``) calibrated on WikiText-2 validation text, the
  weights dequantized from FP8 per subgraph; the bound is one third of the checkpoint's size on disk. With
  ``--gptq-limit S`` the run is stopped after S seconds and the peak so far is reported (marked "stopped").
* ``model-free``: per scheme (W4A16, NVFP4A16), ``seqcal model-free``, llm-compressor 0.14's ``model_free_ptq``
  with compressed-tensors' ``FP8BlockDequantizer`` (DeepSeek's FP8 modules as its targets) and auto-round 0.16.1's
  model-free mode (``AutoRound(..., model_free=True)``), one worker each; each in its own venv.

Each output is then loaded by transformers from its own config.json: the model class with the first two
layers (the dense one and the first MoE one) through ``from_pretrained`` (compressed-tensors decompressing),
a forward with finite logits; and every stored tensor of the later layers has the name, shape and dtype of its
counterpart in the loaded MoE layer (``reload_check``). auto-round's W4A16 (its auto_gptq packing) is not reloaded:
that needs auto-round's own loader. SEQCAL_BENCH_SRC runs seqcal from another copy of its sources (the shared
working tree may be mid-edit during an hour-long run).

Usage (from the repo root):
    .venv/bin/python benchmarks/peers/giant_fp8_vs_peers.py [--data /work/bench-data] [--shape dsv3 | dsv3-deep | tiny]
        [--steps make gptq model-free]
        [--schemes W4A16 NVFP4A16] [--tools seqcal llm-compressor auto-round] [--threads 2] [--gptq-limit S]
        [--max-host-memory 3.6GB]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dsv3_fp8  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WIKI = Path("/work/shared/data/wiki.valid.raw")
FP8_TARGETS = [r"re:.*mlp.*\.(gate|up|down)_proj$", r"re:.*self_attn.*\.(kv_b|o|q_a|q_b)_proj$",
               r"re:.*self_attn\.kv_a_proj_with_mqa$"]  # fmt: skip
LLMC = """
import sys
from compressed_tensors.entrypoints.convert import FP8BlockDequantizer
from llmcompressor import model_free_ptq
src, out, scheme, workers, targets = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]
model_free_ptq(src, out, scheme=scheme, ignore=["lm_head", "re:.*embed_tokens$", "re:.*mlp\\\\.gate$"],
               max_workers=workers, device="cpu",
               converter=FP8BlockDequantizer(targets=targets, weight_block_size=(128, 128)))
"""
AUTOROUND = """
import sys
from auto_round import AutoRound
src, out, scheme = sys.argv[1], sys.argv[2], sys.argv[3]
AutoRound(model=src, scheme=scheme, model_free=True, device_map="cpu").quantize_and_save(out)
"""
# dsv3: 3.2 GB (4 layers, the first dense, 8 routed experts); dsv3-deep: 12.3 GB, the same layers 24 deep (DeepSeek-V3
# has 61), where one layer is a share of the checkpoint nearer the real model's; tiny: 0.2 GB, one MoE layer of 2
# experts, for a quick look
SHAPES = {
    "dsv3": _dsv3_fp8.Shape(),
    "dsv3-deep": _dsv3_fp8.Shape(layers=24),
    "tiny": _dsv3_fp8.Shape(
        layers=1, dense_layers=0, experts=2, experts_per_token=1, vocab=512, shard_bytes=100 << 20
    ),
}
RECIPE = "GPTQModifier:\n  scheme: W4A16\n  ignore: [lm_head]\n"


def tree_run(cmd: list[str], threads: int, log: Path, limit: float | None = None) -> dict:
    """Run ``cmd``; wall seconds, the peak RSS summed over its process tree (50 ms samples), its exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.environ.get("SEQCAL_BENCH_SRC", str(ROOT / "src")), "AR_MODEL_FREE_SHARD_PARALLELISM": "1"}  # fmt: skip
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        root, peak, series, stopped = psutil.Process(proc.pid), 0, [], False
        while proc.poll() is None:
            try:
                rss = sum(
                    p.memory_info().rss for p in [root, *root.children(recursive=True)] if p.is_running()
                )
                peak = max(peak, rss)
                series.append((time.perf_counter() - start, rss))
            except psutil.Error:  # a process ended while being read
                pass
            if limit is not None and time.perf_counter() - start > limit:
                for p in root.children(recursive=True):
                    p.kill()
                proc.kill()
                proc.wait()
                stopped = True
                break
            time.sleep(0.05)
    log.with_suffix(".rss.tsv").write_text("".join(f"{t:.2f}\t{r}\n" for t, r in series))
    return {"wall": time.perf_counter() - start, "peak": peak / 1e9, "rc": proc.returncode, "stopped": stopped,
            "load": (load, os.getloadavg()[0])}  # fmt: skip


def size_on_disk(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9


def run_gptq(
    src: Path,
    work: Path,
    threads: int,
    samples: int,
    seq: int,
    limit: float | None,
    budget: str | None = None,
) -> dict:
    """``seqcal oneshot`` GPTQ W4A16 from the FP8 checkpoint (the CLI, as a user runs it; ``budget``: its
    ``--max-host-memory``)."""
    recipe, out = work / "gptq_w4a16.yaml", work / "seqcal-gptq-w4a16"
    recipe.write_text(RECIPE)
    cmd = [str(ROOT / ".venv/bin/python"), "-m", "seqcal.cli", "oneshot", "--model", str(src), "--recipe",
           str(recipe), "--dataset", str(WIKI), "--num-calibration-samples", str(samples), "--max-seq-length",
           str(seq), "--output-dir", str(out), "--overwrite", "--threads", str(threads)]  # fmt: skip
    cmd += ["--max-host-memory", budget] if budget else []
    print("command: seqcal", " ".join(cmd[3:]), flush=True)
    result = tree_run(cmd, threads, work / "gptq.log", limit)
    return {**result, "out": out}


def model_free_cmd(
    tool: str, src: Path, out: Path, scheme: str, threads: int, peers: dict[str, str]
) -> list[str]:
    if tool == "seqcal":
        return [str(ROOT / ".venv/bin/python"), "-m", "seqcal.cli", "model-free", "--model", str(src),
                "--output-dir", str(out), "--scheme", scheme, "--ignore", "lm_head", "--max-workers", "1",
                "--threads", str(threads)]  # fmt: skip
    if tool == "llm-compressor":
        return [peers[tool], "-c", LLMC, str(src), str(out), scheme, "1", *FP8_TARGETS]
    return [peers[tool], "-c", AUTOROUND, str(src), str(out), {"NVFP4A16": "NVFP4"}.get(scheme, scheme)]


def view_with_layers(out: Path, layers: int) -> Path:
    """A directory that is ``out`` with config.json's ``num_hidden_layers`` set to ``layers`` (links to the files)."""
    view = out.parent / f"{out.name}-first{layers}"
    subprocess.run(["rm", "-rf", str(view)], check=True)
    view.mkdir(exist_ok=True)
    for f in out.iterdir():
        if f.name != "config.json" and not (view / f.name).exists():
            (view / f.name).symlink_to(f)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (view / "config.json").write_text(json.dumps(config, indent=2))
    return view


def stored(out: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor of the output, from the safetensors headers."""
    from safetensors import safe_open

    infos = {}
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                infos[key] = (sl.get_dtype(), tuple(sl.get_shape()))
    return infos


def reload_check(out: Path, layers: int, python: str, load: int = 2) -> str:
    """Load the first ``load`` layers with transformers (forward, finite logits) and check every later layer's
    tensors against the loaded MoE layer's names, shapes and dtypes; returns a one-line verdict."""
    view = view_with_layers(out, load)
    code = (
        "import sys, torch\nfrom transformers import AutoModelForCausalLM\n"
        "m, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, output_loading_info=True)\n"
        "bad = {k: v for k, v in info.items() if k != 'unexpected_keys' and v}\n"
        "assert not bad, f'not loaded: {bad}'\n"
        "extra = [k for k in info['unexpected_keys'] if not k.startswith('model.layers.')]\n"
        "assert not extra, f'unexpected keys outside the layers not loaded: {extra}'\n"
        "with torch.no_grad(): y = m(input_ids=torch.arange(1, 17).unsqueeze(0)).logits\n"
        "assert torch.isfinite(y).all(), 'non-finite logits'\n"
        "print(type(m).__name__, 'layers', len(m.model.layers), 'loaded, no missing keys; logits finite', tuple(y.shape))\n"
    )
    res = subprocess.run([python, "-c", code, str(view)], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    if res.returncode:
        return f"transformers load of 2 layers FAILED: {res.stderr.strip().splitlines()[-1][:300]}"
    infos = stored(out)
    one = {k.split(".", 3)[3]: v for k, v in infos.items() if k.startswith("model.layers.1.")}
    bad = []
    for i in range(2, layers):
        mine = {k.split(".", 3)[3]: v for k, v in infos.items() if k.startswith(f"model.layers.{i}.")}
        if mine != one:
            bad.append(i)
    checked = f"layers 2-{layers - 1} tensors as layer 1's" if layers > 2 else ""
    verdict = "MISMATCH in layers " + str(bad) if bad else checked
    return f"{res.stdout.strip()}; {verdict}; {len(infos)} tensors"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("/work/bench-data"))
    parser.add_argument("--steps", nargs="+", default=["make", "gptq", "model-free"])
    parser.add_argument("--schemes", nargs="+", default=["W4A16", "NVFP4A16"])
    parser.add_argument("--tools", nargs="+", default=["seqcal", "llm-compressor", "auto-round"])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="dsv3", help="tiny: one MoE layer, 0.2 GB")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument(
        "--gptq-limit", type=float, default=None, help="stop the GPTQ run after this many seconds"
    )
    parser.add_argument(
        "--max-host-memory", default=None, help="the GPTQ run's --max-host-memory (e.g. 3.6GB)"
    )
    parser.add_argument("--llmc", default="/work/peers/llmc/bin/python")
    parser.add_argument("--autoround", default="/work/peers/autoround/bin/python")
    parser.add_argument("--no-reload", action="store_true")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    src, work = args.data / f"{args.shape}-fp8", args.data / f"runs-{args.shape}"
    work.mkdir(parents=True, exist_ok=True)
    if "make" in args.steps and not (src / "model.safetensors.index.json").is_file():
        from seqcal.models import default_model_dir

        _dsv3_fp8.write(src, shape, Path(default_model_dir()))
    size = size_on_disk(src)
    print(f"source: {src}: {size:.3f} GB on disk, {len(list(src.glob('*.safetensors')))} files, {shape}")
    if "gptq" in args.steps:
        r = run_gptq(src, work, args.threads, args.samples, args.seq, args.gptq_limit, args.max_host_memory)
        state = "stopped" if r["stopped"] else f"exit {r['rc']}"
        print(f"| GPTQ W4A16 | {r['wall']:.0f} s ({state}) | peak {r['peak']:.3f} GB = {r['peak'] / size:.3f}x "
              f"size on disk (bound 0.333) | load {r['load'][0]:.1f} -> {r['load'][1]:.1f} |", flush=True)  # fmt: skip
        if not r["stopped"] and not r["rc"] and not args.no_reload:
            print(
                "reload:",
                reload_check(r["out"], shape.layers, str(ROOT / ".venv/bin/python"), min(2, shape.layers)),
                flush=True,
            )
    if "model-free" not in args.steps:
        return
    peers = {"llm-compressor": args.llmc, "auto-round": args.autoround}
    print(
        "| scheme | tool | wall s | peak RSS GB (tree) | exit | load before -> after |\n|---|---|---|---|---|---|"
    )
    for scheme in args.schemes:
        for tool in args.tools:
            out = work / f"{tool}-{scheme}"
            subprocess.run(["rm", "-rf", str(out), str(out) + "-first2"], check=True)
            cmd = model_free_cmd(tool, src, out, scheme, args.threads, peers)
            r = tree_run(cmd, args.threads, work / f"{tool}-{scheme}.log")
            print(f"| {scheme} | {tool} | {r['wall']:.1f} | {r['peak']:.3f} | {r['rc']} | "
                  f"{r['load'][0]:.1f} -> {r['load'][1]:.1f} |", flush=True)  # fmt: skip
            if r["rc"] == 0 and not args.no_reload and tool != "auto-round":
                print(f"  reload {tool} {scheme}:", reload_check(out, shape.layers, str(ROOT / ".venv/bin/python"), min(2, shape.layers)),
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
