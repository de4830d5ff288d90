"""Trace a model, look at its subgraphs, export the graph, then read the per-layer errors of a run.

1. ``trace_subgraphs`` cuts the model into subgraphs, one per decoder layer by default (plus the part
   before the first layer), and ``subgraphs.run`` executes them one by one: on inputs other than the trace
   sample (another length, padding) it returns what the unpartitioned model returns.
2. ``seqcal.report.export_graph`` writes the traced graph as JSON, DOT, SVG, one HTML page or ONNX.
3. After ``oneshot``, ``quantization_report.json`` in the checkpoint holds the relative output error of
   every subgraph (quantized vs full precision) and the GPTQ loss of every module.

Run:
    python examples/trace_and_inspect.py                     # SmolLM2-135M-Instruct
    python examples/trace_and_inspect.py --model DIR --format svg --output-dir out/inspect
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from seqcal import oneshot, trace_subgraphs
from seqcal.models import resolve_model
from seqcal.modifiers import GPTQModifier
from seqcal.report import FORMATS, export_graph, trace_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="default", help="model directory, or 'default' (SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--format", default="html", choices=sorted(FORMATS), help="graph export format")
    parser.add_argument("--num-calibration-samples", type=int, default=32)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--output-dir", default="out/examples/inspect")
    args = parser.parse_args()
    out = Path(args.output_dir)

    path = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)

    # 1. Trace on one sample; the subgraphs follow the model's layers.
    sample = tokenizer("A short sentence to trace the model with.", return_tensors="pt")
    subgraphs = trace_subgraphs(model, sample)
    print(trace_report(subgraphs))  # subgraph table, and every spot that runs opaquely (file:line, why)
    print(f"\n{len(subgraphs)} subgraphs; targets: {subgraphs.targets}")

    # Run them on a padded batch of two other texts and compare with the model itself.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(["Another input, longer than the trace sample was.", "Short one."],
                      return_tensors="pt", padding=True)  # fmt: skip
    with torch.no_grad():
        diff = (subgraphs.run(**batch).logits - model(**batch).logits).abs().max().item()
    print(
        f"partitioned vs eager on a padded batch {tuple(batch['input_ids'].shape)}: max |diff| = {diff:.2e}"
    )

    # 2. Export the graph: open the HTML page or SVG in a browser, the .onnx in Netron.
    graph = export_graph(subgraphs, args.format, out / f"graph.{args.format}", sample=sample)
    print(f"graph: {graph}")

    # 3. Quantize and read the per-layer errors the run wrote next to the checkpoint.
    ckpt = out / "checkpoint"
    oneshot(model=str(path), dataset="default", recipe=GPTQModifier(scheme="W4A16", ignore=["lm_head"]),
            num_calibration_samples=args.num_calibration_samples, max_seq_length=args.max_seq_length,
            output_dir=str(ckpt), overwrite=True)  # fmt: skip
    report = json.loads((ckpt / "quantization_report.json").read_text())
    print("\nrelative output error per subgraph (quantized vs full precision):")
    for row in report["subgraphs"]:
        error = row.get("rel_error")
        print(f"  {row['index']:>3}  {'-' if error is None else format(error, '.3e'):>9}  "
              f"{', '.join(row['targets']) or '(before the first target)'}")  # fmt: skip
    worst = sorted(report["modules"].items(), key=lambda kv: -kv[1].get("gptq_loss", 0.0))[:5]
    print("largest GPTQ losses:")
    for name, errors in worst:
        print(f"  {name:<40} {errors.get('gptq_loss', float('nan')):.4g}")


if __name__ == "__main__":
    main()
