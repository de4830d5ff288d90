"""seqcal: memory-bounded sequential calibration for post-training quantization of transformers models."""

from seqcal.subgraphs import SubgraphList, trace_subgraphs
from seqcal.tracing import TracingError

__all__ = ["SubgraphList", "TracingError", "trace_subgraphs"]
__version__ = "0.1.0"
