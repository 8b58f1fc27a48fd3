"""jax_overlap: overlap collectives with compute in sharded JAX training steps."""

from jax_overlap import flags as flags
from jax_overlap import targets as targets
from jax_overlap._src.errors import ConfigError as ConfigError

__version__ = "0.1.0"

__all__ = ["ConfigError", "flags", "targets", "__version__"]
