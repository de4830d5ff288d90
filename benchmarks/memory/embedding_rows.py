"""An embedding read by rows against read whole: the same ``seqcal oneshot`` command from two source trees.

Writes a random bf16 checkpoint of ``--shape``, with SmolLM2's tokenizer (its ids are inside the vocabulary):

    gemma3-270m   Gemma 3 270M's text model as it is (Gemma3ForCausalLM: hidden 640, 18 layers, a tied 262144 x 640
                  scaled embedding, 0.34 GB of its 0.54 GB)
    llama-1b      Llama-3.2-1B's widths (hidden 2048, intermediate 8192, a tied 128256 x 2048 embedding, 0.53 GB)
                  with ``--layers`` layers

then runs, under GNU time, as a user would:

    seqcal oneshot --model DIR --recipe gptq.yaml --dataset wiki.valid.raw --num-calibration-samples 16
                   --max-seq-length 256 --output-dir OUT --overwrite --threads T

once with this tree's ``src`` and once with ``--base SRC`` (another checkout's ``src``: the code before embeddings
were read by rows). Prints wall time, CPU time and peak RSS side by side, and whether the two checkpoints' bytes
are equal (they must be: the rows are the table's rows).

Usage: .venv/bin/python benchmarks/memory/embedding_rows.py --base /tmp/seqcal-base/src [--shape gemma3-270m]
           [--layers 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))
from big_offload import write_random_checkpoint  # noqa: E402
from cli_membound import TOKENIZER_FILES, calibration_text  # noqa: E402
from harness import ROOT, WORK, measure  # noqa: E402

RECIPE = "GPTQModifier:\n  scheme: W4A16\n  ignore: [lm_head]\n"


def make_model(path: Path, shape: str, layers: int) -> int:
    """The checkpoint of ``shape`` with SmolLM2's tokenizer; returns its bytes on disk."""
    from seqcal.models import default_model_dir

    if not (path / "config.json").exists():
        if shape == "gemma3-270m":
            config = Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                      num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                      torch_dtype="bfloat16")  # fmt: skip
            cls = Gemma3ForCausalLM
        else:
            config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                 tie_word_embeddings=True, torch_dtype="bfloat16")  # fmt: skip
            cls = LlamaForCausalLM
        with torch.device("meta"):
            skeleton = cls(config)
        shapes = {n: p.shape for n, p in skeleton.named_parameters() if n != "lm_head.weight"}  # tied
        write_random_checkpoint(path, config, shapes)
    for name in TOKENIZER_FILES:
        if (Path(default_model_dir()) / name).is_file():
            shutil.copy(Path(default_model_dir()) / name, path / name)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def run(src: Path, model: Path, out: Path, threads: int) -> tuple[float, float, float]:
    """``seqcal oneshot`` with ``src`` first on the path; (wall s, CPU s, peak RSS GB)."""
    recipe = WORK / "embedding_rows_gptq.yaml"
    recipe.write_text(RECIPE)
    cmd = ["env", f"PYTHONPATH={src}", f"OMP_NUM_THREADS={threads}", sys.executable, "-m", "seqcal.cli", "oneshot",
           "--model", str(model), "--recipe", str(recipe), "--dataset", str(calibration_text()),
           "--num-calibration-samples", "16", "--max-seq-length", "256", "--output-dir", str(out), "--overwrite",
           "--threads", str(threads), "--plot", "none"]  # fmt: skip
    wall, cpu, rss, _ = measure(cmd, out.with_suffix(".log"))
    return wall, cpu, rss


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=Path, required=True, help="the src folder of the code to compare with")
    parser.add_argument("--shape", choices=["gemma3-270m", "llama-1b"], default="gemma3-270m")
    parser.add_argument("--layers", type=int, default=2, help="llama-1b's layers")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    work = WORK / "embedding_rows"
    work.mkdir(parents=True, exist_ok=True)
    model = work / (args.shape if args.shape == "gemma3-270m" else f"{args.shape}-{args.layers}l")
    size = make_model(model, args.shape, args.layers)
    print(f"{args.shape}: {size / 1e9:.3f} GB on disk, {args.threads} thread(s), {os.cpu_count()} CPUs")
    rows = {}
    for label, src in (("whole table (base)", args.base), ("by rows (this tree)", ROOT / "src")):
        rows[label] = run(
            src, model, work / f"{model.name}-{label.split(' (')[0].replace(' ', '-')}", args.threads
        )
    print(f"{'embedding read':<22} {'wall s':>8} {'CPU s':>8} {'peak RSS GB':>12}")
    for label, (wall, cpu, rss) in rows.items():
        print(f"{label:<22} {wall:>8.1f} {cpu:>8.1f} {rss:>12.3f}")
    outs = [work / f"{model.name}-whole-table", work / f"{model.name}-by-rows"]
    files = [sorted(p.name for p in o.glob("*.safetensors")) for o in outs]
    same = files[0] == files[1] and all(
        (outs[0] / f).read_bytes() == (outs[1] / f).read_bytes() for f in files[0]
    )
    print(f"checkpoints byte-equal: {same} ({len(files[0])} safetensors file(s))")


if __name__ == "__main__":
    main()
