"""XLA's kernel cache shared by the deviceless compiles of one program's variants.

The variants a selection compiles (compiler options, rewrites of the same step) share
most of their fusions. XLA's ``xla_gpu_kernel_cache_file`` keeps compiled kernels keyed
by a fingerprint of the fused computation and its arguments; a compile that finds a
kernel there skips its code generation and ``ptxas``. :class:`Shared` gives the first
compile of a selection (the seed) an empty cache file that XLA fills, and every later
compile a copy of its own, so that compiles running at once never write one file.

The copies are taken from the newest file of one line of descent: a compile that
finished (:meth:`Shared.done`) and was copied from the file that is still the newest
becomes the newest itself (XLA writes back what it loaded and what it compiled), so the
kernels of one variant serve the variants compiled after it -- the rewritten forms of a
GSPMD step share few fusions with the step as written that seeded the cache, and many with
each other. Files are never merged: XLA gives a kernel it compiles a name no kernel of its
cache file has, which holds along one line of descent but not between two siblings.

``JAX_OVERLAP_SHARED_KERNELS=0`` compiles every variant on its own.

What a kernel taken from the cache changes in XLA's artefacts: it keeps the name the
compile that made it gave it, so the thunk listing's kernel names are not those a compile of the step
alone gives the driver (:attr:`.compiler.CompiledStep.reused_kernels`). Launch
configurations are read through XLA's thunk metadata (thunk -> HLO instruction) rather
than by name; a report from such a compile leaves kernel launch names unknown.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Mapping
from typing import Any

__all__ = ["OPTION", "Shared", "has_kernels", "mark_unsupported", "sharing_on", "supported"]

OPTION = "xla_gpu_kernel_cache_file"

_LOCK = threading.Lock()
_UNSUPPORTED = [False]


def sharing_on() -> bool:
  """Whether selections share kernels (``JAX_OVERLAP_SHARED_KERNELS``, default on)."""
  value = os.environ.get("JAX_OVERLAP_SHARED_KERNELS", "1").strip().lower()
  return value not in ("0", "false", "no", "off")


def has_kernels(path: str | None) -> bool:
  """Whether a compile given ``path`` as its kernel cache can take kernels from it."""
  return bool(path) and os.path.isfile(path) and os.path.getsize(path) > 0


def mark_unsupported() -> None:
  """Called when a compile with a kernel cache wrote no thunk metadata: without it the
  launch configurations of renamed kernels cannot be found, so no more copies are given."""
  with _LOCK:
    _UNSUPPORTED[0] = True


def supported() -> bool:
  """False once this process saw a compile whose kernels could not be mapped back."""
  with _LOCK:
    return not _UNSUPPORTED[0]


class Shared:
  """One selection's kernel cache: :meth:`seed` for the first compile, :meth:`copy` for
  each later one, :meth:`done` when one finished; :meth:`first_of` tells the first compile
  of a program the kernels have not seen. A context manager; the files go when it closes.

  Args:
    enabled: False gives the options back unchanged (e.g. when the user's own options
      already name a kernel cache file); so does ``JAX_OVERLAP_SHARED_KERNELS=0``.
  """

  def __init__(self, enabled: bool = True):
    self._on = enabled and sharing_on()
    self._dir: str | None = None  # made by the first compile that asks for a file
    self._seed_given = False
    self._count = 0
    self._newest = "seed.bin"  # the file copies are taken from
    self._copied_from: dict[str, str] = {}  # each copy's path -> the file it came from
    self._lock = threading.RLock()
    self._programs: set = set()  # first_of's keys

  def _file(self, name: str) -> str:
    with self._lock:
      if self._dir is None:
        self._dir = tempfile.mkdtemp(prefix="jax_overlap_kernels_")
        # Removed when the object goes, if close() was not reached.
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
      return os.path.join(self._dir, name)

  def _gives(self, options: Mapping[str, Any]) -> bool:
    return self.sharing() and OPTION not in options

  def sharing(self) -> bool:
    """Whether compiles share kernels here."""
    return self._on and supported()

  def first_of(self, program) -> bool:
    """True the first time ``program`` (any hashable key) is asked about while sharing."""
    with self._lock:
      first = self.sharing() and program not in self._programs
      self._programs.add(program)
      return first

  def needs_seed(self) -> bool:
    """Whether the next compile should be the seed (sharing on and no seed given yet)."""
    return self.sharing() and not self._seed_given

  def seed(self, options: Mapping[str, Any], program=None) -> dict[str, Any]:
    """``options`` with the seed file (filled by this compile) as the kernel cache;
    ``program`` (a :meth:`first_of` key) is the seed's, compiled from here on."""
    if program is not None:
      self.first_of(program)
    if not self._gives(options):
      return dict(options)
    self._seed_given = True
    return {**options, OPTION: self._file("seed.bin")}

  def seeded(self) -> bool:
    """Whether a seed compile left kernels to share."""
    return self._seed_given and has_kernels(self._file("seed.bin"))

  def copy(self, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with a private copy of the newest kernels (the seed's and those of the
    compiles :meth:`done` took in) as the kernel cache (an empty one when the seed
    compiled nothing, e.g. it was read back from the compile store, so that this compile
    is remembered as the others of its kind); unchanged when sharing is off, the user
    named a cache, or kernels cannot be mapped back."""
    if not self._gives(options):
      return dict(options)
    with self._lock:
      self._count += 1
      path = self._file(f"copy{self._count}.bin")
      newest = self._file(self._newest)
      self._copied_from[path] = self._newest
    if has_kernels(newest):
      try:
        shutil.copyfile(newest, path)
      except OSError:
        pass  # a full disk: compiled from an empty cache
    return {**options, OPTION: path}

  def done(self, options: Mapping[str, Any]) -> None:
    """Called when the compile given ``options`` (from :meth:`copy`) succeeded: its file
    becomes the newest if it was copied from the file that still is (no other compile
    finished in between; otherwise the other's kernels stay the newest)."""
    path = options.get(OPTION)
    with self._lock:
      origin = self._copied_from.pop(path, None) if path is not None else None
      if origin is not None and origin == self._newest and has_kernels(path):
        self._newest = os.path.basename(path)

  def close(self) -> None:
    with self._lock:
      if self._dir is not None:
        self._cleanup()
        self._dir = None

  def __enter__(self) -> Shared:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
