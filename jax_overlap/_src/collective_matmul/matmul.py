"""The 2-D collective matmuls (``all_gather(x) @ w`` and ``psum_scatter(x @ w)``) with
custom VJPs whose backward passes are again collective matmuls."""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

from jax_overlap._src.collective_matmul.rings import (
  ag_ring,
  dot_block,
  rs_ring,
)
from jax_overlap._src.collective_matmul.validate import (
  axis_size,
  check_operands,
  directions,
)

AxisName = str | tuple[str, ...]


def _vma(v) -> frozenset:
  aval = jax.typeof(v)
  mat = getattr(aval, "mat", None)  # jax >= 0.10: the manual axis type
  if mat is not None and hasattr(mat, "varying"):
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", frozenset()))  # earlier jax


def _match_primal(ct, primal, checked):
  """Gives ``ct`` the varying-axes type of ``primal`` (under shard_map's check_vma).

  Axes over which the primal was replicated but the cotangent varies are
  summed over, as JAX's own transpose rules do; axes over which the primal
  varies but the cotangent does not are marked varying.
  """
  if not checked:
    return ct
  extra = tuple(sorted(_vma(ct) - _vma(primal)))
  if extra:
    ct = lax.psum(ct, extra)
  missing = tuple(sorted(_vma(primal) - _vma(ct)))
  if missing:
    ct = lax.pcast(ct, missing, to="varying")
  return ct


def all_gather_matmul(
  x: jax.typing.ArrayLike,
  w: jax.typing.ArrayLike,
  *,
  axis: AxisName,
  bidirectional: bool = False,
  chunks: int | None = None,
  precision: Any = None,
  preferred_element_type: Any = None,
) -> jax.Array:
  """``all_gather(x, axis, tiled=True) @ w`` as a ppermute ring interleaved with partial dots.

  Call inside a ``shard_map`` body. ``x`` is this device's row block of the
  (sequence- or batch-) sharded activations; ``w`` is this device's weight
  (typically a column block of a column-parallel weight).

  Args:
    x: ``(m / N, k)`` local row block, ``N`` the size of ``axis``.
    w: ``(k, n)`` local weight.
    axis: the mesh axis name of the ring.
    bidirectional: split each block in halves sent in opposite directions,
      using both directions of every link.
    chunks: pieces per block (default 1, or 2 when bidirectional; must be
      even when bidirectional and divide ``m / N``). More pieces give the
      scheduler finer-grained work to overlap, at more kernel launches.
    precision: passed to the dots.
    preferred_element_type: passed to the dots (e.g. ``jnp.float32``).

  Returns:
    ``(m, n)``: the rows of every device, in device order, times ``w``.

  Raises:
    TypeError: if ``x`` or ``w`` is not an array or ``axis`` is not a name.
    ValueError: if the ranks are not 2, the contracting dimensions differ,
      ``axis`` is not bound, or ``chunks`` does not fit.

  Example:
    >>> from functools import partial
    >>> from jax.sharding import PartitionSpec as P
    >>> @partial(jax.shard_map, mesh=mesh, in_specs=(P("tensor"), P(None, "tensor")),
    ...          out_specs=P(None, "tensor"))  # doctest: +SKIP
    ... def layer(x, w):
    ...   return all_gather_matmul(x, w, axis="tensor", bidirectional=True)
  """
  api = "all_gather_matmul"
  check_operands(api, x, w, "(m / N, k)")
  n = axis_size(api, axis)
  axis = axis[0] if isinstance(axis, (tuple, list)) else axis
  dirs = directions(api, x.shape[0], "x.shape[0] (the local rows)", bidirectional, chunks)
  return _ag_matmul(x, w, axis, n, dirs, precision, preferred_element_type)


