"""Experts as Linear modules: each expert's projections under the name its original checkpoint used.

``LinearExperts`` replaces a fused experts module for the duration of a run. Its children are ``"0"``,
``"1"``, ... each holding ``nn.Linear`` projections (``gate_proj``, ``up_proj``, ``down_proj`` or the
checkpoint's own names), so ``model.layers.3.mlp.experts.17.down_proj`` is an ordinary Linear: recipes
reach it with ``targets: [Linear]`` or ``re:`` patterns, GPTQ hooks it, and the checkpoint stores it per
expert. Its forward is transformers' eager experts loop on those Linears, with the gating function
(``_apply_gate``) and activation of the module it replaced, so outputs equal the fused module's.

With ``calibrate_all`` every expert runs on every token of the layer (its modules' inputs then cover all
tokens) while a modifier accumulates their inputs (``observed``, set by ``seqcal.experts.every_token``
for the calibration pass only: the propagation pass and plain forwards run the routed tokens alone), and
the layer's output still sums only the routed experts, weighted by the router: what flows downstream is
unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from seqcal.experts.layout import ExpertsLayout


class ExpertMLP(nn.Module):
    """One expert: its projections as ``nn.Linear`` modules named as in the original checkpoint.

    Args:
        weights: leaf name -> {"weight": [out, in], "bias": [out] when the experts have biases}.
    """

    def __init__(self, weights: dict[str, dict[str, torch.Tensor]]) -> None:
        super().__init__()
        for leaf, tensors in weights.items():
            self.add_module(leaf, _linear(tensors["weight"], tensors.get("bias")))


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` and ``bias`` as they are, without Linear's random init: a layer
    with 384 experts builds thousands of them, and the init would cost more than the whole trace."""
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)
    linear.out_features, linear.in_features = weight.shape
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
    return linear


class LinearExperts(nn.Module):
    """A fused experts module taken apart into per-expert Linears (see the module docstring).

    Args:
        fused: the experts module it replaces (kept, without its 3-D parameters, for its gating function,
            activation and config; ``restore`` puts it back).
        layout: how ``fused`` stored the experts.
        calibrate_all: run every expert on every token while ``observed`` (routing still decides the output).
    """

    def __init__(self, fused: nn.Module, layout: ExpertsLayout, calibrate_all: bool = True) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a child: its parameters are the Linears below now
        self.layout = layout
        self.calibrate_all = calibrate_all
        self.observed = False  # a modifier is accumulating its experts' inputs (seqcal.experts.every_token)
        # Called with each expert's output on its routed tokens: (expert, token_idx [n], gate weights [n],
        # output [n, H]), before the weighting (REAP's saliency); added and removed by a modifier's calibrate.
        self.taps: list[Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]] = []
        if layout.has_post_expert_norm:
            self.post_expert_norm = fused.post_expert_norm

    @property
    def experts(self) -> list[ExpertMLP]:
        return [self.get_submodule(str(e)) for e in range(self.layout.num_experts)]

    def _run_expert(self, expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.layout.names
        if self.layout.has_gate:
            # the fused order, so that the replaced module's own gating (GPT-OSS clamps, interleaves) applies
            gate_up = self.layout.join_outputs([getattr(expert, gate)(x), getattr(expert, up)(x)])
            h = type(self.fused)._apply_gate(self.fused, gate_up)
        else:
            h = self.fused.act_fn(getattr(expert, up)(x))
        y = getattr(expert, down)(h)
        return self.post_expert_norm(y) if self.layout.has_post_expert_norm else y

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: object, **kwargs: object) -> torch.Tensor:  # fmt: skip
        """transformers' experts signature: tokens [T, H], chosen experts [T, K], their weights [T, K]."""
        out = torch.zeros_like(hidden_states)
        every = self.calibrate_all and self.observed
        for e in range(self.layout.num_experts):
            token_idx, top_k_pos = torch.where(top_k_index == e)
            if every:
                y = self._run_expert(self.get_submodule(str(e)), hidden_states)[token_idx]
            elif token_idx.numel():
                y = self._run_expert(self.get_submodule(str(e)), hidden_states[token_idx])
            else:
                continue
            weights = top_k_weights[token_idx, top_k_pos]
            for tap in self.taps:
                tap(e, token_idx, weights, y)
            y = y * weights[:, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out
