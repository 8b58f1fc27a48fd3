"""SM-level simulation of compute/communication overlap (see jax_overlap.sim)."""
