"""XLA's kernel cache shared by the deviceless compiles of one program's variants.

The variants a selection compiles (compiler options, rewrites of the same step) share
most of their fusions. XLA's ``xla_gpu_kernel_cache_file`` keeps compiled kernels keyed
by a fingerprint of the fused computation and its arguments; a compile that finds a
kernel there skips its code generation and ``ptxas``. :class:`Shared` gives the first
compile of a selection (the seed) an empty cache file that XLA fills, and every later
compile a copy of its own, so that compiles running at once never write one file.

The copies are taken from the newest file: a compile that finished (:meth:`Shared.done`)
and was copied from the newest file as it still is becomes the newest itself (XLA writes
back what it loaded and what it compiled), so the kernels of one variant serve the
variants compiled after it -- the rewritten forms of a GSPMD step share few fusions with
the step as written that seeded the cache, and many with each other. Where another
compile finished in between (two compiles of different programs ran side by side), the
two files are merged (:func:`merge`): the file is XLA's map from kernel name to kernel;
XLA gives a kernel it compiles a name no kernel of its cache file has, which holds along
one line of descent but not between two siblings, so where both name a kernel alike the
newer one is kept and the other is compiled again by whichever compile needs it.

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

from jax_overlap._src.compile import gemm_configs

__all__ = [
  "OPTION",
  "Shared",
  "has_kernels",
  "mark_unsupported",
  "merge",
  "refused",
  "sharing_on",
  "supported",
]

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


def _varint(data: bytes, i: int, end: int | None = None) -> tuple[int, int]:
  """The protocol-buffer varint at ``data[i]`` and the index after it (ValueError where it
  runs past ``end``, default the end of ``data``)."""
  end = len(data) if end is None else end
  value = shift = 0
  while True:
    if i >= end or shift > 63:
      raise ValueError("truncated")
    byte = data[i]
    i += 1
    value |= (byte & 0x7F) << shift
    shift += 7
    if byte < 0x80:
      return value, i


def _fields(data: bytes) -> tuple[dict, dict, dict] | None:
  """The top-level fields of a kernel cache file (XLA's ``CompilationCacheProto``): its map
  entries from kernel name to kernel (field 1), by name, and its other fields, by number,
  each as its encoded bytes, and each kernel's fingerprint by name; None if ``data`` is
  not a protocol buffer laid out so."""
  entries: dict[bytes, bytes] = {}
  fingerprints: dict[bytes, bytes | None] = {}
  others: dict[int, bytes] = {}
  i = 0
  try:
    while i < len(data):
      start = i
      tag, i = _varint(data, i)
      number, wire = tag >> 3, tag & 7
      if wire == 0:
        _, i = _varint(data, i)
      elif wire == 1:
        i += 8
      elif wire == 5:
        i += 4
      elif wire == 2:
        size, i = _varint(data, i)
        if number == 1:  # a map entry: its key is its field 1, a string
          key_tag, j = _varint(data, i)
          if key_tag != 0x0A:
            return None
          key_size, j = _varint(data, j)
          entries[data[j : j + key_size]] = data[start : i + size]
          fingerprints[data[j : j + key_size]] = _fingerprint(data, j + key_size, i + size)
        i += size
      else:
        return None
      if i > len(data):
        return None
      if number != 1:
        others[number] = data[start:i]
  except ValueError:
    return None
  return entries, others, fingerprints


def _fingerprint(data: bytes, at: int, end: int) -> bytes | None:
  """The fingerprint of the kernel whose map entry's value (field 2, a
  ``CompilationCacheEntry`` whose field 1 is the fingerprint) starts at ``at``; None where
  it is not laid out so."""
  if at + 2 > end or data[at] != 0x12:
    return None
  try:
    _, i = _varint(data, at + 1, end)  # the value's size
    if i >= end or data[i] != 0x0A:
      return None
    length, i = _varint(data, i + 1, end)
  except ValueError:
    return None
  return data[i : i + length] if i + length <= end else None


def _entries(data: bytes) -> dict[bytes, bytes] | None:
  """The kernels of a kernel cache file by name (:func:`_fields`), or None."""
  fields = _fields(data)
  return None if fields is None else fields[0]


def merge(paths: list[str], out: str) -> bool:
  """Writes to ``out`` the kernels of the cache files ``paths`` (a later file's kernel wins
  over an earlier one of the same name, as do its other fields); False, writing nothing,
  if a file cannot be read as a kernel cache."""
  entries: dict[bytes, bytes] = {}
  named: dict[bytes, bytes] = {}  # fingerprint -> the name its kernel is kept under
  others: dict[int, bytes] = {}
  for path in paths:
    try:
      with open(path, "rb") as f:
        fields = _fields(f.read())
    except OSError:
      return False
    if fields is None:
      return False
    for name, entry in fields[0].items():
      fingerprint = fields[2][name]
      if fingerprint is None:
        return False
      # XLA takes one kernel per fingerprint (and per name): two siblings that compiled the
      # same fusion under two names keep the later one's.
      old = named.pop(fingerprint, None)
      if old is not None:
        entries.pop(old, None)
      if name in entries:
        named = {f: n for f, n in named.items() if n != name}
      entries[name] = entry
      named[fingerprint] = name
    others.update(fields[1])
  try:
    with open(out, "wb") as f:
      f.write(b"".join(entries.values()) + b"".join(others.values()))
  except OSError:
    return False
  return True


def refused(error: Exception) -> bool:
  """Whether ``error`` is XLA refusing a kernel cache file (its loader's checks)."""
  return "kernel_reuse_cache" in str(error)


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
    self._version = 0  # counts the changes of the newest file (the seed's compile's too)
    self._copied_from: dict[str, int] = {}  # each copy's path -> the version it came from
    self._lock = threading.RLock()
    self._programs: set = set()  # first_of's keys
    self._gemms = self._on  # tile configurations shared too (:mod:`.gemm_configs`)
    self._gemm_dir: str | None = None

  @classmethod
  def for_selection(cls, settings) -> Shared:
    """The kernel cache a selection's compiles share: off without a target (nothing is
    compiled for a GPU) or where the user's options name a kernel cache of their own."""
    return cls(
      enabled=getattr(settings, "target", None) is not None
      and OPTION not in (getattr(settings, "xla_options", None) or {})
    )

  def _file(self, name: str) -> str:
    with self._lock:
      if self._dir is None:
        self._dir = tempfile.mkdtemp(prefix="jax_overlap_kernels_")
        # Removed when the object goes, if close() was not reached.
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
      return os.path.join(self._dir, name)

  def _gives(self, options: Mapping[str, Any]) -> bool:
    return self.sharing() and OPTION not in options

  def stop(self) -> None:
    """No more kernels shared (XLA refused a file: :func:`refused`); compiles given a file
    already keep it."""
    with self._lock:
      self._on = False

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
    options = self._with_gemm_configs(options)
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
    named a cache, or kernels cannot be mapped back. Both also name the selection's
    shared tile configurations (:meth:`_with_gemm_configs`)."""
    options = self._with_gemm_configs(options)
    if not self._gives(options):
      return dict(options)
    with self._lock:
      self._count += 1
      path = self._file(f"copy{self._count}.bin")
      newest = self._file(self._newest)
      self._copied_from[path] = self._version
      if has_kernels(newest):
        try:
          shutil.copyfile(newest, path)
        except OSError:
          pass  # a full disk: compiled from an empty cache
    return {**options, OPTION: path}

  def _with_gemm_configs(self, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` naming the directory where the selection's compiles leave the tile
    configurations XLA chose for their Triton GEMM fusions, and find those of the compiles
    before them (:mod:`.gemm_configs`); unchanged where sharing is off, the options set
    XLA's autotuning cache themselves or an option that changes the tiles it chooses
    (:func:`.gemm_configs.shapes_tiles`), or the installed jaxlib's cache cannot be written
    (:func:`.gemm_configs.version`)."""
    own = any(k in options for k in gemm_configs.OPTION_NAMES)
    if not self._gemms or own or gemm_configs.shapes_tiles(options):
      return dict(options)
    if gemm_configs.version() is None:
      self._gemms = False
      return dict(options)
    with self._lock:
      if self._gemm_dir is None:
        self._gemm_dir = gemm_configs.new_directory(os.path.dirname(self._file("seed.bin")))
    return {**options, **gemm_configs.options(self._gemm_dir)}

  def done(self, options: Mapping[str, Any]) -> None:
    """Called when the compile given ``options`` (from :meth:`seed` or :meth:`copy`)
    succeeded: its file becomes the newest if it was copied from the newest as it still
    is; otherwise (another compile finished in between) the newest becomes the two merged
    (:func:`merge`), or stays as it is where they cannot be."""
    path = options.get(OPTION)
    with self._lock:
      if path is None or self._dir is None or os.path.dirname(path) != self._dir:
        return
      if os.path.basename(path) == "seed.bin":
        if self._newest == "seed.bin":
          origin = self._version
        else:  # compiles copied from the empty seed finished first
          origin = -1
      else:
        origin = self._copied_from.pop(path, None)
        if origin is None:
          return
      if not has_kernels(path):
        return
      if origin == self._version:
        self._newest = os.path.basename(path)
      else:
        merged = self._file(f"merged{self._version}.bin")
        if not merge([self._file(self._newest), path], merged):
          return
        self._newest = os.path.basename(merged)
      self._version += 1

  def close(self) -> None:
    with self._lock:
      if self._dir is not None:
        self._cleanup()
        self._dir = self._gemm_dir = None

  def __enter__(self) -> Shared:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
