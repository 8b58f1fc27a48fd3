"""Example programs and builders for ``jax-overlap analyze MODULE:BUILDER``."""
