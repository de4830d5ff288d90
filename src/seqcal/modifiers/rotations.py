"""What the rotation modifiers share (QuIPModifier, SpinQuantModifier): a plan of edits, applied per subgraph.

A rotation modifier plans, before any weight is read (``validate``), which module gets which rotation on which
side (``Edit``) and which norms are folded into the Linears they feed; a width it cannot rotate stops the run
there, naming the module. The edits are applied to each subgraph's weights while they are onloaded, the first
time the subgraph is calibrated or compressed, before any quantizer of the subgraph reads a weight or an input
(the run is cut after each layer, ``input_only = False``): the rotations fused into weights are exact in float,
and the online ones (an activation rotated at run time) are forward hooks on the module (``prepend``: before the
quantizers' hooks, which then see the rotated input, as the runtime quantizes it). The online hooks stay on the
returned model: they are part of its function, as compressed-tensors' own transforms are. Every edited module is
recorded in ``state.ledger.changed`` (written to the checkpoint, restored on resume); the online rotations are written
to the checkpoint's ``transform_config`` and their matrices as its tensors (``state.results.transform_tensors``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from seqcal.algorithms.rotations import (
    TRANSFORM_TYPES,
    hadamard_matrix,
    rotate,
    rotate_weight_input,
    rotate_weight_output,
    supported,
)
from seqcal.modifiers.base import BatchCursor, Modifier, RunState
from seqcal.modifiers.transform_config import apply_arguments, check_same, common_arguments, normalized_groups
from seqcal.tracing.partition import Subgraph

ONLINE = ("input", "output")  # locations applied to activations at run time
# A norm whose smallest weight is below this fraction of its median spans more than 1 / FAINT: folded into the
# Linears after it, it makes their columns' scales that unequal, and round to nearest of them can lose more than
# the rotation gains (measured on SmolLM2-135M, whose norms span up to 1e4: the fold alone, no rotation, costs more
# than any rotation gave back).
FAINT = 0.01
PRECISIONS = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16}  # fmt: skip


@dataclass(frozen=True)
class Edit:
    """One rotation of one module: ``location`` as in compressed-tensors' TransformArgs (``weight_input``,
    ``weight_output``, ``input``, ``output``), ``scheme`` its config group ("v", "R1"), ``size`` the block order."""

    module: str
    location: str
    scheme: str
    size: int


@dataclass
class RotationModifier(Modifier):
    """Base of the Hadamard rotation modifiers: the arguments they share and the per-subgraph application.

    Args:
        transform_type: "hadamard" (deterministic, Sylvester's) or "random-hadamard" (random signs).
        randomize, learnable: llm-compressor's arguments; only False is implemented.
        precision: dtype of the online rotations ("float64" as llm-compressor on a CPU, or float32, ...).
        transform_block_size: rotate in blocks of this order (block-diagonal); None: the whole width.
        transform_config: llm-compressor's override of the whole scheme, as its recipe.yaml saves it: read back
            into the arguments it stands for; one seqcal cannot build from arguments is refused, naming the field.
    """

    name: ClassVar[str] = "RotationModifier"
    needs_calibration: ClassVar[bool] = False  # data-free: the rotations are fixed matrices
    input_only: ClassVar[bool] = False  # the online rotations rewrite inputs: the run is cut after each layer
    transform_type: str = "hadamard"
    randomize: bool = False
    learnable: bool = False
    precision: Any = "float64"
    transform_block_size: int | None = None
    transform_config: Any = None

    def __post_init__(self) -> None:
        self._given: dict[str, Any] | None = None  # the transform_config's groups, normalized
        if self.transform_config is not None:  # llm-compressor's saved recipe: the arguments it stands for
            self._given = normalized_groups(self.transform_config, self.name)
            if not self._given:
                raise ValueError(f"{self.name}: transform_config.config_groups is empty, so it applies no rotation; "
                                 "remove transform_config (the modifier's arguments then say which) or the modifier")  # fmt: skip
            apply_arguments(
                self, {**common_arguments(self._given, self.name), **self.arguments_from(self._given)}
            )
        if self.transform_type == "random-matrix":
            raise ValueError(f"{self.name}: transform_type 'random-matrix' is not implemented in seqcal; use "
                             "'hadamard' or 'random-hadamard'")  # fmt: skip
        if self.transform_type not in TRANSFORM_TYPES:
            raise ValueError(f"{self.name}: transform_type must be one of {', '.join(TRANSFORM_TYPES)}, got "
                             f"{self.transform_type!r}")  # fmt: skip
        for flag in ("randomize", "learnable"):
            if getattr(self, flag):
                raise ValueError(f"{self.name}: {flag}=True is not implemented in seqcal; remove it (False)")
        name = str(self.precision).removeprefix("torch.")
        if name not in PRECISIONS:
            raise ValueError(
                f"{self.name}: precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        self._dtype = PRECISIONS[name]
        block = self.transform_block_size
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block <= 0):
            raise ValueError(
                f"{self.name}: transform_block_size must be a positive int or null, got {block!r}"
            )
        self._edits: list[Edit] = []
        self._norms: list[tuple[str, list[str]]] = []  # norm -> the Linears it feeds (SpinQuant's fusion)
        self._done: set[str] = set()
        self._hooks: list[Any] = []
        self._matrices: dict[tuple[str, int], torch.Tensor] = {}
        # folded norms spanning more than 1 / FAINT: (norm, smallest |weight|, median |weight|)
        self._faint: list[tuple[str, float, float]] = []

    # --- what subclasses give -------------------------------------------------------------------------------
    def plan(self, model: torch.nn.Module) -> list[Edit]:
        """Every edit, in the order it is applied (subclasses; may fill ``self._norms``)."""
        raise NotImplementedError

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Before the first subgraph (subclasses: untie embeddings)."""

    def arguments_from(self, groups: dict[str, Any]) -> dict[str, Any]:
        """The arguments a transform_config's groups stand for (subclasses; ``modifiers/transform_config.py``)."""
        return {}

    # --- the lifecycle --------------------------------------------------------------------------------------
    def validate(self, model: torch.nn.Module) -> None:
        self._norms = []
        self._edits = self.plan(model)
        for e in self._edits:
            online = e.location in ONLINE
            if not supported(e.size, self.transform_type, kronecker=not online):
                raise ValueError(
                    f"{self.name}: {e.module} needs a {self.transform_type} rotation of order {e.size} ({e.location})"
                    ", which does not exist; set transform_block_size to a power of two dividing it"
                    + ("" if online else ", or use transform_type 'random-hadamard'")
                )
        if self._given is not None:  # before any weight is read: what the run applies is what the config says
            check_same(self._given, self.transform_groups(model), self.name)

    def initialize(self, model: torch.nn.Module, state: RunState) -> None:
        if not self._edits:
            self.validate(model)
        self._done, self._hooks, self._faint = set(), [], []
        gen = torch.Generator().manual_seed(0)
        self._matrices = {}
        for e in self._edits:  # one matrix per scheme and order, in plan order (random ones reproducible)
            if (e.scheme, e.size) not in self._matrices:
                self._matrices[(e.scheme, e.size)] = hadamard_matrix(e.size, self.transform_type, gen)
        self.prepare_model(model)
        state.results.transform_tensors.update(self.checkpoint_tensors(model))
        state.results.transform_config.setdefault("config_groups", {}).update(self.transform_groups(model))

    def modules_in(self, subgraph: Subgraph) -> list[str]:
        """The modules this modifier rotates in ``subgraph`` (the norms it folds are not listed: no weight matrix)."""
        return [n for n in dict.fromkeys(e.module for e in self._edits) if subgraph.holds(n)]

    @contextlib.contextmanager
    def calibrate(
        self, subgraph: Subgraph, model: torch.nn.Module, state: RunState, batches: BatchCursor
    ) -> Iterator[None]:
        self._apply(
            subgraph, model, state
        )  # before any batch: the quantizers calibrate in rotated coordinates
        yield

    def compress(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        return self._apply(subgraph, model, state)  # data-free runs: no calibration pass came first

    def replayed(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> None:
        self._done.update(n for n, _ in self._norms if subgraph.holds(n))
        for name in self.modules_in(subgraph):  # the restored weights are rotated already
            if name not in self._done:
                self._hook(model, name)
                self._done.add(name)

    def on_fold(self, fold: Any, model: torch.nn.Module, state: RunState) -> None:
        self._check_folds([fold])

    def finalize(self, model: torch.nn.Module, state: RunState) -> None:
        self._check_folds(state.ledger.folds)
        if note := self._faint_note():
            state.results.log.append(note)

    def _faint_note(self) -> str | None:
        """The log line for folded norms whose weights span more than ``1 / FAINT``, or None."""
        if not self._faint:
            return None
        norm, low, mid = min(self._faint, key=lambda f: f[1] / f[2])
        return (f"{self.name}: {len(self._faint)} norm(s) folded into the Linears they feed span more than "
                f"{1 / FAINT:g}x ({norm}: smallest {low:.2g} against a median of {mid:.2g}); round to nearest of the "
                "folded weights may lose more than the rotation gains; quantize with GPTQ, whose Hessians weigh each "
                "input channel, or use rotations that fold no norm (R2, R4)")  # fmt: skip

    def _check_folds(self, folds: list[Any]) -> None:
        """Scales folded into a module whose input or output is rotated online would act on rotated channels
        (checked as each fold is announced, before each subgraph for AWQ's, and at the end)."""
        online = {e.module for e in self._edits if e.location in ONLINE}
        touched = [n for f in folds for n in (f.mapping.producer, *f.mapping.consumers)]
        if hit := [n for n in touched if n in online]:
            raise ValueError(f"{self.name}: smoothing scales were folded into {hit[0]}, whose activations are rotated "
                             "online, which would change the model; use SpinQuantModifier rotations [R1, R2] with "
                             "AWQ or SmoothQuant, or drop the smoothing modifier")  # fmt: skip

    # --- the edits ------------------------------------------------------------------------------------------
    def _apply(self, subgraph: Subgraph, model: torch.nn.Module, state: RunState) -> bool:
        self._check_folds(state.ledger.folds)
        todo = [n for n in self.modules_in(subgraph) if n not in self._done]
        norms = [(n, linears) for n, linears in self._norms if subgraph.holds(n) and n not in self._done]
        if not todo and not norms:
            return False
        if done := [n for n in todo if n in state.results.quantized]:
            raise ValueError(f"{self.name}: {done[0]} was quantized before it was rotated; put {self.name} before "
                             "the quantizing modifiers in the recipe")  # fmt: skip
        with torch.no_grad():
            for norm, linears in norms:
                self._fuse_norm(model, norm, linears, subgraph)
            for e in self._edits:
                if e.module in todo and e.location not in ONLINE:
                    self._fuse(model, e)
        for name in [n for n, _ in norms]:
            self._done.add(name)
            state.ledger.changed.add(name)
        for name in todo:
            self._hook(model, name)
            self._done.add(name)
            state.ledger.changed.add(name)
        return True

    def _fuse_norm(self, model: torch.nn.Module, norm: str, linears: list[str], subgraph: Subgraph) -> None:
        """``W <- W diag(g)`` for each Linear the norm feeds, then ``g <- 1`` (norms commute with rotations)."""
        weight = model.get_submodule(norm).weight
        if missing := [n for n in linears if not subgraph.holds(n)]:
            raise ValueError(f"{self.name}: {norm} and {missing[0]} run in different subgraphs, so the norm cannot "
                             "be folded into it; give sequential_targets that keep them together")  # fmt: skip
        g = weight.detach().to(torch.float64)
        low, mid = g.abs().min().item(), g.abs().median().item()
        if low < FAINT * mid:
            self._faint.append((norm, low, mid))
        for name in linears:
            w = model.get_submodule(name).weight
            w.copy_((w.to(torch.float64) * g).to(w.dtype))  # [out, in] * [in]
        weight.fill_(1.0)

    def _fuse(self, model: torch.nn.Module, e: Edit) -> None:
        module = model.get_submodule(e.module)
        h = self._matrices[(e.scheme, e.size)]
        w = module.weight
        if isinstance(module, torch.nn.Embedding):  # y = E[token]: the output side is E's rows
            w.copy_(rotate(w.to(torch.float64), h).to(w.dtype))
            return
        if e.location == "weight_input":
            w.copy_(rotate_weight_input(w.to(torch.float64), h).to(w.dtype))
            return
        w.copy_(rotate_weight_output(w.to(torch.float64), h).to(w.dtype))
        if getattr(module, "bias", None) is not None:
            module.bias.copy_(rotate_weight_output(module.bias.to(torch.float64), h).to(module.bias.dtype))

    def _hook(self, model: torch.nn.Module, name: str) -> None:
        """The online rotations of ``name``: its input ``x R`` before every other pre-hook, its output ``y R^T``."""
        module = model.get_submodule(name)
        dtype = self._dtype
        for e in self._edits:
            if e.module != name or e.location not in ONLINE:
                continue
            h = self._matrices[(e.scheme, e.size)].to(dtype)
            if e.location == "input":

                def pre(_m: torch.nn.Module, args: tuple, h: torch.Tensor = h) -> tuple:
                    return (rotate(args[0], h.to(args[0].device)), *args[1:])

                self._hooks.append(module.register_forward_pre_hook(pre, prepend=True))
            else:

                def post(
                    _m: torch.nn.Module, _args: tuple, out: torch.Tensor, h: torch.Tensor = h
                ) -> torch.Tensor:
                    return rotate(out, h.T.to(out.device))

                self._hooks.append(module.register_forward_hook(post))

    # --- the checkpoint -------------------------------------------------------------------------------------
    def checkpoint_tensors(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The online rotations' matrices as compressed-tensors stores them: ``<module>.<scheme>_<location>.weight``
        (entries +-1, in ``precision``), one per scheme, location and order, under the first module using it."""
        order = {n: i for i, (n, _) in enumerate(model.named_modules())}
        out: dict[str, torch.Tensor] = {}
        seen: set[tuple[str, str, int]] = set()
        for e in sorted((e for e in self._edits if e.location in ONLINE), key=lambda e: order[e.module]):
            if (e.scheme, e.location, e.size) not in seen:
                seen.add((e.scheme, e.location, e.size))
                h = self._matrices[(e.scheme, e.size)]
                out[f"{e.module}.{e.scheme}_{e.location}.weight"] = h.to(self._dtype).contiguous()
        return out

    def transform_groups(self, model: torch.nn.Module) -> dict[str, Any]:
        """``transform_config.config_groups`` (compressed-tensors' TransformScheme as JSON) for this modifier."""
        raise NotImplementedError

    def scheme_json(self, apply: list[dict[str, Any]], head_dim: int | None) -> dict[str, Any]:
        """One TransformScheme as compressed-tensors serialises it (``apply``: its TransformArgs as dicts)."""
        from compressed_tensors.transform import TransformArgs, TransformScheme

        scheme = TransformScheme(
            type=self.transform_type, apply=[TransformArgs(**a) for a in apply], randomize=self.randomize,
            requires_grad=self.learnable, head_dim=head_dim, precision=self._dtype,
        )  # fmt: skip
        return scheme.model_dump(mode="json")
