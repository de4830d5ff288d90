"""Memory bound with images: the ``seqcal oneshot`` command on a synthetic >= 1B vision-language model.

Writes a random bf16 Llava checkpoint shard by shard (never the whole model in RAM): a CLIP vision tower
(hidden 768, 12 layers, 224-pixel images in 14-pixel patches: 256 image tokens) and a Qwen2 text model of
Qwen2.5-VL's kind (grouped-query attention with 2 KV heads, q/k/v biases; hidden 2048, ``--layers`` layers),
stored under the names transformers saves it with. Its processor is built in code (a PIL image processor and
SmolLM2's tokenizer with an ``<image>`` token added; no torchvision) and saved next to it. The calibration rows
are a JSON lines file of chat rows, each a random PNG image and a WikiText-2 paragraph, read as a user would:

    seqcal oneshot --model DIR --recipe gptq.yaml --dataset rows.jsonl --num-calibration-samples 16
                   --max-seq-length 512 --output-dir OUT --overwrite

The recipe is GPTQ W4A16 with the vision tower, the projector and lm_head ignored. Peak RSS is taken by GNU
``time -v`` and by polling the process tree (``cli_membound.TreeRSS``); exits 1 when it is above one third of
the checkpoint's size on disk.

With ``--arch qwen2_5_vl`` the checkpoint is Qwen2.5-VL-3B's shape instead (its vision tower: 32 blocks of
1280, window attention, 2x2 patch merger; its text model: hidden 2048, intermediate 11008, 16 heads and 2 KV
heads, a 151936-token vocabulary tied to the head; ``--layers`` of its 36 layers), with Qwen2.5-VL's image
processor (448-pixel images: 1024 patches, 256 image tokens) and SmolLM2's tokenizer with Qwen's vision tokens
added. Its processor is the image processor and the tokenizer (transformers builds Qwen2.5-VL's own with a
video part that needs torchvision; seqcal loads it without that part where torchvision is missing).

Usage: .venv/bin/python benchmarks/memory/vlm_membound.py [--arch llava|qwen2_5_vl] [--layers 28] [--samples 16]
           [--seq 512] [--keep] [--stages] [--max-host-memory 10GB]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from big_offload import write_random_checkpoint  # noqa: E402
from cli_membound import WORK, TreeRSS, calibration_text  # noqa: E402

RECIPE = (
    "GPTQModifier:\n  scheme: W4A16\n"
    "  ignore: ['re:.*lm_head', 're:.*vision_tower.*', 're:.*multi_modal_projector.*']\n"
)
# Renders each image item as Llava's <image> marker (the processor expands it into 256 image tokens).
TEMPLATE = (
    "{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}"
)
IMAGE = 224


def make_processor(path: Path) -> int:
    """SmolLM2's tokenizer with ``<image>`` and a CLIP image processor, saved as Llava's processor in ``path``;
    returns the image token's id."""
    from transformers import AutoTokenizer, CLIPImageProcessorPil, LlavaProcessor

    from seqcal.models import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE})
    proc = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14, image_token="<image>",
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=TEMPLATE)  # fmt: skip
    proc.save_pretrained(str(path))
    return tok.convert_tokens_to_ids("<image>")


QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_IMAGE = 448
QWEN_RECIPE = "GPTQModifier:\n  scheme: W4A16\n  ignore: ['re:.*lm_head', 're:.*visual.*']\n"


