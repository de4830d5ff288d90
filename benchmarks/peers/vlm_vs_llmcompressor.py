"""A tiny Llava calibrated on images by seqcal and by llm-compressor 0.14: are the checkpoints' tensors the same?

Writes a tiny Llava once (random weights, fp32, a CLIP vision tower and a Qwen2 text model whose widths group
size 128 divides) with its processor built offline (a PIL CLIP image processor and SmolLM2's tokenizer with an
``<image>`` token, as ``vlm_membound.py`` builds it), and four rows mapped through that processor. Both tools
then run the same recipe the same way (GPTQ W4A16, the vision tower, the projector and lm_head ignored; the
rows as a ``datasets.Dataset`` with llm-compressor's one-row collator) and save a compressed checkpoint.
Prints every tensor's name, shape and dtype side by side and whether the two checkpoints hold the same ones.

Usage: .venv/bin/python benchmarks/peers/vlm_vs_llmcompressor.py [--llmc-python /tmp/llmc-rec/bin/python]
(the llm-compressor side runs this file again under its own interpreter with ``--side llmcompressor``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))  # the shared helpers: benchmarks/_lib
from harness import WORK  # noqa: E402

IGNORE = ["re:.*lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"]
ROOT = WORK / "vlm-vs-llmc"


def write_model(path: Path) -> None:
    """The tiny Llava, its processor and ``rows.json`` (four rows through the processor) in ``path``."""
    from PIL import Image
    from transformers import AutoProcessor, LlavaConfig, LlavaForConditionalGeneration
    from vlm_membound import IMAGE, make_processor

    image_token = make_processor(path)
    text = {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49216,
            "max_position_embeddings": 1024, "tie_word_embeddings": False}  # fmt: skip
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": IMAGE, "patch_size": 14}  # fmt: skip
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_token,
                         vision_feature_select_strategy="default", vision_feature_layer=-2)  # fmt: skip
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).eval().save_pretrained(str(path))
    proc = AutoProcessor.from_pretrained(str(path))
    rows = []
    for i in range(4):
        pixels = np.random.default_rng(i).integers(0, 256, (IMAGE, IMAGE, 3), dtype=np.uint8)
        out = proc(text=f"<image>\nWhat does picture {i} show?", images=Image.fromarray(pixels))
        rows.append({k: np.asarray(v).tolist() for k, v in out.items()})
    (path / "rows.json").write_text(json.dumps(rows))


def calibrate(side: str, model_dir: Path, out: Path) -> None:
    """One tool's run: the model from ``model_dir``, its rows, GPTQ W4A16, the checkpoint into ``out``."""
    from datasets import Dataset
    from transformers import LlavaForConditionalGeneration

    rows = Dataset.from_list(json.loads((model_dir / "rows.json").read_text()))
    model = LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    kw = {"dataset": rows, "max_seq_length": 512, "num_calibration_samples": len(rows),
          "data_collator": lambda batch: {k: torch.tensor(v) for k, v in batch[0].items()}}  # fmt: skip
    if side == "llmcompressor":
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import GPTQModifier

        oneshot(model=model, recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=IGNORE), **kw)
        model.save_pretrained(str(out), save_compressed=True)
    else:
        from seqcal import oneshot

        gptq = {"GPTQModifier": {"targets": "Linear", "scheme": "W4A16", "ignore": IGNORE}}
        oneshot(model=model, recipe=gptq, output_dir=str(out), processor=str(model_dir), overwrite=True, **kw)


def tensors(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every tensor in the checkpoint's safetensors files (headers only)."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        raw = file.read_bytes()
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        out.update({k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"})
    return out


def side_by_side(ours: dict, theirs: dict) -> bool:
    """Prints the two checkpoints' tensors side by side; returns whether they are the same."""
    width = max(map(len, ours | theirs))
    print(f"{'tensor':<{width}}  {'seqcal':<22}{'llm-compressor':<22}same")
    for name in sorted(ours | theirs):
        a, b = ours.get(name), theirs.get(name)
        show = lambda t: "-" if t is None else f"{list(t[0])} {t[1]}"  # noqa: E731
        print(f"{name:<{width}}  {show(a):<22}{show(b):<22}{'yes' if a == b else 'NO'}")
    same = ours == theirs
    print(
        f"{len(ours)} tensors (seqcal), {len(theirs)} (llm-compressor): {'the same' if same else 'they differ'}"
    )
    return same


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llmc-python", default="/tmp/llmc-rec/bin/python")
    parser.add_argument("--side", choices=["seqcal", "llmcompressor"], default=None, help="run one tool only")
    args = parser.parse_args()
    model_dir = ROOT / "tiny-llava"
    if args.side is not None:
        calibrate(args.side, model_dir, ROOT / f"out-{args.side}")
        return 0
    if not (model_dir / "rows.json").is_file():
        model_dir.mkdir(parents=True, exist_ok=True)
        write_model(model_dir)
    for side, python in (("seqcal", sys.executable), ("llmcompressor", args.llmc_python)):
        subprocess.run([python, __file__, "--side", side], check=True)
    ours, theirs = tensors(ROOT / "out-seqcal"), tensors(ROOT / "out-llmcompressor")
    for name in ("config.json",):
        a, b = (json.loads((ROOT / f"out-{s}" / name).read_text()) for s in ("seqcal", "llmcompressor"))
        print(f"{name}: architectures {a.get('architectures')} / {b.get('architectures')}; quantization_config "
              f"ignore {a['quantization_config'].get('ignore')} / {b['quantization_config'].get('ignore')}")  # fmt: skip
    return 0 if side_by_side(ours, theirs) else 1


if __name__ == "__main__":
    sys.exit(main())
