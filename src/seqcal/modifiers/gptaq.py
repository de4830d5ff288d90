"""GPTAQModifier: GPTQ with asymmetric calibration (Li et al., 2025), GPTQModifier's arguments.

GPTQ fits each Linear to its own output on the inputs the quantized model gives it, ``min ||(W - Q) X~||``.
GPTAQ fits it to the full-precision model's output instead, ``min ||W X - Q X~||``: the inputs ``X`` of the
full-precision model and ``X~`` of the model quantized so far, so each layer also corrects the error of the
quantized inputs it receives. The statistics are declared (``gathers``), so the pipeline keeps the
full-precision stream, gathers them in every cut, reduces them across processes and resumes them; the solve is
``algorithms.gptaq``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from seqcal.algorithms import relative_output_error
from seqcal.algorithms.gptaq import gptaq_quantize
from seqcal.algorithms.gptq import GPTQNumericalError
from seqcal.modifiers.activations import calibrated_inputs
from seqcal.modifiers.base import Batch, BatchCursor, QuantizedWeight, RunState, Statistic
from seqcal.modifiers.formats import weight_format
from seqcal.modifiers.gptq import GPTQModifier
from seqcal.modifiers.needs import Gather
from seqcal.modifiers.round_to_nearest import quant_kwargs, rtn_quantize_module
from seqcal.tracing.partition import Subgraph


@dataclass
class GPTAQModifier(GPTQModifier):
    """GPTAQ weight quantization: GPTQModifier's arguments, plus ``alpha`` (the weight of the asymmetric term).

    Example:
        >>> GPTAQModifier(scheme="W4A16", ignore=["lm_head"])  # doctest: +SKIP
    """

    name: ClassVar[str] = "GPTAQModifier"
    alpha: float = 0.25
    # X~^T X~ and (X - X~)^T X~ [in, in] per module, summed over the real tokens (X: the full-precision stream's)
    gathers: ClassVar[tuple[Gather, ...]] = (
        Gather("xtx", lambda x: x.T @ x),
        Gather("dxxt", lambda x, ref: (ref - x).T @ x, reference=True),
        Gather("tokens", lambda x: x.new_tensor([x.shape[0]])),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or self.alpha < 0:
            raise ValueError(f"{self.name}: alpha must be a number >= 0, got {self.alpha!r}")

    def solves_rows_in_chunks(self) -> bool:
        return False  # GPTAQ's solve holds its whole weight (algorithms.gptaq)

    def validate(self, model: torch.nn.Module) -> None:
        super().validate(model)
        for name, scheme in self.modules.items():
            if calibrated_inputs(scheme) or weight_format(scheme) is not None or self.kv is not None:
                raise ValueError(
                    f"{self.name}: {name}'s scheme is not an integer weight-only scheme (static activations, fp8, "
                    "NVFP4/MX formats and kv_cache_scheme are GPTQModifier's); use GPTQModifier for it"
                )

    # Every statistic is declared above: none of GPTQ's own accumulation runs.
    @contextlib.contextmanager
    def calibrate(
        self, subgraph: Subgraph, model: torch.nn.Module, state: RunState, batches: BatchCursor
    ) -> Iterator[None]:
        yield

    def observe(self, names: list[str], x: torch.Tensor, state: RunState, batch: Batch) -> None:
        pass

    def partial_statistics(self) -> dict[str, dict[str, Statistic]]:
        return {}

    def load_statistics(self, reduced: dict[str, dict[str, torch.Tensor]]) -> None:
        pass

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        names = [n for n in self.modules_in(subgraph) if n not in state.results.quantized]
        for name in names:
            module, scheme = model.get_submodule(name), self.modules[name]
            try:
                stats = self.gathered(name)
            except KeyError:
                state.results.log.append(
                    f"{name}: never called during calibration; quantized round-to-nearest"
                )
                state.results.quantized[name] = rtn_quantize_module(module, scheme)
                continue
            n = float(stats["tokens"].item())
            H, dXXT = stats["xtx"].mul(2 / n), stats["dxxt"].mul(2 / n)  # GPTQ's H = 2 X^T X / tokens
            self._solve_one(name, module, H, dXXT, state)
            state.results.module_errors.setdefault(name, {})["tokens"] = int(n)
        return bool(names)

    def _solve_one(self, name: str, module: torch.nn.Module, H: torch.Tensor, dXXT: torch.Tensor,
                   state: RunState) -> None:  # fmt: skip
        scheme = self.modules[name]
        kw = quant_kwargs(scheme)
        order = getattr(scheme.weights.actorder, "value", scheme.weights.actorder) or self.actorder
        W = module.weight.data
        try:
            result = gptaq_quantize(
                W, H.to(W.device), dXXT.to(W.device), alpha=float(self.alpha), block_size=self.block_size,
                dampening_frac=float(self.dampening_frac), actorder=order, num_bits=kw["num_bits"],
                symmetric=kw["symmetric"], strategy=kw["strategy"], group_size=kw["group_size"],
                in_place_factor=state.config.in_place_factor,
            )  # fmt: skip
        except GPTQNumericalError as exc:
            state.results.log.append(f"{name}: GPTAQ failed ({exc}); fell back to round-to-nearest")
            state.results.quantized[name] = rtn_quantize_module(module, scheme)
            return
        errors = state.results.module_errors.setdefault(name, {})
        errors["rel_error"] = relative_output_error(W, result.Q, H.to(W.device))
        errors["gptq_loss"] = result.loss
        module.weight.data = result.Q.contiguous()
        state.results.quantized[name] = QuantizedWeight(
            q=result.q.contiguous(), scale=result.scale.contiguous(),
            zero_point=None if kw["symmetric"] else result.zero_point.contiguous(), g_idx=result.g_idx,
            scheme=scheme, loss=result.loss,
        )  # fmt: skip
