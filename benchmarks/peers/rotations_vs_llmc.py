"""QuIP and SpinQuant checkpoints of seqcal and llm-compressor 0.14, tensor by tensor, on a tiny random Llama.

Both tools run the same recipes (deterministic Hadamard rotations, then int4 round to nearest in groups of 16) on the
same float32 checkpoint (hidden 64, 2 layers, untied embeddings); the script compares every tensor's name, shape,
dtype and values, and the transform_config of config.json. llm-compressor runs in its own virtual environment
(``--peer-python``, llm-compressor 0.14 with its compressed-tensors and transformers).

Usage (from the repo root, PYTHONPATH=src):
    python benchmarks/peers/rotations_vs_llmc.py [--peer-python /tmp/llmc-rec/bin/python] [--work benchmarks/.work/rot]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]
INT4 = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": 16}}}  # fmt: skip
RECIPES = {  # name -> (rotation modifier, its arguments)
    "quip": ("QuIPModifier", {"rotations": ["v", "u"], "transform_type": "hadamard"}),
    "spinquant": ("SpinQuantModifier", {"rotations": ["R1", "R2"], "transform_type": "hadamard"}),
}
LLMC = """
import json, sys, torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform import QuIPModifier, SpinQuantModifier
from transformers import AutoModelForCausalLM
model_dir, out, cls, kwargs, groups = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5])
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
rotation = {"QuIPModifier": QuIPModifier, "SpinQuantModifier": SpinQuantModifier}[cls](**kwargs)
oneshot(model=model, recipe=[rotation, QuantizationModifier(config_groups=groups, ignore=["lm_head"])])
model.save_pretrained(out, save_compressed=True)
"""


def tiny_llama(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for p in model.parameters():
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)  # norms that are not all ones, so that their folding shows
    model.save_pretrained(path)


def run_seqcal(model_dir: Path, out: Path, cls: str, kwargs: dict) -> None:
    from seqcal import QuantizationModifier, oneshot
    from seqcal.modifiers import MODIFIERS

    data = [{"input_ids": list(range(3, 19))}]  # the recipe is data-free; the ids only satisfy the API
    recipe = [MODIFIERS[cls](**kwargs), QuantizationModifier(config_groups=INT4, ignore=["lm_head"])]
    oneshot(model=str(model_dir), dataset=data, recipe=recipe, output_dir=str(out), overwrite=True)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def compare(ours: Path, theirs: Path) -> list[str]:
    a, b = tensors(ours), tensors(theirs)
    lines = [f"  tensors: seqcal {len(a)}, llm-compressor {len(b)}; only seqcal: {sorted(set(a) - set(b))}; "
             f"only llm-compressor: {sorted(set(b) - set(a))}"]  # fmt: skip
    equal, close = 0, 0
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            lines.append(f"  {key}: shape/dtype {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif torch.equal(x, y):
            equal += 1
        elif x.is_floating_point() and torch.allclose(x, y, rtol=1e-5, atol=1e-6):
            close += 1
        else:
            diff = (x.double() - y.double()).abs()
            lines.append(f"  {key}: differs in {int((diff > 0).sum())} of {x.numel()} values (max |diff| "
                         f"{diff.max().item():.3g})")  # fmt: skip
    lines.insert(1, f"  common tensors: {equal} bit-equal, {close} equal within 1e-5, "
                    f"{len(set(a) & set(b)) - equal - close} different")  # fmt: skip
    qa = json.loads((ours / "config.json").read_text())["quantization_config"].get("transform_config")
    qb = json.loads((theirs / "config.json").read_text())["quantization_config"].get("transform_config")
    lines.append(f"  transform_config equal: {qa == qb}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peer-python", type=Path, default=Path("/tmp/llmc-rec/bin/python"))
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "rotations")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = args.work / "tiny-llama"
    tiny_llama(model_dir)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    for name, (cls, kwargs) in RECIPES.items():
        theirs, ours = args.work / f"{name}-llmc", args.work / f"{name}-seqcal"
        proc = subprocess.run([str(args.peer_python), "-c", LLMC, str(model_dir), str(theirs), cls, json.dumps(kwargs),
                               json.dumps(INT4)], env=env, capture_output=True, text=True)  # fmt: skip
        if proc.returncode:
            raise SystemExit(f"llm-compressor failed on {name}:\n{proc.stderr[-3000:]}")
        run_seqcal(model_dir, ours, cls, kwargs)
        print(f"{name}: {cls}({kwargs}) + int4 g16 RTN")
        print("\n".join(compare(ours, theirs)))


if __name__ == "__main__":
    sys.exit(main())
