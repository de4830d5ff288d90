"""Evaluation: perplexity (WikiText-2 protocol) and the per-layer error report."""
