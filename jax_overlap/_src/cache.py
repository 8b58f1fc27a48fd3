"""Where jax_overlap keeps files between runs."""

from __future__ import annotations

import os
import tempfile


def cache_dir() -> str:
  """``$JAX_OVERLAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/jax_overlap``, else ``~/.cache/jax_overlap``."""
  base = os.environ.get("JAX_OVERLAP_CACHE_DIR")
  if base:
    return base
  return os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jax_overlap"
  )


def write_text(path: str, text: str) -> None:
  """Writes ``text`` to ``path`` atomically (see :func:`write_bytes`)."""
  write_bytes(path, text.encode())


def write_bytes(path: str, data: bytes) -> None:
  """Writes ``data`` to ``path`` atomically (a temporary file renamed over it).

  Concurrent writers leave one complete file; the parent directory is created.

  Raises:
    OSError: if the directory or file cannot be written.
  """
  directory = os.path.dirname(path) or "."
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
