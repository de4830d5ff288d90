"""Write a learned-rounding modifier (API v2 services): each MLP weight is rounded up or down as signed
gradient descent on its MLP's output error decides (AutoRound-like), and saved as int4 per channel.

``SignRound`` records every MLP's calls in the calibration pass (``SpanCache``); in ``compress`` it learns
rounding offsets V in [-0.5, 0.5], q = clamp(round(W / s + V)), by re-running the MLP on those calls with the
fake-quantized weights (``SpanCache.gradients``, a straight-through rounding) against its full-precision
outputs (``SpanCache.outputs``). V = 0 is round to nearest, so the search starts from it.

Run:  python examples/learned_rounding.py --model DIR --output-dir out/signround
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from seqcal import oneshot
from seqcal.algorithms import dequantize, quant_range, quantize, weight_qparams
from seqcal.models import resolve_model
from seqcal.modifiers import QuantizationModifier, QuantizedWeight
from seqcal.modifiers.round_to_nearest import quant_kwargs
from seqcal.modifiers.spans import SpanCache

INT4 = {"group_0": {"targets": ["re:.*mlp\\.(gate|up|down)_proj$"],
                    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}}}  # fmt: skip


@dataclass
class SignRound(QuantizationModifier):
    """Learn each MLP weight's rounding on its MLP's output error (signed gradient descent, ``steps`` x ``lr``)."""

    name: ClassVar[str] = "SignRound"
    needs_calibration: ClassVar[bool] = True
    input_only: ClassVar[bool] = False  # re-runs whole MLPs on their recorded calls
    steps: int = 24
    lr: float = 0.02

    def __post_init__(self) -> None:
        super().__post_init__()
        self.spans: dict[str, SpanCache] = {}  # MLP -> its recorded calls
        self.losses: dict[str, tuple[float, float]] = {}  # MLP -> (round to nearest, learned)

    def shares_statistics(self) -> bool:
        return False  # the recorded calls stay in their process: one process only

    @contextlib.contextmanager
    def calibrate(self, subgraph, model, state, batches):  # noqa: ANN001, ANN201 - entered once per shard of the data
        for parent in {n.rsplit(".", 1)[0] for n in self.modules_in(subgraph)}:
            span = self.spans.setdefault(parent, SpanCache(max_bytes=1 << 30))
            hook = span.hook(lambda: batches.current.token_mask)
            handle = model.get_submodule(parent).register_forward_pre_hook(hook, with_kwargs=True)
            self.handles = [*getattr(self, "handles", []), handle]
        try:
            yield
        finally:
            for handle in self.__dict__.pop("handles", []):
                handle.remove()

    def compress(self, subgraph, model, state) -> bool:  # noqa: ANN001
        for parent, span in [(p, self.spans.pop(p)) for p in list(self.spans)]:
            mlp, names = model.get_submodule(parent), [n for n in self.modules if n.startswith(parent + ".")]
            want, kw = span.outputs(mlp, state.config.device), quant_kwargs(self.modules[names[0]])
            W = {n.rsplit(".", 1)[1]: model.get_submodule(n).weight.detach() for n in names}
            scales = {k: weight_qparams(w, **kw)[0] for k, w in W.items()}  # symmetric: no zero point
            s = {k: v.float() for k, v in scales.items()}
            V = {k: torch.zeros_like(w, dtype=torch.float32, requires_grad=True) for k, w in W.items()}
            lo, hi = quant_range(kw["num_bits"])

            def fake(offsets, W=W, s=s, lo=lo, hi=hi):  # noqa: ANN001, ANN202 - straight-through rounding
                r = {k: W[k].float() / s[k] + offsets[k] for k in W}
                return {f"{k}.weight": (((r[k].round() - r[k]).detach() + r[k]).clamp(lo, hi) * s[k]).to(W[k].dtype)
                        for k in W}  # fmt: skip

            def loss(y, i, want=want):  # noqa: ANN001, ANN202
                return (y.float() - want[i].float()).pow(2).mean()

            rtn = best = span.gradients(mlp, state.config.device, V, fake, loss)  # V = 0: round to nearest
            kept = {k: v.detach().clone() for k, v in V.items()}
            for _ in range(self.steps):
                with torch.no_grad():
                    for v in V.values():
                        v -= self.lr * v.grad.sign()
                        v.clamp_(-0.5, 0.5).grad = None
                current = span.gradients(mlp, state.config.device, V, fake, loss)
                if current < best:  # signed steps do not always descend: keep the best offsets seen
                    best, kept = current, {k: v.detach().clone() for k, v in V.items()}
            self.losses[parent] = (rtn, best)
            for name in names:
                module, k = model.get_submodule(name), name.rsplit(".", 1)[1]
                q = quantize(W[k].float() + kept[k] * s[k], s[k], num_bits=kw["num_bits"])  # round(W / s + V)
                module.weight.data = dequantize(q, scales[k], dtype=W[k].dtype)
                state.results.quantized[name] = QuantizedWeight(q, scales[k], None, None, self.modules[name])
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--output-dir", default="out/examples/signround")
    args = parser.parse_args()
    data = ["Calibration text about rivers, bridges and the weather in the hills."] * 4
    modifier = SignRound(config_groups=INT4)
    oneshot(model=str(resolve_model(args.model)), dataset=data, recipe=[modifier], output_dir=args.output_dir,
            overwrite=True, max_seq_length=64)  # fmt: skip
    rtn, learned = (sum(pair[i] for pair in modifier.losses.values()) for i in (0, 1))
    print(f"MLP output error summed over layers: round to nearest {rtn:.6g}, learned rounding {learned:.6g}")


if __name__ == "__main__":
    main()