def make_qwen_model(path: Path, layers: int) -> int:
    """Qwen2.5-VL-3B's shape with ``layers`` text layers, and its processor's files, in ``path``; returns its
    safetensors bytes on disk."""
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )
    from transformers.core_model_loading import revert_weight_conversion

    from seqcal.models import default_model_dir

    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_TOKENS)})
    ids = dict(zip(QWEN_TOKENS, tok.convert_tokens_to_ids(list(QWEN_TOKENS))))
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(path))
    Qwen2VLImageProcessorPil().save_pretrained(str(path))  # Qwen2.5-VL's defaults: 14-pixel patches, merge 2
    config_file = path / "preprocessor_config.json"
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "processor_class": "Qwen2_5_VLProcessor"})
    )
    (path / "chat_template.jinja").write_text(
        TEMPLATE.replace("<image>\n", "<|vision_start|><|image_pad|><|vision_end|>")
    )
    text = {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": layers, "num_attention_heads": 16,
            "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 128000,
            "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                                             "mrope_section": [16, 24, 24]}}  # fmt: skip
    vision = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 2048,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
              "fullatt_block_indexes": [7, 15, 23, 31]}  # fmt: skip
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])  # fmt: skip
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config.dtype = "bfloat16"
    with torch.device("meta"):
        skeleton = Qwen2_5_VLForConditionalGeneration(config)
    shapes = dict(skeleton.state_dict())
    shapes.pop("lm_head.weight")  # tied to the embeddings: not in the files
    saved = revert_weight_conversion(skeleton, shapes)
    return write_random_checkpoint(path, config, {name: t.shape for name, t in saved.items()})


