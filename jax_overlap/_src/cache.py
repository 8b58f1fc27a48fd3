"""Where jax_overlap keeps files between runs."""

from __future__ import annotations

import os


def cache_dir() -> str:
  """``$JAX_OVERLAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/jax_overlap``, else ``~/.cache/jax_overlap``."""
  base = os.environ.get("JAX_OVERLAP_CACHE_DIR")
  if base:
    return base
  return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jax_overlap")
