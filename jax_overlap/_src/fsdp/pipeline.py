"""The software-pipelined loop of :func:`scan_layers` and the small tree helpers it uses:
the gather of layer ``i + prefetch`` issued in iteration ``i``, the cotangents of layer
``i`` reduce-scattered in iteration ``i - 1``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _gather(tree, dims, axis, *, stacked: bool):
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  off = 1 if stacked else 0
  out = [
    x if d is None else lax.all_gather(x, axis, axis=d + off, tiled=True)
    for x, d in zip(leaves, dims)
  ]
  return jax.tree_util.tree_unflatten(treedef, out)


def _scatter(tree, dims, axis):
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  out = [
    x if d is None else lax.psum_scatter(x, axis, scatter_dimension=d, tiled=True)
    for x, d in zip(leaves, dims)
  ]
  return jax.tree_util.tree_unflatten(treedef, out)


def _concat(parts):
  parts = [p for p in parts if p is not None and jax.tree.leaves(p)]
  if not parts:
    return None
  if len(parts) == 1:
    return parts[0]
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts)


def _expand(tree):
  return jax.tree.map(lambda a: a[None], tree)


def _index(tree, i):
  """Item ``i`` (a Python int or a traced index) of every stacked leaf."""
  if isinstance(i, (int, np.integer)):
    return jax.tree.map(lambda a: a[i], tree)
  return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _store(tree, values, i):
  """Writes ``values`` at item ``i`` of every stacked leaf (in place in a loop)."""
  return jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, i, 0), tree, values)


def _pipeline(step, first_step, carry, local, *, n, k, gather, unroll, reverse=False, initial=None):
  """Runs ``step`` over the ``n`` layers, gathering the layer ``k`` items ahead.

  Items are the layers in order, or from the last to the first when
  ``reverse``. Every stacked array is read by index inside the loops, so no
  sliced or reversed copies of the parameters or residuals are made.

  Args:
    step: ``step(full_params, carry, layer) -> (carry, y)``, with ``layer``
      the (possibly traced) layer index of the item.
    first_step: like ``step`` for the first item (it may change the carry's
      structure and return ``y=None``), or None to use ``step``.
    carry: the initial carry.
    local: pytree of stacked local shards, leading dimension ``n``.
    n: number of layers.
    k: prefetch depth, ``0 <= k <= n``.
    gather: ``gather(tree, stacked) -> tree`` of full parameters.
    unroll: passed to ``lax.scan``.
    reverse: process the layers from last to first.
    initial: the gathered buffer of the first ``k`` items, as returned by a
      previous call over the same layers in the other direction; when given,
      the prologue gather is skipped.

  Returns:
    ``(carry, ys, buf)`` with ``ys`` the stacked outputs of the items that
    have one, in layer order, and ``buf`` the gathered buffer of the last
    ``k`` items (None when ``k == 0``). Layer ``l`` lives in slot ``l % k``
    of the buffer in both directions, so the buffer a forward pass ends with
    is the one a reverse pass over the same layers starts with.
  """

  def layer(i):
    return n - 1 - i if reverse else i

  def scan(body, c, lo, hi):
    return lax.scan(body, c, np.arange(lo, hi, dtype=np.int32), unroll=unroll)

  ys_parts = []  # in processing order

  def run_first(full, c):
    if first_step is None:
      c, y = step(full, c, layer(0))
      return c, _expand(y)
    c, y = first_step(full, c, layer(0))
    return c, (None if y is None else _expand(y))

  def result(c, b=None):
    ys = _concat(ys_parts)
    if reverse and ys is not None:
      ys = jax.tree.map(lambda a: jnp.flip(a, axis=0), ys)
    return c, ys, b

  if k == 0:
    start = 0
    if first_step is not None:
      carry, y = run_first(gather(_index(local, layer(0)), stacked=False), carry)
      ys_parts.append(y)
      start = 1
    if n > start:

      def body(c, i):
        return step(gather(_index(local, layer(i)), stacked=False), c, layer(i))

      carry, ys = scan(body, carry, start, n)
      ys_parts.append(ys)
    return result(carry)

  # Prologue: one gather for the first k items; layer l lives in slot l % k.
  if initial is not None:
    buf = initial
  else:
    lo, hi = (n - k, n) if reverse else (0, k)
    buf = gather(jax.tree.map(lambda a: a[lo:hi], local), stacked=True)
    if k == 1:
      buf = _index(buf, 0)
    elif lo % k:
      buf = jax.tree.map(lambda a: jnp.roll(a, lo % k, axis=0), buf)

  def read(b, slot):
    return b if k == 1 else _index(b, slot)

  def write(b, v, slot):
    return v if k == 1 else _store(b, v, slot)

  # Main loop: item i computes with its layer's slot and refills it with item
  # i + k (whose layer has the same slot).
  n_main = n - k
  start = 0
  if n_main > 0 and first_step is not None:
    nxt = gather(_index(local, layer(k)), stacked=False)
    carry, y = run_first(read(buf, layer(0) % k), carry)
    buf = write(buf, nxt, layer(0) % k)
    ys_parts.append(y)
    start = 1
  if n_main > start:

    def main_body(state, i):
      c, b = state
      slot = layer(i) % k
      nxt = gather(_index(local, layer(i + k)), stacked=False)
      c, y = step(read(b, slot), c, layer(i))
      return (c, write(b, nxt, slot)), y

    (carry, buf), ys = scan(main_body, (carry, buf), start, n_main)
    ys_parts.append(ys)

  # Epilogue: the last k items, already gathered.
  start = n_main
  if n_main == 0 and first_step is not None:
    carry, y = run_first(read(buf, layer(0) % k), carry)
    ys_parts.append(y)
    start = 1
  if n > start:

    def epi_body(c, i):
      return step(read(buf, layer(i) % k), c, layer(i))

    carry, ys = scan(epi_body, carry, start, n)
    ys_parts.append(ys)
  return result(carry, buf)


def _one_by_one(op, tree, dims, order):
  """Applies ``op(leaf, dim)`` to the leaves with a dim, one after another in ``order``.

  Each collective's input is tied to the previous one's result by an
  optimization barrier, so they are issued in ``order`` as their inputs
  become ready rather than as one merged collective after the last input.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  out = list(leaves)
  prev = None
  for i in order:
    if dims[i] is None:
      continue
    x = leaves[i] if prev is None else after(leaves[i], prev)
    out[i] = prev = op(x, dims[i])
  return jax.tree_util.tree_unflatten(treedef, out)


def after(x, prev):
  """``x``, ordered after ``prev`` by an optimization barrier.

  Only between values that vary over the same mesh axes (the barrier would
  make ``x`` vary over ``prev``'s axes and fail shard_map's checks); otherwise
  ``x`` unchanged.
  """
  if varying(x) != varying(prev):
    return x
  x, _ = lax.optimization_barrier((x, prev))
  return x


def varying(x):
  """The manual mesh axes ``x`` varies over (shard_map's type), or None if unknown."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
  return None if vma is None else frozenset(vma)


def pcast_varying():
  """``x, axes -> x`` typed as varying over ``axes`` (shard_map), or None if unavailable."""
  pcast = getattr(lax, "pcast", None)
  if pcast is not None:
    return lambda x, axes: pcast(x, axes, to="varying")
  pvary = getattr(lax, "pvary", None)
  return None if pvary is None else (lambda x, axes: pvary(x, axes))
