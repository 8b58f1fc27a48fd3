"""Overlap measured from real profiler traces."""

from jax_overlap._src.analysis.profile import COMM_PATTERN as COMM_PATTERN
from jax_overlap._src.analysis.profile import Measured as Measured
from jax_overlap._src.analysis.profile import device_events as device_events
from jax_overlap._src.analysis.profile import load_trace as load_trace
from jax_overlap._src.analysis.profile import measure as measure

__all__ = ["COMM_PATTERN", "Measured", "device_events", "load_trace", "measure"]
