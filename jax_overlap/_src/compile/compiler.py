"""Compiling a user's step for a GPU target, with XLA's own artefacts kept.

``compile_for_target(fn, *args, target="h100x8")`` lowers ``fn`` with its
arguments re-targeted onto the target's compile-only mesh (matched by axis
names) and compiles it once with a per-compile dump directory, so that the
scheduled HLO (``*after_optimizations.txt``), the thunk sequence (every kernel
with its launch configuration and the stream it runs on) and the debug options
the compile actually saw can be read back.

Meshes captured inside ``fn`` (``shard_map(mesh=...)``, sharding constraints,
nested ``jit`` shardings) are re-targeted too (:mod:`.retarget`): the function is
traced to a jaxpr on the mesh it was written for, every concrete mesh in it is
swapped for the target mesh with the same axis names, and the result is compiled.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from jax_overlap._src import errors, framework_jits
from jax_overlap._src import targets as targets_lib
from jax_overlap._src.compile import dumps, gemm_configs, kernel_cache, retarget, xla_log
from jax_overlap._src.compile import store as compile_store
from jax_overlap._src.compile.memory_stats import MemoryStats, memory_stats
from jax_overlap._src.flags import aborts as aborts_lib
from jax_overlap._src.flags import per_compile

__all__ = ["CompiledStep", "MemoryStats", "compile_for_target", "memory_stats"]


@dataclasses.dataclass
class CompiledStep:
  """A compiled step and XLA's artefacts for it.

  Attributes:
    compiled: the ``jax.stages.Compiled`` executable (compile-only for GPU targets).
    target: the topology, or None for the local devices.
    platform: "cuda" or the local platform.
    hlo_text: the scheduled, optimised HLO module text.
    thunk_text: XLA's thunk sequence listing (GPU only; "" otherwise).
    thunk_metadata: XLA's thunk metadata listing: the HLO instruction of each thunk
      by thunk id ("" where XLA writes none).
    debug_options: the non-default debug options the compile saw.
    mesh: the mesh the program was compiled on.
    dump_dir: where the artefacts were written (removed unless ``keep_dump``).
    compile_time_s: the time XLA took to compile (when the step was read back from
      the on-disk store, the time it took then).
    notes: what was changed to make the compile succeed (e.g. a fallback option).
    fallback_options: XLA options added for that, on top of the requested ones.
    memory: XLA's memory statistics (:class:`MemoryStats`); None where the backend
      gives none.
    profile_missing: for a compile scheduled from a latency profile, the instructions XLA's
      scheduler found no cost for in it (:mod:`.xla_log`); None without a profile.
    reused_kernels: compiled with XLA's kernel cache (:mod:`.kernel_cache`): kernels
      found there keep the names of the compile that made them, so the thunk listing's
      kernel names need not be those a compile of this step alone gives the driver.
  """

  compiled: Any
  target: targets_lib.Topology | None
  platform: str
  hlo_text: str
  thunk_text: str
  debug_options: dict[str, str]
  mesh: Mesh | None
  dump_dir: str | None
  compile_time_s: float = 0.0
  notes: list[str] = dataclasses.field(default_factory=list)
  fallback_options: dict[str, Any] = dataclasses.field(default_factory=dict)
  memory: MemoryStats | None = None
  thunk_metadata: str = ""
  reused_kernels: bool = False
  profile_missing: tuple[str, ...] | None = None


# What the on-disk store keeps of a step (XLA's output, not the executable).
_STORED = (
  "hlo_text",
  "thunk_text",
  "debug_options",
  "compile_time_s",
  "notes",
  "fallback_options",
  "memory",
  "thunk_metadata",
  "reused_kernels",
  "profile_missing",
)


def _stored(step: CompiledStep) -> dict[str, Any]:
  out = {f: getattr(step, f) for f in _STORED}
  out["memory"] = dataclasses.asdict(step.memory) if step.memory is not None else {}
  return out


def _stored_step(key: str, topo, mesh) -> CompiledStep | None:
  """The step the compile store keeps under ``key``, or None."""
  entry = compile_store.load(key)
  return _from_store(entry, topo, mesh) if entry is not None else None


def _from_store(entry: dict[str, Any], topo, mesh) -> CompiledStep | None:
  try:
    return CompiledStep(
      compiled=None,
      target=topo,
      platform="cuda",
      mesh=mesh,
      dump_dir=None,
      hlo_text=str(entry["hlo_text"]),
      thunk_text=str(entry["thunk_text"]),
      debug_options={str(k): str(v) for k, v in entry["debug_options"].items()},
      compile_time_s=float(entry["compile_time_s"]),
      notes=[str(n) for n in entry["notes"]],
      fallback_options=dict(entry["fallback_options"]),
      memory=MemoryStats.of(entry["memory"]),
      thunk_metadata=str(entry.get("thunk_metadata", "")),
      reused_kernels=bool(entry.get("reused_kernels", False)),
      profile_missing=(
        None if entry.get("profile_missing") is None else tuple(entry["profile_missing"])
      ),
    )
  except (KeyError, TypeError, ValueError, AttributeError):
    return None  # another format: compiled again


# XLA's Triton GEMM emitter, without a GPU to autotune on, can fail to find
# tile sizes for dots whose dimensions have odd factors (e.g. 8 x 63 rows).
_TILING_ERROR = "Couldn't find output tile sizes"
TILING_FALLBACK = {"xla_gpu_enable_triton_gemm": False}
TILING_NOTE = (
  "XLA's Triton GEMM emitter found no tile sizes for a dot in this deviceless compile; "
  "compiled with {options} (GEMMs are cuBLAS calls in this {what})"
)


def fallback_for(error: Exception, topo, options: Mapping[str, Any]) -> dict[str, Any] | None:
  """Options that avoid a known deviceless compile failure, or None (every compile path:
  the analysis, its variants and the memory breakdown)."""
  if topo is None or _TILING_ERROR not in str(error):
    return None
  if any(k in options for k in TILING_FALLBACK):
    return None  # the user chose; do not override
  return dict(TILING_FALLBACK)


def spelled(options: Mapping[str, Any]) -> str:
  return ", ".join(f"{k}={v}" for k, v in options.items())


def _ptx_dump_options() -> dict[str, Any]:
  """Options that make a GPU compile's dump hold its kernels' PTX (``*.ptx``, read for their
  ``.entry`` names and, by ``ptxas``, their registers). jaxlib up to 0.10 writes one file a
  module with ``xla_dump_to`` alone; later ones write PTX (one file a kernel) only when
  ``xla_dump_emitter_re`` matches the emitter named ``ptx``. The pattern names that emitter
  alone: ``.*`` would also dump every kernel's LLVM and Triton IR with emitter locations,
  which symbolizes stack traces and makes a small step's compile ten times slower."""
  import jaxlib

  from jax_overlap._src.flags.validation import version_tuple

  return {"xla_dump_emitter_re": "^ptx$"} if version_tuple(jaxlib.__version__) >= (0, 11) else {}


