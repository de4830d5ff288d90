"""Modifiers: the algorithms that hook into the sequential loop. Registry by recipe name."""

from seqcal.modifiers.base import Modifier, QuantizedWeight, RunState
from seqcal.modifiers.gptq import GPTQModifier
from seqcal.modifiers.quantization import QuantizationModifier
from seqcal.modifiers.sparsegpt import SparseGPTModifier
from seqcal.modifiers.wanda import WandaPruningModifier

# Recipe name -> class. A literal dict: a miss lists exactly these names.
MODIFIERS: dict[str, type[Modifier]] = {
    "QuantizationModifier": QuantizationModifier,
    "GPTQModifier": GPTQModifier,
    "SparseGPTModifier": SparseGPTModifier,
    "WandaPruningModifier": WandaPruningModifier,
}

__all__ = [
    "MODIFIERS",
    "GPTQModifier",
    "Modifier",
    "QuantizationModifier",
    "QuantizedWeight",
    "RunState",
    "SparseGPTModifier",
    "WandaPruningModifier",
]
