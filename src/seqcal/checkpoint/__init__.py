"""Checkpoints: the compressed-tensors writer, streaming save and resume, checks before a run starts."""
