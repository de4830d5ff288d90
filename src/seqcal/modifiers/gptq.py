"""GPTQModifier: Hessians from the calibration pass, GPTQ solve per Linear (math in algorithms.gptq)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from seqcal.algorithms import (
    GPTQNumericalError,
    gptq_quantize,
    importance_from_hessian,
    relative_output_error,
    symmetrize_upper,
)
from seqcal.algorithms.gptq_rows import row_chunked
from seqcal.algorithms.smoothing import smoothed_hessian
from seqcal.experts import every_token
from seqcal.modifiers.base import Batch, BatchCursor, Fold, QuantizedWeight, RunState, Statistic
from seqcal.modifiers.formats import weight_format
from seqcal.modifiers.hessians import SharedInputs, add_hessian
from seqcal.modifiers.importance import usable_importance, uses_importance
from seqcal.modifiers.quantization import QuantizationModifier
from seqcal.modifiers.round_to_nearest import quant_kwargs, rounded, rtn_quantize_module
from seqcal.modifiers.solve_chunks import chunk_bytes, dense_solve_bytes, split_rows
from seqcal.tracing.partition import Subgraph

logger = logging.getLogger("seqcal")

# "group"/"dynamic" ordering (g_idx in the checkpoint) was removed from compressed-tensors and vLLM.
ACTORDERS = (None, "static", "weight")


@dataclass
class GPTQModifier(QuantizationModifier):
    """GPTQ (Frantar et al., 2022) weight quantization, calibrated layer by layer.

    Args (besides QuantizationModifier's targets, scheme, config_groups, ignore):
        block_size: columns solved together (lazy batch updates).
        dampening_frac: fraction of mean(diag(H)) added to the diagonal.
        actorder: None, "static"/"weight" (column order by diag(H), same format) or "group" (g_idx saved).
        sequential_targets: layer classes to calibrate one by one (overrides the pipeline's inference).
        offload_hessians: accepted for llm-compressor compatibility; Hessians of one subgraph stay on device.
        batched_quantization: accepted for llm-compressor compatibility ("auto", a positive integer or None):
            stacking modules into one solve never changes the result; seqcal sizes its stacks itself.
        hessian_products: "float32" (default) or "bfloat16": dtype of each batch's X^T X matmul (the
            Hessian itself always accumulates in float32).

    Example:
        >>> GPTQModifier(scheme="W4A16", ignore=["lm_head"], dampening_frac=0.01)  # doctest: +SKIP
    """

    name: ClassVar[str] = "GPTQModifier"
    needs_calibration: ClassVar[bool] = True
    input_only: ClassVar[bool] = True  # Hessians need only each Linear's input
    importance_from_inputs: ClassVar[bool] = False  # imatrix_mse's E[x^2] is the Hessian's diagonal / 2
    block_size: int = 128
    dampening_frac: float = 0.01
    actorder: str | None = "static"
    sequential_targets: str | list[str] | None = None
    offload_hessians: bool = False
    hessian_products: str = "float32"  # seqcal: "bfloat16" computes each batch's X^T X on bf16 units
    sequential_update: bool = True  # deprecated in llm-compressor; accepted and ignored
    # llm-compressor 0.14 stacks same-shape modules into one solve ("auto": sized from free GPU memory, an int: at
    # most that many, None: one at a time). Rows are independent, so stacking never changes the codes; seqcal
    # stacks the modules sharing a Hessian, sized from max_device_memory (solve_chunks). Checked, then ignored.
    batched_quantization: str | int | None = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        bq = self.batched_quantization
        if not (bq is None or bq == "auto" or (type(bq) is int and bq > 0)):
            raise ValueError(f"{self.name}: batched_quantization must be 'auto', a positive integer or null, "
                             f"got {bq!r}")  # fmt: skip
        if self.hessian_products not in ("float32", "bfloat16"):
            raise ValueError(
                f"{self.name}: hessian_products must be 'float32' or 'bfloat16', got {self.hessian_products!r}"
            )
        if self.actorder not in ACTORDERS:
            hint = " (group actorder was removed from compressed-tensors; use 'weight')" if self.actorder in (
                "group", "dynamic") else ""  # fmt: skip
            raise ValueError(f"{self.name}: actorder={self.actorder!r} is not one of {ACTORDERS}{hint}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"{self.name}: block_size must be a positive integer, got {self.block_size!r}")
        if isinstance(self.dampening_frac, bool) or not isinstance(self.dampening_frac, (int, float)):
            raise ValueError(
                f"{self.name}: dampening_frac must be a number in [0, 1), got {self.dampening_frac!r}"
            )
        if not 0 <= self.dampening_frac < 1:
            raise ValueError(f"{self.name}: dampening_frac must be in [0, 1), got {self.dampening_frac!r}")
        for group in self.groups.values():
            order = group.weights.actorder
            order = getattr(order, "value", order)
            if order is not None and order not in ACTORDERS:
                raise ValueError(f"{self.name}: weights.actorder={order!r} is not one of {ACTORDERS}")
        self._inputs = SharedInputs(add_hessian(self.hessian_products))  # Hessians by module name
        self._hessians: dict[tuple[int, str], torch.Tensor] = {}
        self._dense_solve = 0  # bytes of the model's largest solve outside routed experts (solve_chunks)

    def initialize(self, model: torch.nn.Module, state: RunState) -> None:
        super().initialize(model, state)
        self._dense_solve = dense_solve_bytes(model, self.modules)

    def layer_targets(self) -> str | list[str] | None:
        return self.sequential_targets

    def solves_rows_in_chunks(self) -> bool:
        """Whether a host budget's lean solve (``state.config.in_place_factor``) takes every module of this modifier
        a chunk of rows at a time (``gptq_rows.row_chunked``: per-row qparams of the min-max observer); the plan
        counts the solve's weight-sized copies from it."""
        kwargs = [(quant_kwargs(s), weight_format(s) is not None) for s in self.modules.values()]
        return all(row_chunked(kw["strategy"], kw["observer"], block) for kw, block in kwargs)

    @contextlib.contextmanager
    def calibrate(
        self, subgraph: Subgraph, model: torch.nn.Module, state: RunState, batches: BatchCursor
    ) -> Iterator[None]:
        names = [n for n in self.modules_in(subgraph) if n not in state.results.quantized]
        # experts calibrated on all tokens only while H accumulates; static input scales from the same inputs
        with self._inputs.hooks(names, model, batches), every_token(model, names), \
                self.inputs.hooks(names, model, state, batches), self.kv_hooks(subgraph, model, state, batches):  # fmt: skip
            yield

    def observe(self, names: list[str], x: torch.Tensor, state: RunState, batch: Batch) -> None:
        mine = [n for n in names if n in self.modules and n not in state.results.quantized]
        if not mine:
            return
        self.inputs.observe(mine, x, state, batch)
        self._inputs.observe(mine, x, batch)

    def on_fold(self, fold: Fold, model: torch.nn.Module, state: RunState) -> None:
        """Move the Hessians of the fold's consumers to the new inputs ``X / s``: ``H' = S^-1 H S^-1`` (exact).

        Static input observers cannot be moved exactly (a per-tensor range of ``X / s`` is not a function of
        the range of ``X``): a fold after they observed is refused. The executor folds before they observe.
        """
        consumers = [n for n in fold.mapping.consumers if n in self._inputs.acc]
        if seen := [n for n in fold.mapping.consumers if n in self.inputs.observers]:
            raise RuntimeError(
                f"{self.name}: scales were folded into {seen[0]} after its static input observer saw inputs; "
                "a transform must fold before the quantizers observe the group (modifier order in the recipe)"
            )
        for acc in {id(self._inputs.acc[n]): self._inputs.acc[n] for n in consumers}.values():
            if acc.H is not None:
                acc.H = smoothed_hessian(acc.H, fold.scales)

    def partial_statistics(self) -> dict[str, dict[str, Statistic]]:
        """Per shared Hessian ``hessian:<modules>`` (``SharedInputs.partial_statistics``), the static input
        ranges and the KV cache's ranges as ``QuantizationModifier`` gives them."""
        return {**super().partial_statistics(), **self._inputs.partial_statistics("hessian")}

    def load_statistics(self, reduced: dict[str, dict[str, torch.Tensor]]) -> None:
        super().load_statistics(reduced)
        self._inputs.load_statistics(reduced, "hessian")

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        names = [n for n in self.modules_in(subgraph) if n not in state.results.quantized]
        if self.mixed is not None:  # each unit's scheme from its errors under every candidate, with H
            self.mixed.assign(
                names, model, self.modules, state, lambda n: (self._hessian(n), None), rounded
            )
        solved: dict[tuple[int, str], list[str]] = {}  # (accumulator, scheme) -> modules solved together
        for name in names:
            acc = self._inputs.acc.pop(name, None)
            if acc is None or acc.H is None:
                state.results.log.append(
                    f"{name}: never called during calibration; quantized round-to-nearest"
                )
                self.prepare_global_scales(model, [name])
                module, scheme = model.get_submodule(name), self.modules[name]
                state.results.quantized[name] = rtn_quantize_module(
                    module, scheme, self._global_scales.get(name),
                    importance=usable_importance(name, scheme, None, module.weight.shape[1], state),
                )  # fmt: skip
                continue
            # Rows of a weight are solved independently given H: modules reading the same input (q/k/v,
            # gate/up) are stacked into one solve, one Cholesky and one column loop instead of several.
            # (not blocks: a block of rows would straddle two stacked modules)
            per_row = quant_kwargs(self.modules[name])["strategy"] in ("channel", "group", "tensor_group")
            key = (id(acc), repr(self.modules[name])) if per_row else (id(acc), name)
            solved.setdefault(key, []).append(name)
            state.results.module_errors.setdefault(name, {})["tokens"] = acc.n
            self._hessians[key] = _whole(acc)
        limit = self._chunk_limit(subgraph, model, state)
        self.prepare_global_scales(model, [n for group in solved.values() for n in group])
        for key, group in solved.items():
            H = self._hessians.pop(key)
            chunks = _chunks(group, model, limit)
            if len(chunks) > 1:
                logger.info("seqcal: %d modules sharing one Hessian (%s, ...) solved in %d chunks of at most "
                            "%.0f MiB", len(group), group[0], len(chunks), limit / 2**20)  # fmt: skip
            for chunk in chunks:
                start = time.perf_counter()
                self._solve(chunk, model, H, state)  # its column loop runs on one intra-op thread
                seconds = (time.perf_counter() - start) / len(chunk)
                for name in chunk:
                    errors = state.results.module_errors.setdefault(name, {})
                    errors["gptq_seconds"], errors["solve_chunks"] = seconds, len(chunks)
        self.inputs.finish(names, model, state)
        return self.kv_finish(subgraph, model, state) or bool(names)

    def _hessian(self, name: str) -> torch.Tensor | None:
        """The whole (symmetric) Hessian of ``name``'s inputs, or None when it was never called."""
        acc = self._inputs.acc.get(name)
        return None if acc is None or acc.H is None else _whole(acc)

    def _chunk_limit(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> int:
        """Bytes one stacked solve of ``subgraph`` may take: from the device budget when the run has one,
        less the subgraph's weights and this modifier's Hessians (on the device while it solves)."""
        resident = 0
        if state.config.device_budget is not None:
            params = {id(p): p for m in subgraph.modules for p in model.get_submodule(m).parameters()}
            resident = sum(p.nbytes for p in params.values() if p.device.type != "meta")
            hessians = [H.nbytes for H in self._hessians.values()]
            resident += sum(hessians) + max(hessians, default=0)  # and the solve's Cholesky factor
        return chunk_bytes(self._dense_solve, state.config.device_budget, resident)

    def _solve(self, names: list[str], model: torch.nn.Module, H: torch.Tensor, state: RunState) -> None:
        scheme = self.modules[names[0]]
        kw = quant_kwargs(scheme)
        modules = [model.get_submodule(n) for n in names]
        rows = [m.weight.shape[0] for m in modules]
        W = torch.cat([m.weight.data for m in modules]) if len(modules) > 1 else modules[0].weight.data
        # a module solved alone takes Q in its weight's own memory (the error of each chunk taken first), unless that
        # memory is shared with another tensor's
        overwrite = len(modules) == 1 and W.is_contiguous() and W.untyped_storage().nbytes() == W.nbytes
        order = getattr(scheme.weights.actorder, "value", scheme.weights.actorder) or self.actorder
        fmt, globals_ = weight_format(scheme), [self._global_scales.get(n) for n in names]
        per_row_global = None  # NVFP4: each stacked module keeps its own (fused group's) global scale
        if fmt is not None and fmt.needs_global_scale:
            per_row_global = (
                torch.cat([g.expand(r) for g, r in zip(globals_, rows)]).reshape(-1, 1).to(W.device)
            )
        # pruned modules (SparseGPT, Wanda earlier in the recipe) keep their zeros through the solve
        pruned = (W == 0) if any(n in state.results.sparsity for n in names) else None
        # imatrix_mse: E[x^2] is the Hessian's diagonal / 2, no second accumulation
        importance = importance_from_hessian(H) if uses_importance(scheme) else None
        importance = usable_importance(", ".join(names), scheme, importance, W.shape[1], state)
        try:
            result = gptq_quantize(
                W, H, block_size=self.block_size, dampening_frac=float(self.dampening_frac),
                actorder=order, fmt=fmt, global_scale=per_row_global, pruned=pruned, importance=importance, **kw,
                in_place_factor=state.config.in_place_factor, overwrite=overwrite,
                row_chunks=state.config.in_place_factor,  # a budget's lean solve: both, or neither
            )  # fmt: skip
        except GPTQNumericalError as exc:
            for name, module, g in zip(names, modules, globals_):
                state.results.log.append(f"{name}: GPTQ failed ({exc}); fell back to round-to-nearest")
                state.results.quantized[name] = rtn_quantize_module(module, scheme, g, importance=importance)
            return
        if result.retries:
            state.results.log.append(f"{', '.join(names)}: Cholesky needed {result.retries} retries "
                             f"(dampening {result.dampening_frac})")  # fmt: skip
        split = _splitter(rows)
        for name, module, Q, q, scale, zp, loss in zip(
            names, modules, split(result.Q), split(result.q), split(result.scale),
            split(result.zero_point), split(result.row_loss),
        ):  # fmt: skip
            errors = state.results.module_errors.setdefault(name, {})
            if result.rel_error is None:
                errors["rel_error"] = relative_output_error(module.weight.data, Q, H)
                module.weight.data = Q.contiguous()
            else:  # Q is the weight's own memory already
                errors["rel_error"] = result.rel_error
            errors["gptq_loss"] = loss.sum().item()
            state.results.quantized[name] = QuantizedWeight(
                q=q.contiguous(), scale=scale.contiguous(),
                zero_point=None if kw["symmetric"] else zp.contiguous(),
                g_idx=result.g_idx, scheme=scheme, loss=loss.sum().item(), global_scale=self._global_scales.get(name),
            )  # fmt: skip


def _whole(acc: Any) -> torch.Tensor:
    """The accumulator's Hessian made whole from its upper triangle, once (it is shared by q/k/v)."""
    if not acc.symmetric:
        acc.symmetric, acc.upper = True, False
        symmetrize_upper(acc.H)
    return acc.H


def _chunks(names: list[str], model: torch.nn.Module, max_bytes: int) -> list[list[str]]:
    """Split modules solved with one Hessian (the experts of a layer fed every token share it) into chunks
    whose stacked solve stays under ``max_bytes`` (``solve_chunks``), so that a layer with hundreds of
    experts is not stacked on the device at once."""
    weights = [model.get_submodule(n).weight for n in names]
    n_in = weights[0].shape[1]
    return [[names[i] for i in chunk] for chunk in split_rows([w.shape[0] for w in weights], n_in, max_bytes)]


def _splitter(rows: list[int]) -> Any:
    """Split a stacked per-row tensor ([sum(rows), ...]) back into the modules' parts."""

    def split(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if t.dim() == 0 or t.shape[0] != sum(rows):  # per-tensor qparams are shared
            return tuple(t for _ in rows)
        return torch.split(t, rows)

    return split
