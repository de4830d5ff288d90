"""Every routed expert quantized: GPTQ on the zoo's tiny MoE models, in memory and offloaded from a directory.

For each MoE architecture of ``tests/zoo.py`` (random weights, 4 experts, top-2): save it with
``save_pretrained``, run ``oneshot`` with GPTQ int4 per channel on the model object and on the directory
(weights offloaded), and report the number of quantized expert tensors against experts x projections x
MoE layers, whether both checkpoints are equal bit for bit, the largest relative error of a dequantized
expert weight against the original (and of the other quantized weights, attention and dense MLPs, for
comparison), and how close transformers' reload comes to the fake-quantized model (relative logits
difference).

Usage: .venv/bin/python benchmarks/tracing/moe_archs.py [arch ...]
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from seqcal.algorithms import dequantize, unpack_int32  # noqa: E402
from seqcal.entrypoint import oneshot  # noqa: E402
from seqcal.experts import linearize_experts  # noqa: E402
from seqcal.experts.store import checkpoint_keys  # noqa: E402
from zoo import ARCHS  # noqa: E402

MOE = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "olmoe",
    "gpt_oss",
    "granitemoe",
    "jamba",
    "qwen3_next",
)
# per channel: the tiny widths (64, 32) are not multiples of a group of 128
RECIPE = """
GPTQModifier:
  ignore: [lm_head]
  config_groups:
    group_0:
      targets: [Linear]
      weights: {num_bits: 4, type: int, symmetric: true, strategy: channel}
"""


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def weight_error(saved: dict[str, torch.Tensor], original: dict[str, torch.Tensor], experts: bool) -> float:
    """Largest relative error of a dequantized expert (or other) weight against the original weight."""
    worst = 0.0
    for key in [k for k in saved if (".experts." in k) == experts and k.endswith("weight_packed")]:
        name = key.removesuffix(".weight_packed")
        shape = tuple(saved[f"{name}.weight_shape"].tolist())
        q = unpack_int32(saved[key], 4, shape)
        W = dequantize(q, saved[f"{name}.weight_scale"])
        ref = original[f"{name}.weight"]
        worst = max(worst, ((W.float() - ref.float()).norm() / ref.float().norm()).item())
    return worst


def reload_error(path: Path, quantized: torch.nn.Module, inputs: dict) -> str:
    """Relative logits difference of transformers' reload against the fake-quantized model, or why it fails."""
    from transformers import AutoModelForCausalLM

    try:
        reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the table says why
        return f"fails ({type(exc).__name__})"
    with torch.no_grad():
        got, want = reloaded(**inputs).logits, quantized(**inputs).logits
    return f"{((got - want).norm() / want.norm()).item():.1e}"


def run(arch: str, work: Path) -> str:
    spec = ARCHS[arch]
    model = spec.build()
    model.save_pretrained(work / "src")
    handle = linearize_experts(spec.build())  # the same seeded weights, per expert
    expected = handle.count  # experts x projections x MoE layers
    params = dict(handle.model.named_parameters())
    keys = checkpoint_keys(handle.model, list(params))  # in-memory name -> checkpoint name
    original = {keys[n]: p.detach() for n, p in params.items()}
    make = spec.make_inputs(model, batch=1, seq_len=24)
    data = [{"input_ids": make["input_ids"][0].tolist()} for _ in range(4)]
    start = time.perf_counter()
    returned = oneshot(
        model=model, dataset=data, recipe=RECIPE, output_dir=str(work / "mem"), max_seq_length=24
    )
    seconds = time.perf_counter() - start
    oneshot(
        model=str(work / "src"), dataset=data, recipe=RECIPE, output_dir=str(work / "off"), max_seq_length=24
    )
    a, b = tensors(work / "mem"), tensors(work / "off")
    quantized = sum(".experts." in k and k.endswith("weight_packed") for k in a)
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    reload = reload_error(work / "mem", returned, spec.make_inputs(returned, batch=2, seq_len=9, left_pad=2))
    return (f"{arch:12s} {quantized:5d} {expected:5d} {'yes' if equal else 'NO':>9s} "
            f"{weight_error(a, original, True):9.4f} {weight_error(a, original, False):9.4f} {seconds:7.1f}  {reload:>8s}")  # fmt: skip


def main() -> None:
    logging.disable(logging.WARNING)
    print(
        f"{'arch':12s} {'q exp':>5s} {'want':>5s} {'offl==mem':>9s} {'expert err':>9s} {'dense err':>9s} {'mem s':>7s}  {'reload':>8s}"
    )
    for arch in sys.argv[1:] or MOE:
        with tempfile.TemporaryDirectory() as tmp:
            print(run(arch, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
