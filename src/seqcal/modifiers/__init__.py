"""Modifiers: the algorithms that hook into the sequential loop. Registry by recipe name."""

from seqcal.modifiers.autoround import AutoRoundModifier
from seqcal.modifiers.awq import AWQModifier
from seqcal.modifiers.base import Batch, BatchCursor, Modifier, QuantizedWeight, RunState
from seqcal.modifiers.gptaq import GPTAQModifier
from seqcal.modifiers.gptq import GPTQModifier
from seqcal.modifiers.keep_source import KeepSourceFormatModifier
from seqcal.modifiers.magnitude import ConstantPruningModifier, MagnitudePruningModifier
from seqcal.modifiers.mixed_precision import MixedPrecisionModifier
from seqcal.modifiers.needs import Gather, Needs
from seqcal.modifiers.quantization import QuantizationModifier
from seqcal.modifiers.quip import QuIPModifier
from seqcal.modifiers.reap import REAPPruningModifier
from seqcal.modifiers.smoothquant import LogarithmicEqualizationModifier, SmoothQuantModifier
from seqcal.modifiers.sparsegpt import SparseGPTModifier
from seqcal.modifiers.spinquant import SpinQuantModifier
from seqcal.modifiers.wanda import WandaPruningModifier

# Recipe name -> class. A literal dict: a miss lists exactly these names.
MODIFIERS: dict[str, type[Modifier]] = {
    "QuantizationModifier": QuantizationModifier,
    "GPTQModifier": GPTQModifier,
    "GPTAQModifier": GPTAQModifier,
    "SmoothQuantModifier": SmoothQuantModifier,
    "AWQModifier": AWQModifier,
    "SparseGPTModifier": SparseGPTModifier,
    "WandaPruningModifier": WandaPruningModifier,
    "LogarithmicEqualizationModifier": LogarithmicEqualizationModifier,
    "MagnitudePruningModifier": MagnitudePruningModifier,
    "ConstantPruningModifier": ConstantPruningModifier,
    "AutoRoundModifier": AutoRoundModifier,
    "REAPPruningModifier": REAPPruningModifier,
    "QuIPModifier": QuIPModifier,
    "SpinQuantModifier": SpinQuantModifier,
    "MixedPrecisionModifier": MixedPrecisionModifier,
    "KeepSourceFormatModifier": KeepSourceFormatModifier,
}
"""Every modifier a recipe names without an import path: recipe name -> class (a miss lists these names)."""

__all__ = [
    "MODIFIERS",
    "AWQModifier",
    "GPTAQModifier",
    "ConstantPruningModifier",
    "AutoRoundModifier",
    "Batch",
    "BatchCursor",
    "GPTQModifier",
    "Gather",
    "KeepSourceFormatModifier",
    "LogarithmicEqualizationModifier",
    "MagnitudePruningModifier",
    "MixedPrecisionModifier",
    "Modifier",
    "Needs",
    "QuantizationModifier",
    "QuantizedWeight",
    "REAPPruningModifier",
    "QuIPModifier",
    "RunState",
    "SmoothQuantModifier",
    "SparseGPTModifier",
    "SpinQuantModifier",
    "WandaPruningModifier",
]
