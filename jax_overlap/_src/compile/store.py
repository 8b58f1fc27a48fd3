"""XLA's artefacts of deviceless compiles, kept on disk for other processes.

A deviceless compile of a sizeable step takes XLA seconds; a notebook kernel, a CLI run,
a second analysis of the same step tomorrow or another test process would compile the
very same module again. What XLA produced -- the scheduled HLO, the thunk sequence, the
debug options it saw, its memory statistics -- is kept here under the key of the
in-process memo (the lowered module's text, the options, the target), extended with the
versions of jax, jaxlib and the CUDA plugin and with ``XLA_FLAGS``, so that a different
XLA, or XLA with other options, never answers for another. Only compile-only (GPU
target) steps are kept, whose executables cannot run anyway; a step read back has no
executable (``CompiledStep.compiled`` is None).

Where: ``$JAX_OVERLAP_COMPILE_CACHE_DIR``, else the ``compiles`` folder of the cache
directory (:func:`jax_overlap._src.cache.cache_dir`). ``JAX_OVERLAP_COMPILE_CACHE=0``
turns it off. The folder keeps the most recently used entries, at most ``MAX_ENTRIES``
of them and ``MAX_BYTES`` in all. An entry that cannot be read is a miss; an entry that
cannot be written is not kept (the compile itself has succeeded).

Two processes that want the same compile at the same time (the workers of a test run, a
notebook beside a benchmark) compile it once: the first holds a lock file of the entry
while it compiles (:func:`compiling`), the second waits on it and then reads the entry.
Where the folder takes no lock, both compile.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import importlib.metadata
import json
import os
import time
from collections.abc import Iterator
from typing import Any

try:
  import fcntl
except ImportError:  # not a POSIX system: no locks, each process compiles
  fcntl = None  # type: ignore[assignment]

from jax_overlap._src import cache as cache_lib

__all__ = [
  "enabled",
  "directory",
  "key_suffix",
  "load",
  "save",
  "compiling",
  "MAX_ENTRIES",
  "MAX_BYTES",
]

MAX_ENTRIES = 256
MAX_BYTES = 512 << 20
_SUFFIX = ".json.gz"
_LOCK = ".lock"
_STALE_LOCK_S = 3600.0  # lock files older than this are removed with the entries
_FORMAT = 1


def enabled() -> bool:
  return os.environ.get("JAX_OVERLAP_COMPILE_CACHE", "1").strip().lower() not in (
    "0",
    "false",
    "no",
    "off",
  )


def directory() -> str:
  return os.environ.get("JAX_OVERLAP_COMPILE_CACHE_DIR") or os.path.join(
    cache_lib.cache_dir(), "compiles"
  )


def _version(dist: str) -> str:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return "-"


@functools.cache
def _compiler() -> tuple[str, ...]:
  import jax
  import jaxlib

  plugins = [_version(d) for d in ("jax-cuda13-plugin", "jax-cuda12-plugin")]
  return (jax.__version__, jaxlib.__version__, *plugins)


def key_suffix() -> str:
  """The installed compiler's identity and the process's ``XLA_FLAGS`` (options XLA
  reads from the environment, not from the compile call), appended to every key."""
  return repr((_FORMAT, _compiler(), os.environ.get("XLA_FLAGS", "")))


def _path(key: str) -> str:
  digest = hashlib.sha256((key + key_suffix()).encode()).hexdigest()
  return os.path.join(directory(), digest + _SUFFIX)


def load(key: str) -> dict[str, Any] | None:
  """The fields saved under ``key``, or None."""
  if not enabled():
    return None
  path = _path(key)
  try:
    with gzip.open(path, "rt") as f:
      entry = json.load(f)
    os.utime(path)  # most recently used
  except FileNotFoundError:
    return None
  except (OSError, ValueError, EOFError):
    _remove(path)  # unreadable: compiled again and rewritten
    return None
  return entry if isinstance(entry, dict) else None


@contextlib.contextmanager
def compiling(key: str) -> Iterator[None]:
  """Held while this process compiles ``key``: a process that asks for the same compile
  meanwhile waits here, then finds the entry with :func:`load`. The lock is the entry's
  lock file, released when the block ends or the process dies. Without a store, or where
  the folder takes no lock, nothing is held."""
  if not enabled() or fcntl is None:
    yield
    return
  path = _path(key)[: -len(_SUFFIX)] + _LOCK
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError:
    yield
    return
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
      pass  # a file system without locks: compile without one
    yield
  finally:
    os.close(fd)  # releases the lock


def save(key: str, fields: dict[str, Any]) -> None:
  """Keeps ``fields`` (JSON-serializable) under ``key``; the least recently used entries
  go beyond ``MAX_ENTRIES`` or ``MAX_BYTES``."""
  if not enabled():
    return
  path = _path(key)
  try:
    cache_lib.write_bytes(path, gzip.compress(json.dumps(fields).encode(), mtime=0))
    _prune(os.path.dirname(path))
  except OSError:
    return  # a full or read-only disk: the step is simply not kept


def _prune(folder: str) -> None:
  entries = []
  now = time.time()
  for name in os.listdir(folder):
    if name.endswith(_LOCK):
      p = os.path.join(folder, name)
      try:
        if now - os.stat(p).st_mtime > _STALE_LOCK_S:
          _remove(p)  # a compile that long over; one still held only costs a repeat
      except OSError:
        pass
    elif name.endswith(_SUFFIX):
      p = os.path.join(folder, name)
      try:
        st = os.stat(p)
      except OSError:
        continue
      entries.append((st.st_mtime, st.st_size, p))
  entries.sort(reverse=True)  # most recently used first
  kept = total = 0
  for _, size, p in entries:
    if kept < MAX_ENTRIES and total + size <= MAX_BYTES:
      kept += 1
      total += size
    else:
      _remove(p)


def _remove(path: str) -> None:
  try:
    os.unlink(path)
  except OSError:
    pass
