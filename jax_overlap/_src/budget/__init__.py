"""Budget-aware training: memory, compute and data decided together."""
