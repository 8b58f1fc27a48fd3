"""Occupancy regions: cap the residency of the kernels of a piece of a JAX program.

``occupancy`` brackets a computation with two XLA FFI custom calls,
``jax_overlap_region_begin`` and ``jax_overlap_region_end``
(``xla_patches/regions/regions_ffi.cc``). Both are identities whose results
alias their operands, so they cost no copy, and they are tied to the enclosed
computation by data dependence: the enclosed ops consume the begin call's
results and the end call consumes theirs, so XLA cannot move them across it.

On CUDA the host-side handlers set and clear the runtime library's policy for
the launching thread: every kernel launched between begin and end is capped at
``blocks_per_sm`` resident blocks per SM (or the plan's value for the region's
name). Without the runtime library loaded (``jax-overlap launch``) they do
nothing. On CPU they record the order of region events (:func:`region_events`).

The wrapper is differentiable (``jax.custom_vjp``): the backward pass is
bracketed too, the end call's transpose opening the region around the
cotangent computation and the begin call's transpose closing it.

Sharded programs: use it inside ``jax.shard_map``; under plain ``jit`` with
sharded operands XLA's partitioner has no rule for the custom calls and may
gather their operands.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar, overload

import jax
import numpy as np
from jax.experimental.xla_metadata import set_xla_metadata

from jax_overlap._src.runtime.plan import region_id as _region_id

__all__ = ["occupancy", "Occupancy", "region_events", "clear_region_events"]

BEGIN_TARGET = "jax_overlap_region_begin"
END_TARGET = "jax_overlap_region_end"
_API = "jax_overlap.occupancy"
_HANDLERS = {
  "cpu": ("JaxOverlapRegionBeginCpu", "JaxOverlapRegionEndCpu"),
  "CUDA": ("JaxOverlapRegionBeginCuda", "JaxOverlapRegionEndCuda"),
}

_lock = threading.Lock()
_ffi_lib: ctypes.CDLL | None = None

F = TypeVar("F", bound=Callable[..., Any])


def _library() -> ctypes.CDLL:
  """Loads the FFI library and registers its handlers with jax, once."""
  global _ffi_lib
  with _lock:
    if _ffi_lib is not None:
      return _ffi_lib
    from jax_overlap._src.runtime.library import FFI_LIBRARY, library_path

    lib = ctypes.CDLL(str(library_path(FFI_LIBRARY)))
    for platform, (begin, end) in _HANDLERS.items():
      jax.ffi.register_ffi_target(
        BEGIN_TARGET, jax.ffi.pycapsule(getattr(lib, begin)), platform=platform
      )
      jax.ffi.register_ffi_target(
        END_TARGET, jax.ffi.pycapsule(getattr(lib, end)), platform=platform
      )
    lib.jor_ffi_region_event_count.restype = ctypes.c_int64
    lib.jor_ffi_region_events.restype = ctypes.c_int64
    lib.jor_ffi_region_events.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    _ffi_lib = lib
    return lib


def region_events() -> list[tuple[str, int, int]]:
  """Region events recorded by the CPU handlers, in order: (kind, region id, blocks_per_sm).

  ``kind`` is ``"begin"`` or ``"end"``. Only CPU executions record events.
  """
  lib = _library()
  n = int(lib.jor_ffi_region_event_count())
  buf = (ctypes.c_int64 * max(3 * n, 3))()
  n = int(lib.jor_ffi_region_events(buf, n))
  kinds = {1: "begin", 2: "end"}
  return [(kinds.get(buf[3 * i], "?"), int(buf[3 * i + 1]), int(buf[3 * i + 2])) for i in range(n)]


def clear_region_events() -> None:
  """Forgets the recorded CPU region events."""
  _library().jor_ffi_region_events_clear()


# ---------------------------------------------------------------------------
# The custom calls and their differentiation rules.
# ---------------------------------------------------------------------------


def _is_float0(x: Any) -> bool:
  return getattr(x, "dtype", None) == jax.dtypes.float0


def _result_type(x: Any) -> Any:
  # The operand's own type describes the result: shape, dtype and, inside
  # shard_map, how it varies over manual mesh axes.
  if isinstance(x, jax.Array):
    return jax.typeof(x)
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def _call(target: str, xs: tuple[Any, ...], rid: int, blocks: int) -> tuple[Any, ...]:
  """One custom call over the array leaves in ``xs`` (float0 leaves pass through)."""
  idx = [i for i, x in enumerate(xs) if not _is_float0(x)]
  if not idx:
    return tuple(xs)
  operands = [xs[i] for i in idx]
  _library()
  outs = jax.ffi.ffi_call(
    target,
    [_result_type(x) for x in operands],
    has_side_effect=True,
    input_output_aliases={i: i for i in range(len(operands))},
    vmap_method="broadcast_all",
  )(*operands, region_id=np.int64(rid), blocks_per_sm=np.int64(blocks))
  result = list(xs)
  for i, out in zip(idx, outs):
    result[i] = out
  return tuple(result)


def _marker(target: str, transposed: str):
  """A region marker calling ``target`` whose transpose calls ``transposed``: the
  backward region closes where the forward one opened, and opens where it closed."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
  def mark(rid: int, blocks: int, xs: tuple[Any, ...]) -> tuple[Any, ...]:
    return _call(target, xs, rid, blocks)

  def fwd(rid, blocks, xs):
    return mark(rid, blocks, xs), None

  def bwd(rid, blocks, _, cts):
    return (_call(transposed, tuple(cts), rid, blocks),)

  mark.defvjp(fwd, bwd)
  return mark


