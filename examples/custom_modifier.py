"""Write your own modifier: per-channel 4-bit weights with clipping chosen by an MSE search.

Round-to-nearest with a min/max observer picks each output channel's scale from its largest weight, so one
outlier stretches the grid for the whole row. Clipping the range (scale = ratio * max|w| / qmax, ratio < 1)
rounds the outlier harder but every other weight finer. This modifier tries a grid of ratios per channel
and keeps the one with the smallest squared error ||W - Q(W)||^2, then saves the codes in the
compressed-tensors format, so the checkpoint loads in transformers (and vLLM) like any other.

(seqcal already has this search as the ``observer: mse`` weight argument; writing it here shows the
Modifier API: a dataclass whose fields are the recipe's arguments, and a ``compress`` that fills
``state.results.quantized`` with one QuantizedWeight per Linear.)

Run:
    python examples/custom_modifier.py                       # SmolLM2-135M-Instruct, offline
    python examples/custom_modifier.py --model DIR --output-dir out/mse-clip

It prints the weight error of the MSE search next to plain round-to-nearest (min/max), the output error of
both against the full-precision model, and checks that the saved checkpoint, reloaded with
``transformers.AutoModelForCausalLM.from_pretrained``, computes what the fake-quantized model computes.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from seqcal import oneshot
from seqcal.algorithms import compute_qparams, fake_quantize, quantize
from seqcal.models import resolve_model
from seqcal.modifiers import QuantizationModifier, QuantizedWeight, RunState
from seqcal.tracing.partition import Subgraph


def mse_clip_qparams(
    W: torch.Tensor, num_bits: int, ratios: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel scales, each row clipped by the ratio with the least squared error.

    Args:
        W: weight [out, in].
        num_bits: code width (4: codes -8..7).
        ratios: clipping ratios to try, e.g. torch.linspace(0.5, 1.0, 26); 1.0 is plain min/max.

    Returns:
        (scale [out, 1], zero_point [out, 1] int8 zeros), the layout compressed-tensors uses for "channel".
    """
    absmax = W.abs().amax(dim=1, keepdim=True)  # [out, 1]
    best_err = torch.full_like(absmax, float("inf"))
    best_scale = torch.zeros_like(absmax)
    for ratio in ratios.tolist():
        scale, zero = compute_qparams(-ratio * absmax, ratio * absmax, num_bits=num_bits, symmetric=True)
        err = (
            (fake_quantize(W, scale, zero, num_bits=num_bits) - W).pow(2).sum(dim=1, keepdim=True)
        )  # [out, 1]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
    return best_scale, torch.zeros_like(best_scale, dtype=torch.int8)


@dataclass
class MSEClipModifier(QuantizationModifier):
    """Round-to-nearest with per-channel clipping ratios chosen by an MSE search (data-free).

    Targets, ``ignore`` and the scheme come from QuantizationModifier; the scheme must be per-channel and
    symmetric (e.g. ``config_groups`` with ``strategy: channel``, or the "W8A16" preset).

    Args (besides QuantizationModifier's):
        grid: how many clipping ratios to try, evenly spaced in [min_ratio, 1].
        min_ratio: the strongest clipping tried.

    Example:
        >>> MSEClipModifier(config_groups=channel_scheme(4), ignore=["lm_head"], grid=26)  # doctest: +SKIP
    """

    name: ClassVar[str] = "MSEClipModifier"
    grid: int = 26
    min_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()  # resolves scheme / config_groups into self.groups, checks what is supported
        for group in self.groups.values():
            if group.weights.strategy != "channel" or not group.weights.symmetric:
                raise ValueError(
                    f"{self.name}: needs a symmetric per-channel weight scheme (strategy: channel)"
                )
        if not (self.grid >= 1 and 0 < self.min_ratio <= 1):
            raise ValueError(f"{self.name}: grid must be >= 1 and min_ratio in (0, 1]")

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        # The executor calls this once per subgraph, with that subgraph's weights on the device.
        names = [n for n in self.modules_in(subgraph) if n not in state.results.quantized]
        ratios = torch.linspace(self.min_ratio, 1.0, self.grid)
        for name in names:
            module, scheme = model.get_submodule(name), self.modules[name]
            W = module.weight.data  # [out, in]
            num_bits = scheme.weights.num_bits
            scale, zero = mse_clip_qparams(W.float(), num_bits, ratios)
            scale = scale.to(W.dtype)
            # The model keeps computing with the quantized weights (later subgraphs see them) ...
            module.weight.data = fake_quantize(W, scale, zero, num_bits=num_bits)
            # ... and the checkpoint writer packs these codes and scales (compressed-tensors format).
            q = quantize(W, scale, zero, num_bits=num_bits)
            state.results.quantized[name] = QuantizedWeight(
                q=q, scale=scale, zero_point=None, g_idx=None, scheme=scheme
            )
        return bool(names)


