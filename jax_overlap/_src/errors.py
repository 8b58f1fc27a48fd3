"""Exceptions raised by jax_overlap."""

__all__ = ["ConfigError"]


class ConfigError(RuntimeError):
  """Configuration that cannot take effect: bad flags, or flags set too late."""
