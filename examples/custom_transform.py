"""Write a transform modifier (API v2): equalize each norm -> Linears group, then let GPTQ quantize it.

``SqrtEqualize`` gathers max |X_j| per input channel of every q/k/v and gate/up group, folds s = sqrt(max |X_j|)
into the norm before it (``state.fold``), and GPTQ W8A8 then quantizes the group in the new coordinates.
The mappings come from the traced graph; the pipeline rewrites the cached inputs and saves the changed norms.

Run:  python examples/custom_transform.py --model DIR --output-dir out/equalize
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from seqcal import oneshot
from seqcal.mappings import resolve_mappings
from seqcal.models import resolve_model
from seqcal.modifiers import Batch, GPTQModifier, Modifier, RunState


@dataclass
class SqrtEqualize(Modifier):
    """Fold s = sqrt(max |X_j|) into the norm before each group of Linears (data from the calibration)."""

    name: ClassVar[str] = "SqrtEqualize"
    needs_calibration: ClassVar[bool] = True
    input_only: ClassVar[bool] = True  # only the groups' inputs are needed: one pass per group
    transforms: ClassVar[bool] = True  # runs, and folds, before the quantizers see the group

    def prepare(self, graph, model, state: RunState) -> None:  # noqa: ANN001 - the graph with Linears as nodes
        self.maps = [m for m in resolve_mappings(model, graph, None, self.name) if m.kind == "norm"]
        self.absmax: dict[str, torch.Tensor] = {}

    def modules_in(self, subgraph) -> list[str]:  # noqa: ANN001
        return [c for m in self.maps for c in m.consumers if c in subgraph.targets]

    def upstream(self, subgraph) -> list[str]:  # noqa: ANN001 - the norms this modifier edits there
        return [m.producer for m in self.maps if m.consumers[0] in subgraph.targets]

    def observe(self, names: list[str], x: torch.Tensor, state: RunState, batch: Batch) -> None:
        seen = batch.real(x.detach()).abs().amax(dim=0).float()  # [in], padding tokens dropped
        for m in [m for m in self.maps if m.consumers[0] in names]:
            self.absmax[m.producer] = torch.maximum(self.absmax.get(m.producer, seen), seen)

    def compress(self, subgraph, model: torch.nn.Module, state: RunState) -> bool:  # noqa: ANN001
        for m in [m for m in self.maps if m.producer in self.absmax and m.consumers[0] in subgraph.targets]:
            state.fold(model, m, self.absmax.pop(m.producer).clamp_min(1e-5).sqrt())
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--output-dir", default="out/examples/equalize")
    args = parser.parse_args()
    path = resolve_model(args.model)
    data = ["Calibration text about rivers, bridges and the weather."] * 4
    recipe = [SqrtEqualize(), GPTQModifier(scheme="W8A8", ignore=["lm_head"])]
    oneshot(model=str(path), dataset=data, recipe=recipe, output_dir=args.output_dir, overwrite=True,
            max_seq_length=64)  # fmt: skip
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loaded = AutoModelForCausalLM.from_pretrained(args.output_dir).eval()  # reloads with compressed-tensors
    ids = AutoTokenizer.from_pretrained(path)(
        "A river flows under the bridge.", return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        want, got = reference(input_ids=ids).logits, loaded(input_ids=ids).logits
    print(
        f"relative logit error of the checkpoint vs full precision: {((got - want).norm() / want.norm()):.4f}"
    )


if __name__ == "__main__":
    main()
