"""FSDP layers under ``lax.scan`` whose all-gathers and reduce-scatters overlap compute."""

from jax_overlap._src.fsdp import scan_layers as scan_layers

__all__ = ["scan_layers"]