def channel_scheme(num_bits: int) -> dict:
    """A compressed-tensors config group: symmetric int weights, one scale per output channel."""
    weights = {"num_bits": num_bits, "type": "int", "symmetric": True, "strategy": "channel"}
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


def weight_error(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Sum over quantized Linears of ||W_q - W||^2 / ||W||^2."""
    total = 0.0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            W = reference.get_submodule(name).weight.float()
            total += ((module.weight.float() - W).pow(2).sum() / W.pow(2).sum()).item()
    return total


def output_error(model: torch.nn.Module, reference: torch.nn.Module, ids: torch.Tensor) -> float:
    """Relative error of the logits: ||y_q - y|| / ||y||."""
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, reference(input_ids=ids).logits
    return ((got - want).norm() / want.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="default", help="model directory, or 'default' (SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--output-dir", default="out/examples/mse-clip")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--grid", type=int, default=26, help="clipping ratios to try per channel")
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args()

    path = resolve_model(args.model)  # 'default' is converted once from the embedded GGUF, then cached
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("Quantization maps each weight to one of a few levels.", return_tensors="pt").input_ids

    # Data-free (needs_calibration is False), so pipeline="datafree": no calibration data is read, no forward
    # pass runs, and compress() gets the whole model as one subgraph. (A recipe that also holds a
    # calibrating modifier runs the sequential pipeline, and compress() is then called once per subgraph.)
    mse = copy.deepcopy(reference)
    recipe = MSEClipModifier(config_groups=channel_scheme(args.bits), ignore=["lm_head"], grid=args.grid)
    oneshot(model=mse, tokenizer=tokenizer, recipe=recipe, output_dir=args.output_dir, overwrite=True,
            pipeline="datafree")  # fmt: skip
    rtn = copy.deepcopy(reference)
    plain = QuantizationModifier(config_groups=channel_scheme(args.bits), ignore=["lm_head"])
    oneshot(model=rtn, recipe=plain, pipeline="datafree")  # in memory only: no output_dir

    numbers = {
        "weight_error": {
            "mse_clip": weight_error(mse, reference),
            "rtn_minmax": weight_error(rtn, reference),
        },
        "output_error": {
            "mse_clip": output_error(mse, reference, ids),
            "rtn_minmax": output_error(rtn, reference, ids),
        },
    }
    print(f"{'':<14}{'MSE clip':>12}{'RTN min/max':>14}")
    for key, row in numbers.items():
        print(f"{key:<14}{row['mse_clip']:>12.4e}{row['rtn_minmax']:>14.4e}")

    # The checkpoint reloads with plain transformers (compressed-tensors installed) and computes the same.
    loaded = AutoModelForCausalLM.from_pretrained(args.output_dir).eval()
    with torch.no_grad():
        diff = (loaded(input_ids=ids).logits - mse(input_ids=ids).logits).abs().max().item()
    numbers["reload_max_abs_diff"] = diff
    print(f"checkpoint {args.output_dir}: reloaded logits vs fake-quantized model, max |diff| = {diff:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(numbers, indent=1))


if __name__ == "__main__":
    main()