def make_model(path: Path, layers: int) -> int:
    """The synthetic checkpoint and its processor in ``path``; returns its safetensors bytes on disk."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration
    from transformers.core_model_loading import revert_weight_conversion

    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    image_token = make_processor(path)
    text = {"model_type": "qwen2", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": layers,
            "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 49216,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}  # fmt: skip
    vision = {"model_type": "clip_vision_model", "hidden_size": 768, "intermediate_size": 3072,
              "num_hidden_layers": 12, "num_attention_heads": 12, "image_size": IMAGE, "patch_size": 14}  # fmt: skip
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_token,
                         vision_feature_select_strategy="default", vision_feature_layer=-2)  # fmt: skip
    config.architectures = ["LlavaForConditionalGeneration"]
    config.dtype = "bfloat16"
    with torch.device("meta"):
        skeleton = LlavaForConditionalGeneration(config)
    shapes = {n: p for n, p in skeleton.state_dict().items()}
    saved = revert_weight_conversion(skeleton, shapes)  # the names transformers saves the model under
    return write_random_checkpoint(path, config, {name: t.shape for name, t in saved.items()})


def make_rows(folder: Path, samples: int, image: int = IMAGE, chars: int = 1000) -> Path:
    """``samples`` chat rows (a random ``image``-pixel PNG image, ``chars`` of a WikiText-2 paragraph) in
    ``folder / rows.jsonl``."""
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    paragraphs = [
        p.strip() for p in calibration_text().read_text(encoding="utf-8").split("\n") if len(p) > 400
    ]
    rows = []
    for i in range(samples):
        pixels = np.random.default_rng(i).integers(0, 256, (image, image, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / "images" / f"{i}.png")
        content = [
            {"type": "image", "image": f"images/{i}.png"},
            {"type": "text", "text": paragraphs[i][:chars]},
        ]
        rows.append({"messages": [{"role": "user", "content": content}]})
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "rows.jsonl"


def run_cli(
    model: Path,
    out: Path,
    rows: Path,
    samples: int,
    seq: int,
    stages: bool = False,
    budget: str | None = None,
    recipe_text: str = RECIPE,
) -> tuple[float, int, int, str]:
    """``seqcal oneshot`` under GNU time; returns seconds, GNU time's peak, the process tree's peak, stderr. The
    tree's RSS over time is written to ``out / "rss.tsv"`` (seconds, bytes).

    With ``stages`` the command runs in-process under ``_rss_stages.py``, which prints the peak RSS of each stage
    (the check of the partition, each subgraph, the save)."""
    recipe = WORK / "gptq_w4a16_vlm.yaml"
    recipe.write_text(recipe_text)
    entry = [str(Path(__file__).with_name("_rss_stages.py"))] if stages else ["-m", "seqcal.cli"]
    cmd = ["/usr/bin/time", "-v", sys.executable, *entry, "oneshot", "--model", str(model),
           "--recipe", str(recipe), "--dataset", str(rows), "--num-calibration-samples", str(samples),
           "--max-seq-length", str(seq), "--output-dir", str(out), "--overwrite",
           *(["--max-host-memory", budget] if budget else [])]  # fmt: skip
    print("command:", "seqcal", " ".join(cmd[3 + len(entry) :]), flush=True)
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    poller = TreeRSS(proc.pid)
    _, stderr = proc.communicate()
    poller.stop()
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"seqcal oneshot failed ({proc.returncode}):\n{stderr[-4000:]}")
    if stages:
        print(stderr[stderr.index("stage" + " " * 20) : stderr.index("\tCommand being timed")].rstrip())
    (out / "rss.tsv").write_text("".join(f"{t:.2f}\t{r}\n" for t, r in poller.series))  # seconds, bytes
    stats = dict(line.strip().rsplit(": ", 1) for line in stderr.splitlines() if ": " in line)
    return seconds, int(stats["Maximum resident set size (kbytes)"]) * 1024, poller.peak, stderr


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", choices=("llava", "qwen2_5_vl"), default="llava")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--keep", action="store_true", help="keep the synthetic model and the output")
    parser.add_argument("--stages", action="store_true", help="also print the peak RSS of each stage")
    parser.add_argument(
        "--max-host-memory",
        default=None,
        help="passed to seqcal oneshot; the plan's predicted peak is then printed beside the measured",
    )
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    qwen = args.arch == "qwen2_5_vl"
    kind = "qwen2_5_vl" if qwen else "vlm"
    model, out = WORK / f"synthetic-{kind}-{args.layers}L", WORK / f"out-{kind}-{args.layers}L"
    size = (make_qwen_model if qwen else make_model)(model, args.layers)
    rows = make_rows(WORK / f"{kind}-rows", args.samples, *((QWEN_IMAGE, 600) if qwen else ()))
    print(f"checkpoint: {size / 2e9:.2f}B params, {size / 1e9:.3f} GB bf16 on disk; rows: {rows}")
    seconds, gnu_peak, tree_peak, stderr = run_cli(model, out, rows, args.samples, args.seq, args.stages,
                                                   args.max_host_memory, QWEN_RECIPE if qwen else RECIPE)  # fmt: skip
    user, system = (float(line.split(": ")[1]) for line in stderr.splitlines()
                    if line.strip().startswith(("User time", "System time")))  # fmt: skip
    packed = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    print(f"seqcal oneshot: {seconds:.0f} s wall, {user + system:.0f} s CPU; "
          f"{sum(k.endswith('weight_packed') for k in packed)} packed weights")  # fmt: skip
    if args.max_host_memory:
        host = json.loads((out / "quantization_report.json").read_text())["host_memory"]
        predicted = host["predicted_peak"]
        print(f"plan: predicted host peak {predicted / 1e9:.3f} GB, the run's own measure "
              f"{host['measured_peak'] / 1e9:.3f} GB, GNU time {gnu_peak / 1e9:.3f} GB "
              f"({(predicted - gnu_peak) / gnu_peak:+.1%})")  # fmt: skip
    bound = size / 3
    print(f"{'':<24}{'peak RSS GB':>12}{'x size on disk':>16}")
    for name, peak in (("GNU time (CLI process)", gnu_peak), ("psutil (process tree)", tree_peak)):
        print(f"{name:<24}{peak / 1e9:>12.3f}{peak / size:>16.3f}")
    print(f"{'bound (one third)':<24}{bound / 1e9:>12.3f}{1 / 3:>16.3f}")
    if not args.keep:
        shutil.rmtree(model, ignore_errors=True)
    ok = max(gnu_peak, tree_peak) <= bound
    print("within the bound" if ok else "ABOVE the bound of one third of the size on disk")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
