"""The runtime library (libjax_overlap_rt.so) from Python: build, locate, status.

(Over 500 lines: the library's C API as ctypes structures, field by field, next to the
build and the status that read it.)

The library is a launch interposer loaded with ``LD_PRELOAD`` (``jax-overlap
launch`` sets it up); see ``docs/runtime.md``. This module

* finds the built libraries (in ``jax_overlap/_lib`` after ``pip install``), or
  builds them with the system C++ compiler into a cache directory on first use
  (``JAX_OVERLAP_CACHE_DIR``, default ``~/.cache/jax_overlap``);
* reports what a loaded library has done (:func:`status`), reading its counters
  through ctypes without loading it (``RTLD_NOLOAD``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
from typing import Any

from jax_overlap import _lib
from jax_overlap._src import cache as cache_lib
from jax_overlap._src.runtime.plan import Plan

__all__ = [
  "RUNTIME_LIBRARY",
  "FFI_LIBRARY",
  "Counters",
  "Status",
  "status",
  "library_path",
  "build_library",
  "compiler",
  "load_library",
]

# Driver entry points that can create, update or launch kernels and that the
# runtime library deliberately leaves alone, with the reason. Every other such
# entry point the installed CUDA plugin can resolve is hooked
# (tests/test_launch_coverage.py reads the plugin and checks both lists).
UNHOOKED_LAUNCH_PATHS: dict[str, str] = {
  **dict.fromkeys(
    (
      "cuLaunchHostFunc",
      "cuLaunchHostFunc_ptsz",
      "cuLaunchHostFunc_v2",
      "cuLaunchHostFunc_v2_ptsz",
    ),
    "host callbacks run on the CPU: no kernel, nothing to shape",
  ),
  **dict.fromkeys(
    ("cuLaunch", "cuLaunchGrid", "cuLaunchGridAsync"),
    "the pre-CUDA-4 launch API (block shape and shared memory set beforehand with "
    "cuFuncSetBlockShape/cuFuncSetSharedSize), deprecated; XLA and the libraries it calls "
    "launch through cuLaunchKernel(Ex) and graphs",
  ),
  "cuLaunchCooperativeKernelMultiDevice": "deprecated since CUDA 11.3; cooperative launches "
  "need every block resident and are never shaped",
  **dict.fromkeys(
    ("cuGraphKernelNodeGetParams", "cuGraphKernelNodeGetParams_v2"),
    "reads a node's parameters back; creates nothing",
  ),
  **dict.fromkeys(
    (
      "cuGraphKernelNodeGetAttribute",
      "cuGraphKernelNodeSetAttribute",
      "cuGraphKernelNodeCopyAttributes",
    ),
    "node attributes (priority, cluster shape, access policy), not the launch configuration; "
    "a node's shared memory is set through the parameter calls, which are hooked",
  ),
  **dict.fromkeys(
    ("cuGraphExecUpdate", "cuGraphExecUpdate_v2"),
    "copies parameters from a graph whose kernel nodes were created through the hooked calls",
  ),
  "cuKernelGetFunction": "resolves a CUkernel to a CUfunction. A CUkernel handle passed where "
  "a function is expected is queried like a function; if the driver cannot answer, the "
  "launch goes unchanged and is counted in launches_fallback",
  "cuLibraryGetKernel": "looks a kernel up in a loaded library; launches nothing",
  **dict.fromkeys(
    (
      "cuStreamBeginCapture",
      "cuStreamBeginCapture_ptsz",
      "cuStreamBeginCapture_v2",
      "cuStreamBeginCapture_v2_ptsz",
      "cuStreamBeginCaptureToGraph",
      "cuStreamBeginCaptureToGraph_ptsz",
      "cuStreamEndCapture",
      "cuStreamEndCapture_ptsz",
    ),
    "stream capture records the launches made between begin and end, and those go through "
    "the hooked launch entry points",
  ),
}

RUNTIME_LIBRARY = _lib.RUNTIME_LIBRARY
FFI_LIBRARY = _lib.FFI_LIBRARY
PLAN_ENV = "JAX_OVERLAP_RT_PLAN"
RULES_ENV = "JAX_OVERLAP_RT_RULES"
VERBOSE_ENV = "JAX_OVERLAP_RT_VERBOSE"

_PACKAGE_LIB_DIR = pathlib.Path(_lib.__file__).resolve().parent
_REPO_ROOT = _PACKAGE_LIB_DIR.parent.parent
_build_lock = threading.Lock()


# ---------------------------------------------------------------------------
# Building.
# ---------------------------------------------------------------------------


def compiler() -> str:
  """The C++ compiler used to build the libraries: ``$CXX``, else ``c++`` or ``g++``.

  Raises:
    RuntimeError: if none is found, saying how to fix it.
  """
  for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
    if candidate and shutil.which(candidate):
      return candidate
  raise RuntimeError(
    "jax_overlap.runtime: no C++ compiler found to build the runtime libraries; install g++ "
    "(e.g. apt-get install g++) or set CXX, or reinstall jax_overlap where one is available"
  )


def _ffi_include_dir() -> str:
  import jax.ffi

  return jax.ffi.include_dir()


def _spec(name: str) -> dict[str, Any]:
  if name not in _lib.LIBRARIES:
    raise ValueError(
      f"jax_overlap.runtime: unknown library {name!r}; valid names: {', '.join(_lib.LIBRARIES)}"
    )
  return _lib.LIBRARIES[name]


def _source_paths(name: str, root: pathlib.Path = _REPO_ROOT) -> list[pathlib.Path]:
  spec = _spec(name)
  return [root / p for p in (*spec["sources"], *spec["headers"])]


def compile_command(
  name: str,
  output: str | os.PathLike,
  *,
  cxx: str | None = None,
  root: str | os.PathLike | None = None,
) -> list[str]:
  """The compiler command line that builds library ``name`` into ``output``."""
  spec = _spec(name)
  base = pathlib.Path(root) if root is not None else _REPO_ROOT
  cmd = [cxx or compiler(), *spec["cflags"]]
  if spec["ffi_headers"]:
    cmd += ["-isystem", _ffi_include_dir()]
  cmd += [str(base / s) for s in spec["sources"]]
  cmd += ["-o", os.fspath(output), *spec["ldflags"]]
  return cmd


def build_library(
  name: str,
  out_dir: str | os.PathLike,
  *,
  cxx: str | None = None,
  root: str | os.PathLike | None = None,
) -> pathlib.Path:
  """Builds library ``name`` (e.g. ``"libjax_overlap_rt.so"``) into ``out_dir``.

  Returns:
    The path of the built library.

  Raises:
    RuntimeError: if there is no compiler, the sources are missing, or the build fails
      (with the compiler's error output).
  """
  base = pathlib.Path(root) if root is not None else _REPO_ROOT
  missing = [str(p) for p in _source_paths(name, base) if not p.exists()]
  if missing:
    raise RuntimeError(
      f"jax_overlap.runtime: cannot build {name}: sources not found ({', '.join(missing)}); "
      "build from a source checkout (pip install -e .) or reinstall jax_overlap"
    )
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  target = out_dir / name
  fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out_dir)
  os.close(fd)
  cmd = compile_command(name, tmp, cxx=cxx, root=base)
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
      raise RuntimeError(
        f"jax_overlap.runtime: building {name} failed (exit {proc.returncode}):\n"
        f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
      )
    os.replace(tmp, target)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return target


def _fingerprint(name: str) -> str:
  h = hashlib.sha256()
  spec = _spec(name)
  h.update(repr(sorted(spec.items())).encode())
  for p in _source_paths(name):
    h.update(p.name.encode())
    h.update(p.read_bytes() if p.exists() else b"")
  return h.hexdigest()[:16]


def _cache_dir() -> pathlib.Path:
  return pathlib.Path(cache_lib.cache_dir())


def _fresh(lib: pathlib.Path, name: str) -> bool:
  if not lib.exists():
    return False
  sources = [p for p in _source_paths(name) if p.exists()]
  return all(p.stat().st_mtime <= lib.stat().st_mtime for p in sources)


def library_path(name: str = RUNTIME_LIBRARY, *, build: bool = True) -> pathlib.Path:
  """Path of a built native library, building it on first use if needed.

  Looks in ``jax_overlap/_lib`` (where ``setup.py`` puts it) and uses that copy
  unless its sources in a source checkout are newer; otherwise builds into the
  cache directory, keyed by a hash of the sources and flags.

  Raises:
    RuntimeError: if the library is missing and ``build`` is false, or the build fails.
  """
  packaged = _PACKAGE_LIB_DIR / name
  if _fresh(packaged, name):
    return packaged
  if packaged.exists() and not any(p.exists() for p in _source_paths(name)):
    return packaged  # installed wheel: no sources to compare against
  with _build_lock:
    cached_dir = _cache_dir() / f"{name.removesuffix('.so')}-{_fingerprint(name)}"
    cached = cached_dir / name
    if cached.exists():
      return cached
    if not build:
      raise RuntimeError(
        f"jax_overlap.runtime: {name} is not built; run `pip install -e .` or call "
        f"jax_overlap.runtime.library_path({name!r}) with build=True"
      )
    return build_library(name, cached_dir)


# ---------------------------------------------------------------------------
# Status.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Counters:
  """What the runtime library has done in this process (see ``xla_patches/runtime/hooks.h``)."""

  launches_seen: int = 0
  launches_shaped: int = 0
  launches_capped: int = 0
  launches_fallback: int = 0
  capture_errors: int = 0
  launches_skipped: int = 0
  launches_no_room: int = 0
  no_room_registers: int = 0
  no_room_threads: int = 0
  no_room_smem: int = 0
  no_room_blocks: int = 0
  launches_in_region: int = 0
  launches_direct: int = 0
  launches_dlsym: int = 0
  launches_procaddr: int = 0
  launches_kernel_handle: int = 0
  graph_nodes_seen: int = 0
  graph_nodes_shaped: int = 0
  func_attr_raised: int = 0
  streams_created: int = 0
  streams_promoted: int = 0
  lookups_dlsym: int = 0
  lookups_procaddr: int = 0
  lookups_unhooked: int = 0
  regions_entered: int = 0
  gemm_handles_seen: int = 0
  gemm_handles_targeted: int = 0
  gemm_descs_seen: int = 0
  gemm_descs_targeted: int = 0
  gemm_target_errors: int = 0

  @property
  def no_room(self) -> dict[str, int]:
    """Selected launches left alone because no cap makes room for a communication
    block beside them, by the limit that stands in the way (a launch can count
    under several)."""
    return {
      "registers": self.no_room_registers,
      "threads": self.no_room_threads,
      "shared_memory": self.no_room_smem,
      "blocks": self.no_room_blocks,
    }

  @property
  def by_path(self) -> dict[str, int]:
    """Launches by how the program reached the driver."""
    return {
      "direct": self.launches_direct,
      "dlsym": self.launches_dlsym,
      "cuGetProcAddress": self.launches_procaddr,
    }


_COUNTER_FIELDS = tuple(f.name for f in dataclasses.fields(Counters))


@dataclasses.dataclass(frozen=True)
class Status:
  """Whether the runtime library is loaded in this process and what it has done.

  Attributes:
    loaded: the library is mapped into this process (normally via LD_PRELOAD).
    library: its path when loaded, else the path ``jax-overlap launch`` would use
      if it is built, else None.
    plan_path: the plan file named by JAX_OVERLAP_RT_PLAN, if any.
    plan: that plan, parsed, or None.
    rules: number of kernel and region rules active in the library.
    counters: the library's counters (all zero when it is not loaded).
    rule_functions: per kernel rule pattern, the distinct kernel functions it
      has selected so far in this process.
  """

  loaded: bool
  library: str | None
  plan_path: str | None
  plan: Plan | None
  rules: int
  counters: Counters
  rule_functions: dict[str, int] = dataclasses.field(default_factory=dict)

  @property
  def unmatched_rules(self) -> tuple[str, ...]:
    """Kernel rules that have selected no kernel so far: the plan names kernels this
    program has not launched (yet), or names them differently from the driver."""
    return tuple(p for p, n in self.rule_functions.items() if n == 0)


def _mapped_runtime_library() -> str | None:
  try:
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
      for line in f:
        parts = line.split(None, 5)
        if len(parts) == 6 and os.path.basename(parts[5].strip()) == RUNTIME_LIBRARY:
          return parts[5].strip()
  except OSError:
    pass
  return None


def _globally_visible() -> bool:
  try:
    return hasattr(ctypes.CDLL(None), "jor_counter_count")
  except OSError:
    return False


def load_library(path: str | os.PathLike | None = None, *, noload: bool = False) -> ctypes.CDLL:
  """ctypes handle on the runtime library with its exported API typed.

  With ``noload`` the library must already be in the process (LD_PRELOAD) and
  is not loaded otherwise (OSError). Loading it into a running process only
  gives access to the arithmetic and counters: launch interposition needs LD_PRELOAD.
  """
  if path is None:
    path = _mapped_runtime_library() or library_path()
  # RTLD_LOCAL: loaded this way its dlsym and driver symbols stay out of the
  # global scope, so nothing in this process is interposed.
  mode = ctypes.RTLD_LOCAL | (os.RTLD_NOLOAD if noload else 0)
  lib = ctypes.CDLL(os.fspath(path), mode=mode)
  for name, (restype, argtypes) in _C_API.items():
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, argtypes
  return lib


class DeviceLimits(ctypes.Structure):
  """ctypes mirror of JorDeviceLimits (xla_patches/runtime/shaping.h)."""

  _fields_ = [
    (name, ctypes.c_int64)
    for name in (
      "sm_count",
      "smem_per_sm",
      "smem_per_block_optin",
      "smem_reserved_per_block",
      "max_threads_per_sm",
      "max_blocks_per_sm",
      "regs_per_sm",
      "warp_size",
      "reg_alloc_unit",
      "smem_alloc_unit",
    )
  ]

  @classmethod
  def from_gpu(cls, gpu) -> DeviceLimits:
    """Limits of a catalogue GPU, as the runtime library would read them from the driver."""
    from jax_overlap._src import targets

    g = targets.get_gpu(gpu)
    return cls(
      g.sm_count,
      g.smem_per_sm,
      g.smem_per_block_optin,
      g.smem_reserved_per_block,
      g.max_threads_per_sm,
      g.max_blocks_per_sm,
      g.regs_per_sm,
      g.warp_size,
      256 if g.vendor == "nvidia" else g.reg_alloc_unit,
      g.smem_alloc_unit,
    )


class CommBlock(ctypes.Structure):
  """ctypes mirror of JorCommBlock (xla_patches/runtime/shaping.h)."""

  _fields_ = [(name, ctypes.c_int64) for name in ("threads", "regs_per_thread", "smem_bytes")]


# The C API of the runtime library (exports.cc, shaping.h): name -> (restype, argtypes).
_LIMITS, _COMM, _STATUS = (
  ctypes.POINTER(DeviceLimits),
  ctypes.POINTER(CommBlock),
  ctypes.POINTER(ctypes.c_int),
)
_I64 = ctypes.c_int64
_C_API = {
  "jor_counter_count": (ctypes.c_int, []),
  "jor_counter_name": (ctypes.c_char_p, [ctypes.c_int]),
  "jor_counter_value": (ctypes.c_uint64, [ctypes.c_int]),
  "jor_set_rules": (ctypes.c_int, [ctypes.c_char_p]),
  "jor_rule_count": (ctypes.c_int, []),
  "jor_kernel_rule_count": (ctypes.c_int, []),
  "jor_kernel_rule_pattern": (ctypes.c_char_p, [ctypes.c_int]),
  "jor_kernel_rule_functions": (_I64, [ctypes.c_int]),
  "jor_region_begin": (ctypes.c_int, [_I64, _I64]),
  "jor_region_end": (ctypes.c_int, [_I64]),
  "jor_blocks_per_sm": (_I64, [_LIMITS, _I64, _I64, _I64]),
  "jor_shaped_dynamic_smem": (_I64, [_LIMITS, *[_I64] * 5, _STATUS]),
  "jor_room_cap": (_I64, [_LIMITS, _COMM, *[_I64] * 5, _STATUS]),
  "jor_nccl_comm_block": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, _I64, _COMM]),
  "jor_padded_dynamic_smem": (_I64, [_LIMITS, *[_I64] * 3, _STATUS]),
}


def read_counters(lib: ctypes.CDLL) -> dict[str, int]:
  """All counters of a loaded runtime library, by name."""
  return {
    lib.jor_counter_name(i).decode(): int(lib.jor_counter_value(i))
    for i in range(lib.jor_counter_count())
  }


def read_rule_functions(lib: ctypes.CDLL) -> dict[str, int]:
  """Kernel rule pattern -> distinct functions it has selected, from a loaded library."""
  out: dict[str, int] = {}
  for i in range(lib.jor_kernel_rule_count()):
    pattern = lib.jor_kernel_rule_pattern(i)
    if pattern is not None:
      out[pattern.decode()] = out.get(pattern.decode(), 0) + int(lib.jor_kernel_rule_functions(i))
  return out


def status() -> Status:
  """Whether the runtime library is loaded here and what it has done.

  Example:
    >>> from jax_overlap import runtime
    >>> s = runtime.status()
    >>> s.loaded, s.counters.launches_seen  # doctest: +SKIP
    (False, 0)
  """
  plan_path = os.environ.get(PLAN_ENV) or None
  plan = None
  if plan_path:
    try:
      plan = Plan.from_json(plan_path)
    except (OSError, ValueError, TypeError):
      plan = None
  mapped = _mapped_runtime_library()
  # Interposing means globally visible (LD_PRELOAD); a copy loaded with ctypes
  # for its arithmetic is mapped but sees no launches.
  if mapped is not None and _globally_visible():
    try:
      lib = load_library(mapped, noload=True)
    except OSError:
      lib = None
    if lib is not None:
      values = read_counters(lib)
      known = {k: v for k, v in values.items() if k in _COUNTER_FIELDS}
      return Status(
        True,
        mapped,
        plan_path,
        plan,
        int(lib.jor_rule_count()),
        Counters(**known),
        read_rule_functions(lib),
      )
  library = None
  for candidate in (_PACKAGE_LIB_DIR / RUNTIME_LIBRARY,):
    if candidate.exists():
      library = str(candidate)
  return Status(False, library, plan_path, plan, 0, Counters())