def compile_lowered(
  lowered, options: Mapping[str, Any], topo, *, retry_dump_to: str | None = None
) -> tuple[Any, dict[str, Any]]:
  """(XLA's executable, the fallback options it needed, or {}): ``lowered`` compiled with
  ``options``, and once more with :func:`fallback_for`'s options (dumped to
  ``retry_dump_to`` when given) if XLA fails in a known way. Otherwise, and if the retry
  fails too, XLA's first error is raised.

  Raises:
    ConfigError: before compiling, if the options (or ``XLA_FLAGS``) would make the
      installed XLA abort the process on this program (:mod:`.flags.aborts`).
  """
  options = dumps.with_dump_settings(per_compile.spelled(options))
  aborts_lib.check_program(lowered, options)
  with _kept_from_jax_cache(topo):
    try:
      return lowered.compile(options), {}
    except Exception as first:  # noqa: BLE001 - XLA raises JaxRuntimeError and others
      fallback = fallback_for(first, topo, options)
      if fallback is None:
        raise
      retry = {**options, **fallback}
      if retry_dump_to is not None:
        retry["xla_dump_to"] = retry_dump_to
      try:
        return lowered.compile(retry), fallback
      except Exception:  # noqa: BLE001
        raise first from None


def _kept_from_jax_cache(topo):
  """A context keeping this thread's deviceless compiles (``topo`` not None) out of JAX's
  persistent compilation cache, where the user has one: JAX cannot load them (it warned on
  every later read), and a process with the GPUs whose compile has the same key (dump
  options are not in it) would get an executable XLA never autotuned. JAX writes when the
  compile took ``jax_persistent_cache_min_compile_time_secs`` (a per-thread setting, here
  made unreachable); a JAX without that setting is left as it is."""
  if topo is None:
    return contextlib.nullcontext()
  try:
    from jax._src import config as jax_config

    return jax_config.persistent_cache_min_compile_time_secs(float("inf"))
  except (ImportError, AttributeError, TypeError):
    return contextlib.nullcontext()


