"""QuIPModifier: Hadamard rotations on both sides of every targeted Linear (QuIP, QuIP#), llm-compressor's arguments.

``v`` rotates a Linear's input: the weight becomes ``W R`` (fused) and the input ``x R`` at run time; ``u``
rotates its output: ``R^T W`` (fused) and ``y R^T`` at run time. The quantizers that follow in the recipe see the
rotated weights and inputs, whose outliers the rotation spread over the channels (W4A4, NVFP4, MXFP4). The online
halves are written to the checkpoint's ``transform_config`` (groups "v" and "u", as llm-compressor writes them).

Example:
    >>> QuIPModifier(rotations=["v"], transform_block_size=64).rotations
    ['v']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from seqcal.mappings.names import checkpoint_names
from seqcal.modifiers.rotations import Edit, RotationModifier
from seqcal.modifiers.schemes import matches_target
from seqcal.modifiers.transform_config import check_same

ROTATIONS = ("v", "u")


@dataclass
class QuIPModifier(RotationModifier):
    """QuIP's incoherence rotations (Chee et al., 2023; Tseng et al., 2024) as llm-compressor 0.14's QuIPModifier.

    Args:
        rotations: "v" (input side) and/or "u" (output side); llm-compressor recommends ["v"].
        targets: modules to rotate (compressed-tensors patterns); only Linears are rotated.
        ignore: modules to leave alone.
        transform_type, randomize, learnable, precision, transform_block_size, transform_config: see
            ``RotationModifier``.
    """

    name: ClassVar[str] = "QuIPModifier"
    rotations: list[str] = field(default_factory=lambda: ["v"])
    targets: Any = "Linear"
    ignore: Any = "lm_head"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.rotations, str):
            self.rotations = [self.rotations]
        self.rotations = [str(r).lower() for r in self.rotations]
        if not self.rotations or any(r not in ROTATIONS for r in self.rotations):
            raise ValueError(
                f"{self.name}: rotations must be a non-empty list of 'v' and 'u', got {self.rotations!r}"
            )
        self.targets = [self.targets] if isinstance(self.targets, str) else list(self.targets)
        self.ignore = [self.ignore] if isinstance(self.ignore, str) else list(self.ignore or [])
        if self._given is not None:  # QuIP's groups need no model: checked with the recipe's line
            check_same(self._given, self.transform_groups(None), self.name)

    def arguments_from(self, groups: dict[str, Any]) -> dict[str, Any]:
        if unknown := [g for g in groups if g not in ROTATIONS]:
            raise ValueError(f"{self.name}: transform_config.config_groups.{unknown[0]} is not a QuIP rotation; "
                             "seqcal's QuIPModifier builds groups v (inputs) and u (outputs) only: remove it")  # fmt: skip
        first = next(iter(groups.values()), {})
        side = (first.get("apply") or [{}])[0]  # the two halves of a rotation name the same modules
        found = {"targets": side.get("targets"), "ignore": side.get("ignore")}
        return {"rotations": list(groups), **{k: v for k, v in found.items() if v is not None},
                "transform_block_size": first.get("head_dim")}  # fmt: skip

    def plan(self, model: torch.nn.Module) -> list[Edit]:
        aliases = checkpoint_names(model)
        edits = []
        for name, module in model.named_modules():
            alias = aliases.get(name)
            if not matches_target(module, name, self.targets, alias) or matches_target(
                module, name, self.ignore, alias
            ):
                continue
            if not isinstance(module, torch.nn.Linear):
                raise ValueError(f"{self.name}: {name} ({type(module).__name__}) matches targets {self.targets} but "
                                 "only Linear modules can be rotated; add it to ignore")  # fmt: skip
            block = self.transform_block_size
            for side, width in (("v", module.in_features), ("u", module.out_features)):
                if side not in self.rotations:
                    continue
                if block is not None and width % block:
                    raise ValueError(f"{self.name}: transform_block_size {block} does not divide {name}'s width "
                                     f"{width}; choose a divisor of every targeted width")  # fmt: skip
                size = block or width
                fused, online = ("weight_input", "input") if side == "v" else ("weight_output", "output")
                edits += [Edit(name, fused, side, size), Edit(name, online, side, size)]
        if not edits:
            raise ValueError(f"{self.name}: targets {self.targets} (ignore {self.ignore}) match no Linear of "
                             f"{type(model).__name__}; check the patterns")  # fmt: skip
        return edits

    def transform_groups(self, model: torch.nn.Module | None) -> dict[str, Any]:
        groups = {}
        common = {"targets": self.targets, "ignore": self.ignore}
        if "v" in self.rotations:
            groups["v"] = self.scheme_json([{**common, "location": "input"},
                                            {**common, "location": "weight_input", "inverse": True}],
                                           self.transform_block_size)  # fmt: skip
        if "u" in self.rotations:
            groups["u"] = self.scheme_json([{**common, "location": "weight_output"},
                                            {**common, "location": "output", "inverse": True}],
                                           self.transform_block_size)  # fmt: skip
        return groups
