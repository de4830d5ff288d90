"""Execution: run the partitioned graph subgraph by subgraph (pipeline, executor, weights, cache)."""