def failure(api: str, error: Exception, topo) -> RuntimeError:
  """The error for an XLA compile of ``topo`` (None: the local devices) that failed:
  ``api`` (e.g. "XLA could not compile the function") with XLA's first line."""
  where = topo.name if topo is not None else "the local devices"
  msg = str(error).strip().splitlines()
  return RuntimeError(f"{api} for {where}: {msg[0] if msg else type(error).__name__}")


# Deviceless compiles of this process, by (program, options, target): the same program
# compiled again with the same options (a variant selection run twice, its chosen variant
# analysed, a report of the same step) reuses XLA's result instead of compiling anew. XLA's
# compile is deterministic for the same module, options and target; option values that
# name files (latency profiles) are named by their content. Only GPU targets, whose
# compile-only executables cannot run, and only compiles whose dump is not kept. Other
# processes find the same results on disk (:mod:`.store`).
_MEMO: collections.OrderedDict = collections.OrderedDict()
_MEMO_SIZE = 48
_MEMO_LOCK = threading.Lock()
_IN_FLIGHT: dict[str, threading.Event] = {}  # memo keys being compiled, by any thread


def _memo_key(lowered, options: Mapping[str, Any], topo) -> str | None:
  if topo is None:
    return None
  try:
    text = lowered.as_text()
  except Exception:  # noqa: BLE001 - a lowering that cannot print is compiled every time
    return None

  # A kernel cache is named by being there, not by its path (each compile of a selection
  # has a file of its own): the kernel names of a compile that may take kernels from one
  # are not the step's own, so those compiles are kept apart from the others. An option
  # naming a file or folder XLA reads as input (a latency profile, autotuning results) is
  # keyed by what is in it: the same profile under another cache folder is the same
  # compile, and a profile rewritten in place is another.
  # The same holds for the tile configurations a selection's compiles share
  # (:mod:`.gemm_configs`): each is the one XLA would choose.
  def keyed(k, v):
    if k == kernel_cache.OPTION:
      return "<kernel cache>"
    return "<gemm configs>" if gemm_configs.ours({k: v}) else _option_key(k, v)

  opts = sorted((k, keyed(k, v)) for k, v in options.items() if k != "xla_dump_to")
  h = hashlib.sha256(text.encode())
  h.update(repr((opts, topo.name, jax.__version__)).encode())
  return h.hexdigest()


# Options whose value names a file or folder XLA reads as the compile's input. Others that
# name paths are outputs (dumps, autotuning results written), caches XLA fills as it goes,
# or installations (``xla_gpu_cuda_data_dir``): keyed by the path.
_INPUT_PATH_OPTIONS = frozenset(
  {"xla_gpu_pgle_profile_file_or_directory_path", "xla_gpu_load_autotune_results_from"}
)


def _option_key(name: str, value: Any) -> str:
  """An option's value as a compile's key: for an input file or folder that exists, what is
  in it (a file's bytes, a folder's files by name); else the value's ``repr``."""
  if name not in _INPUT_PATH_OPTIONS or not isinstance(value, str) or not value:
    return repr(value)
  if not os.path.exists(value):
    return repr(value)
  h = hashlib.sha256()
  try:
    if os.path.isdir(value):
      for root, dirs, files in os.walk(value):
        dirs.sort()
        for file in sorted(files):
          path = os.path.join(root, file)
          h.update(os.path.relpath(path, value).encode() + b"\0")
          with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    else:
      with open(value, "rb") as f:
        h.update(f.read())
  except OSError:
    return repr(value)  # unreadable here: XLA will say so; keyed by the path
  return f"<contents {h.hexdigest()}>"