_begin = _marker(BEGIN_TARGET, END_TARGET)
_end = _marker(END_TARGET, BEGIN_TARGET)


def _bracket(fn: Callable, tree: Any, rid: int, blocks: int) -> Any:
  leaves, treedef = jax.tree.flatten(tree)
  idx = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]
  if not idx:
    return tree
  outs = fn(rid, blocks, tuple(leaves[i] for i in idx))
  for i, out in zip(idx, outs):
    leaves[i] = out
  return jax.tree.unflatten(treedef, leaves)


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


class Occupancy:
  """An occupancy region: a decorator and a context manager.

  Use :func:`occupancy` to make one. As a decorator it brackets the function's
  array arguments and results. As a context manager it yields itself; bracket
  the values that enter and leave the block with :meth:`begin` and :meth:`end`.
  """

  def __init__(self, *, blocks_per_sm: int | None, name: str | int | None):
    if blocks_per_sm is not None:
      if not isinstance(blocks_per_sm, int) or isinstance(blocks_per_sm, bool):
        raise TypeError(
          f"{_API}: blocks_per_sm must be an integer, got {type(blocks_per_sm).__name__}"
        )
      if blocks_per_sm < 1:
        raise ValueError(f"{_API}: blocks_per_sm must be >= 1, got {blocks_per_sm}")
    if blocks_per_sm is None and name is None:
      raise ValueError(
        f"{_API}: give blocks_per_sm, or a name whose blocks_per_sm the plan's 'regions' sets"
      )
    self.blocks_per_sm = blocks_per_sm or 0
    self.name = name
    self.region_id = _region_id(name) if name is not None else 0
    self._begun = 0
    self._ended = 0
    self._metadata: contextlib.AbstractContextManager | None = None

  def __repr__(self) -> str:
    return f"Occupancy(blocks_per_sm={self.blocks_per_sm or None}, name={self.name!r})"

  def begin(self, *values: Any) -> Any:
    """Opens the region on ``values`` (pytrees); returns them, now tied to the region."""
    self._begun += 1
    out = _bracket(_begin, values, self.region_id, self.blocks_per_sm)
    return out[0] if len(values) == 1 else out

  def end(self, *values: Any) -> Any:
    """Closes the region on ``values`` (pytrees); returns them."""
    if self._begun <= self._ended:
      raise RuntimeError(f"{_API}: end() called before begin() for region {self!r}")
    self._ended += 1
    out = _bracket(_end, values, self.region_id, self.blocks_per_sm)
    return out[0] if len(values) == 1 else out

  def __call__(self, fun: F) -> F:
    if not callable(fun):
      raise TypeError(f"{_API}: expected a function to wrap, got {type(fun).__name__}")

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
      args, kwargs = _bracket(_begin, (args, kwargs), self.region_id, self.blocks_per_sm)
      out = fun(*args, **kwargs)
      return _bracket(_end, out, self.region_id, self.blocks_per_sm)

    return wrapped  # type: ignore[return-value]

  def __enter__(self) -> Occupancy:
    self._begun = self._ended = 0
    self._metadata = _metadata_context(self)
    if self._metadata is not None:
      self._metadata.__enter__()
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if self._metadata is not None:
      self._metadata.__exit__(exc_type, exc, tb)
      self._metadata = None
    if exc_type is not None:
      return
    if self._begun == 0 or self._begun != self._ended:
      raise RuntimeError(
        f"{_API}: the region {self!r} was entered but begin() was called {self._begun} and "
        f"end() {self._ended} times; bracket the values that enter and leave it, e.g. "
        "`x = r.begin(x); y = f(x); y = r.end(y)`, or use the decorator form "
        "occupancy(f, blocks_per_sm=...)"
      )


def _metadata_context(region: Occupancy) -> contextlib.AbstractContextManager | None:
  """Tags the enclosed ops' HLO with the region (frontend attribute), where supported."""
  try:
    return set_xla_metadata(_jax_overlap_region=str(region.region_id))
  except TypeError:
    return None


@overload
def occupancy(fun: F, /, *, blocks_per_sm: int | None = ..., name: str | int | None = ...) -> F: ...


@overload
def occupancy(*, blocks_per_sm: int | None = ..., name: str | int | None = ...) -> Occupancy: ...


def occupancy(fun=None, /, *, blocks_per_sm=None, name=None):
  """Caps the resident blocks per SM of the kernels of a computation.

  Args:
    fun: function to wrap; without it, returns an :class:`Occupancy` usable as
      a decorator or a context manager.
    blocks_per_sm: cap on resident blocks per SM (>= 1) for every kernel launched
      inside the region; optional when the plan's ``regions`` sets it for ``name``.
    name: region name (or non-negative integer id) that plans refer to.

  Returns:
    The wrapped function, or an :class:`Occupancy`.

  Raises:
    ValueError: for blocks_per_sm < 1, or neither blocks_per_sm nor name.
    TypeError: for a non-integer blocks_per_sm or a non-callable ``fun``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mlp = occupancy(lambda x, w: jnp.tanh(x @ w), blocks_per_sm=2)
    >>> jax.jit(mlp)(jnp.ones((4, 4)), jnp.ones((4, 4))).shape
    (4, 4)
    >>> with occupancy(blocks_per_sm=2, name="mlp") as r:
    ...   x = r.begin(jnp.ones((4, 4)))
    ...   y = r.end(jnp.tanh(x))
  """
  region = Occupancy(blocks_per_sm=blocks_per_sm, name=name)
  if fun is None:
    return region
  return region(fun)