def matmul_reduce_scatter(
  x: jax.typing.ArrayLike,
  w: jax.typing.ArrayLike,
  *,
  axis: AxisName,
  bidirectional: bool = False,
  chunks: int | None = None,
  precision: Any = None,
  preferred_element_type: Any = None,
) -> jax.Array:
  """``psum_scatter(x @ w, axis, scatter_dimension=0, tiled=True)`` as a ring of partial dots.

  Call inside a ``shard_map`` body. The contraction dimension ``k`` is sharded
  along ``axis`` (a row-parallel weight), so ``x @ w`` on each device is a
  partial sum; the result is this device's row block of the full sum.

  Args:
    x: ``(m, k / N)`` local activations, ``N`` the size of ``axis``.
    w: ``(k / N, n)`` local weight.
    axis: the mesh axis name of the ring.
    bidirectional: split each block in halves sent in opposite directions.
    chunks: pieces per block (default 1, or 2 when bidirectional; must be
      even when bidirectional and divide ``m / N``).
    precision: passed to the dots.
    preferred_element_type: passed to the dots; also the dtype in which the
      partial sums travel and accumulate.

  Returns:
    ``(m / N, n)``: this device's row block of the sum over the axis.

  Raises:
    TypeError: if ``x`` or ``w`` is not an array or ``axis`` is not a name.
    ValueError: if the ranks are not 2, the contracting dimensions differ,
      ``axis`` is not bound, ``m`` is not divisible by ``N``, or ``chunks``
      does not fit.

  Example:
    >>> @partial(jax.shard_map, mesh=mesh, in_specs=(P(None, "tensor"), P("tensor")),
    ...          out_specs=P("tensor"))  # doctest: +SKIP
    ... def layer(h, w):
    ...   return matmul_reduce_scatter(h, w, axis="tensor")
  """
  api = "matmul_reduce_scatter"
  check_operands(api, x, w, "(m, k / N)")
  n = axis_size(api, axis)
  axis = axis[0] if isinstance(axis, (tuple, list)) else axis
  if x.shape[0] % n:
    raise ValueError(
      f"{api}: x.shape[0] ({x.shape[0]}) must be divisible by the size of axis {axis!r} ({n})"
    )
  dirs = directions(api, x.shape[0] // n, "x.shape[0] / axis size", bidirectional, chunks)
  return _rs_matmul(x, w, axis, n, dirs, precision, preferred_element_type)


def _ag_matmul(x, w, axis, n, dirs, precision, preferred):
  @jax.custom_vjp
  def f(x, w):
    return ag_ring(x, w, axis, n, dirs, precision, preferred, collect=False)[0]

  def fwd(x, w):
    y, xf = ag_ring(x, w, axis, n, dirs, precision, preferred, collect=True)
    return y, (xf, x, w)

  def bwd(res, ct):
    xf, x, w = res
    checked = bool(_vma(x) | _vma(w))
    dx = rs_ring(ct, w.T.astype(ct.dtype), axis, n, dirs, precision, None)
    dw = dot_block(xf.T, ct, precision, None)
    return (
      _match_primal(dx.astype(x.dtype), x, checked),
      _match_primal(dw.astype(w.dtype), w, checked),
    )

  f.defvjp(fwd, bwd)
  return f(x, w)


def _rs_matmul(x, w, axis, n, dirs, precision, preferred):
  @jax.custom_vjp
  def f(x, w):
    return rs_ring(x, w, axis, n, dirs, precision, preferred)

  def fwd(x, w):
    return f(x, w), (x, w)

  def bwd(res, ct):
    x, w = res
    checked = bool(_vma(x) | _vma(w))
    dx, ct_full = ag_ring(ct, w.T.astype(ct.dtype), axis, n, dirs, precision, None, collect=True)
    dw = dot_block(x.T, ct_full.astype(x.dtype), precision, None)
    return (
      _match_primal(dx.astype(x.dtype), x, checked),
      _match_primal(dw.astype(w.dtype), w, checked),
    )

  f.defvjp(fwd, bwd)
  return f(x, w)
