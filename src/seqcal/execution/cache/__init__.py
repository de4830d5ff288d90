"""The activation cache: values between subgraphs, in RAM or spilled to disk, freed at last use."""

from seqcal.execution.cache.store import STORE_DTYPES, ActivationCache

__all__ = ["STORE_DTYPES", "ActivationCache"]