def _claim(key: str | None) -> tuple[CompiledStep | None, threading.Event | None]:
  """(the remembered step, None), or (None, an event this caller sets once it has compiled
  ``key``). Variants are compiled from several threads, and two of them may lower to the
  same module: the second waits for the first's compile instead of repeating it."""
  if key is None:
    return None, None
  while True:
    with _MEMO_LOCK:
      hit = _MEMO.get(key)
      if hit is not None:
        _MEMO.move_to_end(key)
        return hit, None
      running = _IN_FLIGHT.get(key)
      if running is None:
        owned = _IN_FLIGHT[key] = threading.Event()
        return None, owned
    running.wait()  # then the memo has it, or that compile failed and this one tries


def _remember(key: str, step: CompiledStep) -> None:
  """Keeps ``step`` in the in-process memo (the caller holds ``_MEMO_LOCK``)."""
  _MEMO[key] = step
  while len(_MEMO) > _MEMO_SIZE:
    _MEMO.popitem(last=False)


def clear_memo() -> None:
  """Forgets the deviceless compiles this process remembers."""
  with _MEMO_LOCK:
    _MEMO.clear()


def compile_for_target(
  fn: Callable,
  *args,
  target: str | targets_lib.Topology | None = "h100x8",
  xla_options: Mapping[str, Any] | None = None,
  mesh: Mesh | Mapping[str, int] | None = None,
  keep_dump: bool = False,
  api_name: str = "compile_for_target",
  **kwargs,
) -> CompiledStep:
  """Compiles ``fn(*args, **kwargs)`` for ``target`` and reads XLA's artefacts.

  Args:
    fn: a function or a jitted function (``nnx.jit``, ``eqx.filter_jit``: their ``jax.jit``).
    *args: arrays or ``jax.ShapeDtypeStruct`` (with shardings for sharded inputs).
    target: topology name for a deviceless GPU compile, or None for the local devices.
    xla_options: per-compile XLA options.
    mesh: the mesh to compile on; by default the target mesh with the axis
      names of the meshes found in ``args`` (or in ``fn``).
    keep_dump: keep the dump directory (its path is in the result), with the kernels' PTX.
    api_name: the public API to name in errors in the user's call.
    **kwargs: keyword arguments of ``fn``.

  Returns:
    A :class:`CompiledStep`.

  Raises:
    ValueError: if the arguments' shardings name axes the target mesh lacks,
      or the mesh cannot be mapped onto the target.
    TypeError, ValueError, ...: if tracing ``fn`` on the arguments fails (a
      mistake in the call), with the kind of error the trace raised.
    RuntimeError: if XLA cannot compile the program for the target, with
      XLA's message.
  """
  import time

  if framework_jits.is_wrapped_step(fn):  # nnx.jit, filter_jit: the jax.jit inside
    opts = dict(target=target, xla_options=xla_options, mesh=mesh, keep_dump=keep_dump)
    again = functools.partial(compile_for_target, api_name=api_name, **opts)
    return framework_jits.on_arguments(fn, args, kwargs, lambda f, a, kw: again(f, *a, **kw))
  options = dict(xla_options or {})
  if "xla_dump_to" in options:
    dump_dir, own_dir = options["xla_dump_to"], False
  else:
    dump_dir, own_dir = tempfile.mkdtemp(prefix="jax_overlap_"), True
  options["xla_dump_to"] = dump_dir
  topo = targets_lib.get(target) if target is not None else None
  if keep_dump and topo is not None:
    options = {**_ptx_dump_options(), **options}
  memo_key, owned = None, None
  held = contextlib.ExitStack()  # the store's lock while this process compiles

  try:
    leaves_meshes = retarget.meshes_in((args, kwargs))
    context = retarget.context_mesh()
    if context is not None:
      leaves_meshes = [*leaves_meshes, context]
    if topo is None:
      tmesh = mesh if isinstance(mesh, Mesh) else (leaves_meshes[0] if leaves_meshes else None)
      lower_args, lower_kwargs = args, kwargs
      target_fn = fn if hasattr(fn, "lower") else jax.jit(fn)
    else:
      if isinstance(mesh, Mesh) and mesh.devices.flat[0].platform != "cpu":
        tmesh = mesh
      else:
        tmesh = retarget.target_mesh_like(
          mesh or (leaves_meshes[0] if leaves_meshes else None), topo
        )
      lower_args, lower_kwargs = retarget.placed_on(
        jax.tree.map(lambda x: retarget.retarget_arg(x, tmesh), (args, kwargs)), tmesh
      )
      target_fn = retarget.retargeted(fn, tmesh, args, kwargs)
      if context is not None:  # traced under the target's mesh in its place
        held.enter_context(jax.set_mesh(tmesh))
    t0 = time.perf_counter()
    notes: list[str] = []
    if hasattr(target_fn, "trace"):
      lower = errors.trace_user_fn(
        api_name, fn, args, kwargs, lambda: target_fn.trace(*lower_args, **lower_kwargs)
      ).lower
    else:
      lower = functools.partial(target_fn.lower, *lower_args, **lower_kwargs)
    try:
      lowered = lower()
      memo_key = _memo_key(lowered, options, topo) if own_dir and not keep_dump else None
      hit, owned = _claim(memo_key)
      if hit is None and memo_key is not None:
        hit = _stored_step(memo_key, topo, tmesh)
        if hit is None:
          # Another process may be compiling it: wait for that, then read its result.
          held.enter_context(compile_store.compiling(memo_key))
          hit = _stored_step(memo_key, topo, tmesh)
        if hit is not None:
          with _MEMO_LOCK:
            _remember(memo_key, hit)
      if hit is not None:
        return dataclasses.replace(hit, notes=list(hit.notes))
      # Kernels taken from a kernel cache keep the names of the compile that made them.
      reused = kernel_cache.OPTION in options
      with xla_log.quiet_if_profiled(options) as lookups:
        compiled, fallback = compile_lowered(lowered, options, topo)
      if (said := xla_log.summary(lookups)) is not None:
        notes.append(said)
      missing = tuple(sorted(set(lookups.missing))) if options.get(xla_log.PROFILE_OPTION) else None
      if fallback:
        notes.append(TILING_NOTE.format(options=spelled(fallback), what="report"))
    except (ValueError, errors.ConfigError):
      raise
    except Exception as e:  # noqa: BLE001 - XLA raises JaxRuntimeError and others
      unknown = per_compile.unknown_option_error(api_name, e)
      if unknown is not None:
        raise unknown from None
      raise failure("XLA could not compile the function", e, topo) from e
    compile_time = time.perf_counter() - t0
    if topo is not None:
      dumps.check_compiled_for_gpu(dump_dir, topo, api_name)
    hlo = dumps.read(os.path.join(dump_dir, "*after_optimizations.txt"))
    thunks = dumps.read(os.path.join(dump_dir, "*thunk_sequence.txt"))
    metadata = dumps.read(os.path.join(dump_dir, "*thunk_metadata.txt"))
    if kernel_cache.OPTION in options and topo is not None and not metadata:
      kernel_cache.mark_unsupported()
    dbg = dumps.debug_options(dumps.read(os.path.join(dump_dir, "*.debug_options")))
    gemm_configs.record(dump_dir, options)  # where the options name a selection's tiles
    platform = "cuda" if topo is not None else jax.devices()[0].platform
    step = CompiledStep(
      compiled=compiled,
      target=topo,
      platform=platform,
      hlo_text=hlo,
      thunk_text=thunks,
      debug_options=dbg,
      mesh=tmesh,
      dump_dir=dump_dir if keep_dump or not own_dir else None,
      compile_time_s=compile_time,
      notes=notes,
      fallback_options=fallback,
      memory=memory_stats(compiled),
      thunk_metadata=metadata,
      reused_kernels=reused,
      profile_missing=missing,
    )
    if memo_key is not None:
      with _MEMO_LOCK:
        _remember(memo_key, dataclasses.replace(step, notes=list(notes)))
      compile_store.save(memo_key, _stored(step))
    return step
  finally:
    held.close()
    if owned is not None:
      with _MEMO_LOCK:
        del _IN_FLIGHT[memo_key]
      owned.set()
    if own_dir and not keep_dump:
      shutil.rmtree(dump_dir, ignore_errors=True)
