"""seqcal: memory-bounded sequential calibration for post-training quantization of transformers models."""

from seqcal.entrypoint import oneshot
from seqcal.execution.subgraphs import SubgraphList, trace_subgraphs
from seqcal.modelfree import model_free_ptq
from seqcal.modifiers import GPTQModifier, QuantizationModifier
from seqcal.recipe.parse import Recipe, parse_recipe
from seqcal.tracing import TracingError

__all__ = [
    "GPTQModifier",
    "QuantizationModifier",
    "Recipe",
    "SubgraphList",
    "TracingError",
    "model_free_ptq",
    "oneshot",
    "parse_recipe",
    "trace_subgraphs",
]
__version__ = "0.1.0"
