"""Latency profiles for XLA's scheduler, written from the analysis' cost estimates."""

from jax_overlap._src.analysis.latency_profile import OPTION as OPTION
from jax_overlap._src.analysis.latency_profile import profile_text as profile_text
from jax_overlap._src.analysis.latency_profile import write_profile as write_profile

__all__ = ["OPTION", "profile_text", "write_profile"]
