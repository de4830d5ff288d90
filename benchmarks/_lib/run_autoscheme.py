"""auto-round's AutoScheme on the shared calibration windows (run in auto-round's venv: mixed_precision_smollm2.py).

``AutoRound(model, scheme=AutoScheme(...)).quantize()`` on the CPU (torch.compile off): AutoScheme scores every
candidate per layer (its delta loss, a forward and backward pass per candidate) and chooses the layers' schemes
under ``--avg-bits`` (its own count: 16-bit scales, a zero point per group); auto-round then quantizes each layer
at its width, with ``--iters`` steps of learned rounding (0: round to nearest; plain unless ``--opt-rtn``). q/k/v and gate/up share a scheme
(``shared_layers``: auto-round does not tie them by itself, and a serving engine loads each group as one weight).

AutoScheme and auto-round read calibration text by dataset name; both are given the windows of ``--tokens`` instead
(their ``get_dataloader`` replaced), so they see exactly the windows seqcal sees. AutoScheme's score cache goes to
a fresh directory, so no run reuses another's scores. The model is saved with its weights quantized and
dequantized (fp32, a plain transformers checkpoint) for the shared evaluator, and ``layer_schemes.json`` beside it
lists each Linear's bits and group size. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from safetensors.torch import load_file


def windows_loader(windows: torch.Tensor):
    """A stand-in for auto-round's ``get_dataloader``: the given windows, ``nsamples`` of them, ``bs`` a batch."""

    def get_dataloader(tokenizer, seqlen, dataset_name=None, seed=42, bs=8, nsamples=512):
        rows = windows[:nsamples, :seqlen]
        batches = [rows[i : i + bs] for i in range(0, len(rows), bs)]
        return [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in batches]

    return get_dataloader


def candidates(spec: str) -> list:
    """``W2A16:g64,...,W8A16:channel`` as auto-round schemes (symmetric int, weight-only)."""
    from auto_round.schemes import QuantizationScheme, preset_name_to_scheme

    out = []
    for item in spec.split(","):
        preset, _, group = item.partition(":")
        scheme = preset_name_to_scheme(preset)
        size = -1 if group == "channel" else int(group[1:]) if group else scheme.group_size
        out.append(QuantizationScheme(**{**scheme.__dict__, "group_size": size}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True, help="safetensors with input_ids [N, seq]")
    parser.add_argument("--out", required=True)
    parser.add_argument("--avg-bits", type=float, required=True)
    parser.add_argument("--options", required=True, help="comma-separated PRESET[:g<N>|:channel]")
    parser.add_argument(
        "--samples", type=int, default=32, help="windows for AutoScheme's scores and the tuning"
    )
    parser.add_argument("--iters", type=int, default=0, help="auto-round's learned-rounding steps (0: RTN)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--opt-rtn", action="store_true", help="auto-round's optimised RTN when --iters is 0")
    args = parser.parse_args()
    os.environ["AR_AUTO_SCHEME_CACHE"] = tempfile.mkdtemp(prefix="autoscheme-cache-")
    import auto_round.auto_scheme.delta_loss as delta_loss
    import auto_round.calib_dataset as calib_dataset
    from auto_round import AutoRound, AutoScheme
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    windows = load_file(args.tokens)["input_ids"][: args.samples]  # [N, seq]
    delta_loss.get_dataloader = calib_dataset.get_dataloader = windows_loader(windows)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    layers = range(model.config.num_hidden_layers)
    shared = [[f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"] for i in layers]
    shared += [[f"model.layers.{i}.mlp.{p}_proj" for p in ("gate", "up")] for i in layers]
    n, seq = windows.shape
    scheme = AutoScheme(avg_bits=args.avg_bits, options=candidates(args.options), shared_layers=shared,
                        nsamples=n, seqlen=seq, batch_size=args.batch_size, device_map="cpu",
                        enable_torch_compile=False)  # fmt: skip
    ar = AutoRound(model, tokenizer=tokenizer, scheme=scheme, iters=args.iters, nsamples=n, seqlen=seq,
                   batch_size=args.batch_size, dataset="seqcal-windows", device_map="cpu",
                   enable_torch_compile=False, disable_opt_rtn=not args.opt_rtn)  # fmt: skip
    model, layer_config = ar.quantize()
    tuned = time.perf_counter() - start
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    chosen = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            cfg = layer_config.get(name) or {
                k: getattr(module, k, None) for k in ("bits", "group_size", "sym")
            }
            chosen[name] = {"bits": cfg["bits"], "group_size": cfg["group_size"], "sym": cfg["sym"]}
    with open(os.path.join(args.out, "layer_schemes.json"), "w") as f:
        json.dump(chosen, f, indent=1)
    for name, cfg in chosen.items():
        if cfg["bits"] < 16:  # the weights hold the quantized values: at most 2**bits per group
            w = model.get_submodule(name).weight.detach()
            group = w.shape[1] if cfg["group_size"] == -1 else cfg["group_size"]
            levels = max(len(torch.unique(row[:group])) for row in w[:64])
            assert levels <= 2 ** cfg["bits"], f"{name} is not quantized in place ({levels} levels)"
    print(json.dumps({"tool": "auto-round", "tune_s": round(tuned, 1), "layers": len(chosen)}))


if __name__ == "__main__":
    main()
