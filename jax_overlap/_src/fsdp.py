"""FSDP layers under ``lax.scan`` with the next layer's all-gather issued early.

MaxText and similar codebases stack the parameters of their identical layers
(every leaf has a leading layer dimension ``L``) and run the layers with
``lax.scan``. Under fully sharded data parallelism each leaf is also sharded
along a mesh axis, so the loop body all-gathers the layer's parameters before
using them, and the backward pass reduce-scatters the parameter cotangents.
Written naively, each gather sits in the same iteration as the compute that
needs it and each reduce-scatter in the same iteration as the compute that
produces its operand: the latency-hiding scheduler cannot overlap them with
anything, and the collectives serialise with the layer's matmuls.

:func:`scan_layers` software-pipelines that loop:

* forward: iteration ``i`` computes layer ``i`` with parameters gathered in an
  earlier iteration (held in the loop carry) and issues the gather of layer
  ``i + prefetch``, so the gather and layer ``i``'s compute are independent;
* backward (a ``custom_vjp``): the layers are rematerialised in reverse order
  with the same prefetching of gathers, and the full-size parameter cotangent
  of layer ``i`` is carried into the iteration of layer ``i - 1``, which
  issues its reduce-scatter next to its own compute and writes the scattered
  result out.

Memory: at most ``prefetch`` gathered layers live in the carry (plus the one
being computed), and with ``prefetch > 0`` one unscattered layer cotangent in
the backward loop. The forward saves only the input carry of every layer (the
same as ``lax.scan`` over a ``jax.checkpoint``-ed layer with the
``nothing_saveable`` policy); ``remat_policy`` lets the forward save more.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

try:  # jax >= 0.6 exposes shard_map publicly.
  _shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older jax
  from jax.experimental.shard_map import shard_map as _shard_map  # type: ignore

__all__ = ["scan_layers"]

_API = "scan_layers"
AxisName = str | tuple[str, ...]
PyTree = Any


# ---------------------------------------------------------------------------
# Validation helpers.
# ---------------------------------------------------------------------------


def _keystr(path) -> str:
  s = jax.tree_util.keystr(path)
  return s if s else "<root>"


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or hasattr(x, "aval")


def _axis_tuple(axis: AxisName) -> tuple[str, ...]:
  if isinstance(axis, str):
    return (axis,)
  if isinstance(axis, (tuple, list)) and axis and all(isinstance(a, str) for a in axis):
    return tuple(axis)
  raise TypeError(f"{_API}: axis must be a mesh axis name or a tuple of names, got {axis!r}")


def _bound_axis_size(axes: tuple[str, ...]) -> int | None:
  """Product of the sizes of ``axes`` if all are bound here, else None."""
  size = 1
  for a in axes:
    try:
      size *= int(lax.axis_size(a))
    except NameError:
      return None
  return size


def _check_leaves(name: str, tree, *, need_layer_dim: bool) -> tuple[list, Any]:
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  if not path_leaves:
    raise ValueError(f"{_API}: {name} must contain at least one array, got {tree!r}")
  bad = [f"{name}{_keystr(p)} ({type(v).__name__})" for p, v in path_leaves if not _is_array(v)]
  if bad:
    raise TypeError(
      f"{_API}: every leaf of {name} must be an array, got non-arrays at {', '.join(bad)}"
    )
  bad = [
    f"{name}{_keystr(p)} ({jnp.dtype(v.dtype).name})"
    for p, v in path_leaves
    if not jnp.issubdtype(v.dtype, jnp.inexact)
  ]
  if bad:
    raise TypeError(
      f"{_API}: every leaf of {name} must have a floating dtype (it is differentiated), "
      f"got {', '.join(bad)}"
    )
  if need_layer_dim:
    bad = [f"{name}{_keystr(p)}" for p, v in path_leaves if np.ndim(v) == 0]
    if bad:
      raise ValueError(
        f"{_API}: every leaf of {name} needs a leading layer dimension, got scalars at "
        f"{', '.join(bad)}"
      )
  return path_leaves, treedef


def _normalize_gather_dims(gather_dim, path_leaves, treedef) -> list[int | None]:
  """One gather dimension (of the per-layer leaf, or None) per stacked leaf."""
  if gather_dim is None or isinstance(gather_dim, (int, np.integer)):
    dims = [gather_dim] * len(path_leaves)
  else:
    try:
      dims = treedef.flatten_up_to(gather_dim)
    except (ValueError, TypeError) as e:
      raise ValueError(
        f"{_API}: gather_dim must be an int, None, or a pytree with the structure of "
        f"stacked_params ({treedef}), got {gather_dim!r}"
      ) from e
  out = []
  for (path, leaf), d in zip(path_leaves, dims):
    if d is None:
      out.append(None)
      continue
    if not isinstance(d, (int, np.integer)) or isinstance(d, bool):
      raise TypeError(
        f"{_API}: gather_dim for stacked_params{_keystr(path)} must be an int or None, got {d!r}"
      )
    rank = np.ndim(leaf) - 1  # the per-layer rank
    if not -rank <= d < rank:
      raise ValueError(
        f"{_API}: gather_dim for stacked_params{_keystr(path)} must index a dimension of "
        f"the per-layer shape {tuple(np.shape(leaf)[1:])} (between {-rank} and {rank - 1}), "
        f"got {d}"
      )
    out.append(int(d) % rank)
  return out


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def scan_layers(
  layer_fn: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
  stacked_params: PyTree,
  carry: PyTree,
  *,
  axis: AxisName = "fsdp",
  prefetch: int = 1,
  gather_dim: int | None | PyTree = 0,
  unroll: int | bool = 1,
  remat_policy: Callable[..., bool] | None = None,
  mesh: jax.sharding.Mesh | None = None,
  carry_spec: Any = None,
  ys_spec: Any = None,
) -> tuple[PyTree, PyTree]:
  """Runs stacked FSDP layers with ``lax.scan``, overlapping gathers and reduce-scatters.

  Semantically this is::

    def body(c, p):
      full = jax.tree.map(lambda x, d: lax.all_gather(x, axis, axis=d, tiled=True), p, gather_dim)
      return layer_fn(full, c)
    return lax.scan(body, carry, stacked_params)

  with the same outputs and the same gradients, but the all-gather of layer
  ``i + prefetch`` is issued in the iteration that computes layer ``i`` and, in
  the backward pass, the reduce-scatter of layer ``i``'s parameter cotangent is
  issued in the iteration that computes the backward of layer ``i - 1``. The
  backward pass rematerialises each layer from its saved input carry and
  starts with the last ``prefetch`` gathered layers the forward pass ends with
  (kept, not gathered again).

  Call it inside a ``shard_map`` body, where ``stacked_params`` are the local
  shards. With ``mesh=`` it wraps itself in ``shard_map`` and takes global
  arrays instead (for ``jit``/GSPMD programs).

  Args:
    layer_fn: ``layer_fn(params, carry) -> (carry, y)`` for one layer, where
      ``params`` has the per-layer, gathered (full) shapes. It must be
      differentiable and return a carry with the structure, shapes and dtypes
      of ``carry``.
    stacked_params: pytree of floating arrays, each with a leading layer
      dimension ``L`` (the same for all leaves), sharded along ``axis`` on
      ``gather_dim``. Inside ``shard_map`` these are the local shards.
    carry: pytree of floating arrays, the loop carry (activations).
    axis: the mesh axis name (or tuple of names) the parameters are sharded on.
    prefetch: how many gathered layers to keep in flight in the loop carry;
      ``0`` gathers inside the iteration that uses them (no pipelining),
      ``k`` issues the gather of layer ``i + k`` in iteration ``i``. Between 0
      and ``L``. Extra memory: ``prefetch`` gathered layers.
    gather_dim: the dimension of each per-layer leaf (not counting the layer
      dimension) that is sharded along ``axis``: an int for all leaves, or a
      pytree like ``stacked_params`` of ints, or ``None`` for leaves that are
      replicated (not gathered; their cotangent is not scattered).
    unroll: passed to ``lax.scan``.
    remat_policy: a ``jax.checkpoint`` policy (e.g.
      ``jax.checkpoint_policies.dots_saveable``) naming the intermediates the
      forward saves per layer so the backward does not recompute them. The
      default ``None`` saves only the input carry of every layer.
    mesh: if given, wrap the call in ``shard_map`` over this mesh; the arrays
      are then global and ``stacked_params`` leaves are sharded
      ``P(None, ..., axis at gather_dim + 1)``.
    carry_spec: with ``mesh``, the ``PartitionSpec`` (or pytree of them) of
      the carry; default ``P(axis)`` on every leaf (batch sharded along the
      FSDP axis, data parallel).
    ys_spec: with ``mesh``, the ``PartitionSpec`` (or pytree) of the stacked
      per-layer outputs; default ``P(None, axis)``.

  Returns:
    ``(carry, ys)`` like ``lax.scan``: the final carry and the per-layer
    outputs ``y`` stacked along a new leading dimension of size ``L``.

  Raises:
    TypeError: if ``layer_fn`` is not callable, a leaf is not a floating
      array, or ``layer_fn`` cannot be differentiated (raised when the
      gradient is traced, naming ``layer_fn``).
    ValueError: if ``prefetch`` is outside ``[0, L]``, leaves disagree on
      ``L``, ``gather_dim`` is out of range, a sharded dimension does not
      divide by the axis size, or ``axis`` is not bound (not inside a
      ``shard_map`` over it and no ``mesh``) or not in ``mesh``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("fsdp",))  # doctest: +SKIP
    >>> def layer(p, x):
    ...   h = jnp.tanh(x @ p["w"])
    ...   return h, jnp.mean(h)
    >>> w = jnp.ones((4, 16, 16)) * 0.1  # 4 layers of 16 x 16
    >>> x = jnp.ones((8, 16))
    >>> out, ys = scan_layers(layer, {"w": w}, x, mesh=mesh)  # doctest: +SKIP
  """
  if not callable(layer_fn):
    raise TypeError(f"{_API}: layer_fn must be callable, got {type(layer_fn).__name__}")
  axes = _axis_tuple(axis)
  path_leaves, treedef = _check_leaves("stacked_params", stacked_params, need_layer_dim=True)
  _check_leaves("carry", carry, need_layer_dim=False)
  lengths = {int(np.shape(v)[0]) for _, v in path_leaves}
  if len(lengths) != 1:
    detail = ", ".join(f"stacked_params{_keystr(p)}: {np.shape(v)[0]}" for p, v in path_leaves)
    raise ValueError(
      f"{_API}: every leaf of stacked_params must have the same leading layer dimension, "
      f"got {detail}"
    )
  num_layers = lengths.pop()
  if num_layers < 1:
    raise ValueError(f"{_API}: stacked_params must hold at least one layer, got L=0")
  if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)):
    raise TypeError(f"{_API}: prefetch must be an int, got {prefetch!r}")
  if not 0 <= prefetch <= num_layers:
    raise ValueError(
      f"{_API}: prefetch must be between 0 and the number of layers ({num_layers}), got {prefetch}"
    )
  if not isinstance(unroll, (bool, int, np.integer)) or (
    not isinstance(unroll, bool) and unroll < 1
  ):
    raise ValueError(f"{_API}: unroll must be a positive int or a bool, got {unroll!r}")
  if remat_policy is not None and not callable(remat_policy):
    raise TypeError(
      f"{_API}: remat_policy must be a jax.checkpoint policy (callable) or None, "
      f"got {type(remat_policy).__name__}"
    )
  dims = _normalize_gather_dims(gather_dim, path_leaves, treedef)
  cfg = _Config(axes, int(prefetch), tuple(dims), unroll, remat_policy)

  if mesh is not None:
    return _scan_layers_mesh(layer_fn, stacked_params, carry, cfg, mesh, carry_spec, ys_spec)

  size = _bound_axis_size(axes)
  if size is None:
    raise ValueError(
      f"{_API}: axis {axis!r} is not bound here; call scan_layers inside a shard_map body "
      "whose mesh has that axis, or pass mesh= to let scan_layers wrap itself in shard_map"
    )
  return _scan_layers_local(layer_fn, stacked_params, carry, cfg)


# ---------------------------------------------------------------------------
# Implementation.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
  """Validated settings of one scan_layers call."""

  axes: tuple[str, ...]
  prefetch: int
  dims: tuple[int | None, ...]
  unroll: int | bool
  remat_policy: Callable[..., bool] | None

  @property
  def axis(self) -> AxisName:
    return self.axes[0] if len(self.axes) == 1 else self.axes


def _unchecked_shard_map(fn, **kw):
  """shard_map without the replication check (named check_vma, earlier check_rep)."""
  try:
    return _shard_map(fn, check_vma=False, **kw)
  except TypeError:  # pragma: no cover - older jax
    return _shard_map(fn, check_rep=False, **kw)


def _scan_layers_mesh(layer_fn, stacked, carry, cfg: _Config, mesh, carry_spec, ys_spec):
  from jax.sharding import PartitionSpec as P

  missing = [a for a in cfg.axes if a not in mesh.axis_names]
  if missing:
    raise ValueError(
      f"{_API}: axis {cfg.axis!r} is not an axis of mesh (axes {tuple(mesh.axis_names)})"
    )
  size = int(np.prod([mesh.shape[a] for a in cfg.axes]))
  path_leaves = jax.tree_util.tree_flatten_with_path(stacked)[0]
  bad = []
  specs = []
  for (path, leaf), d in zip(path_leaves, cfg.dims):
    if d is None:
      specs.append(P())
      continue
    n = np.shape(leaf)[d + 1]
    if n % size:
      bad.append(
        f"stacked_params{_keystr(path)} dimension {d} (of the per-layer shape "
        f"{tuple(np.shape(leaf)[1:])}) has size {n}"
      )
    specs.append(P(*([None] * (d + 1)), cfg.axis))
  if bad:
    raise ValueError(
      f"{_API}: sharded dimensions must be divisible by the size of axis {cfg.axis!r} "
      f"({size}), got {'; '.join(bad)}"
    )
  param_specs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(stacked), specs)
  if carry_spec is None:
    carry_spec = jax.tree.map(lambda _: P(cfg.axis), carry)
  if ys_spec is None:
    ys_spec = P(None, cfg.axis)

  def body(p, c):
    return _scan_layers_local(layer_fn, p, c, cfg)

  fn = _unchecked_shard_map(
    body, mesh=mesh, in_specs=(param_specs, carry_spec), out_specs=(carry_spec, ys_spec)
  )
  return fn(stacked, carry)


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


def _not_differentiable(e: Exception) -> TypeError:
  return TypeError(
    f"{_API}: layer_fn could not be differentiated with respect to its params and carry "
    f"(the backward pass re-runs it under jax.vjp): {type(e).__name__}: {e}"
  )


def _scan_layers_local(layer_fn, stacked, carry, cfg: _Config):
  num_layers = int(jax.tree.leaves(stacked)[0].shape[0])
  dims, axis, k = cfg.dims, cfg.axis, cfg.prefetch
  gather = functools.partial(_gather, dims=dims, axis=axis)

  # Hoist traced values that layer_fn closes over into explicit inputs, so the
  # custom_vjp can return their cotangents.
  # Shapes and types only: tracing real gathers here would leave dead ones in the program.
  example_params = jax.eval_shape(lambda s: gather(_index(s, 0), stacked=False), stacked)
  try:
    fn, consts = jax.closure_convert(layer_fn, example_params, carry)
  except TypeError as e:
    raise TypeError(f"{_API}: tracing layer_fn(params, carry) failed: {e}") from e
  except ValueError as e:
    raise ValueError(f"{_API}: tracing layer_fn(params, carry) failed: {e}") from e
  # One trace of the converted layer: its output types and its jaxpr.
  layer_jaxpr, layer_out = jax.make_jaxpr(lambda p, c, cs: fn(p, c, *cs), return_shape=True)(
    example_params, carry, consts
  )
  _check_layer_out(layer_out, carry)
  # The last layer's reduce-scatters (nothing left to hide under but that
  # layer's own backward) go one by one, in the order the backward pass
  # produces their inputs (the reverse of the order layer_fn uses the params),
  # so the first ones overlap the rest of the layer's backward.
  order = _use_order(layer_jaxpr, len(jax.tree.leaves(example_params)))

  def scatter_last(tree):
    return _one_by_one(
      lambda x, d: lax.psum_scatter(x, axis, scatter_dimension=d, tiled=True),
      tree,
      dims,
      order[::-1],
    )

  def f(full, c, cs):
    return fn(full, c, *cs)

  # Replicated leaves: their per-layer cotangent all-reduce (inserted by
  # autodiff, one per layer) becomes one all-reduce after the loop.
  deferred = _defer_replicated(layer_fn, layer_out, example_params, stacked, carry, consts, cfg)
  if deferred is not None:
    fn_b, vary, reduce = deferred

    def f_b(full, c, cs):  # full with the replicated leaves already typed varying
      return fn_b(full, c, *cs)

  policy = cfg.remat_policy

  run_layers = functools.partial(_pipeline, n=num_layers, k=k, gather=gather, unroll=cfg.unroll)

  @jax.custom_vjp
  def run(stacked_, carry_, consts_):
    def step(full, c, _):
      return f(full, c, consts_)

    c_out, ys, _ = run_layers(step, None, carry_, stacked_)
    return c_out, ys

  def run_fwd(stacked_, carry_, consts_):
    # The input carry of every layer goes into a preallocated stack (in place).
    saved0 = jax.tree.map(
      lambda a: jnp.broadcast_to(jnp.zeros_like(a)[None], (num_layers, *a.shape)), carry_
    )

    def step(full, state, i):
      c, saved = state
      saved = _store(saved, c, i)
      if policy is None:
        c2, y = f(full, c, consts_)
        return (c2, saved), (y, None)
      (c2, y), res = _vjp_residuals(f, full, c, consts_, policy)
      return (c2, saved), (y, res)

    (c_out, saved), ys_res, last = run_layers(step, None, (carry_, saved0), stacked_)
    ys, res = (None, None) if ys_res is None else ys_res
    # The last k gathered layers are kept for the backward pass, which starts
    # with them, instead of being gathered again.
    return (c_out, ys), (stacked_, saved, res, consts_, last)

  def run_bwd(residuals, cts):
    stacked_, saved, res, consts_, last = residuals
    ct_carry, ct_ys = cts
    zeros_consts = jax.tree.map(jnp.zeros_like, consts_)
    grads0 = jax.tree.map(jnp.zeros_like, stacked_)
    if deferred is not None:
      grads0 = vary(grads0)

    def layer_vjp(full, ct_c, i):
      c_in, ct_y = _index(saved, i), _index(ct_ys, i)
      r = None if res is None else _index(res, i)
      try:
        if r is None and deferred is not None:
          _, vjp_fn = jax.vjp(f_b, vary(full), c_in, consts_)
        elif r is None:
          _, vjp_fn = jax.vjp(f, full, c_in, consts_)
        else:
          vjp_fn = _vjp_from_residuals(f, full, c_in, consts_, policy, r)
        return vjp_fn((ct_c, ct_y))
      except (TypeError, ValueError, NotImplementedError) as e:
        raise _not_differentiable(e) from e

    add = lambda a, b: jax.tree.map(jnp.add, a, b)

    if k == 0:
      # No pipelining: reduce-scatter in the iteration that produced the cotangent.
      def step(full, state, i):
        ct_c, acc, grads = state
        ct_p, ct_c2, ct_k = layer_vjp(full, ct_c, i)
        grads = _store(grads, _scatter(ct_p, dims, axis), i)
        return (ct_c2, add(acc, ct_k), grads), None

      (ct_c0, ct_consts, grads), _, _ = run_layers(
        step, None, (ct_carry, zeros_consts, grads0), stacked_, reverse=True
      )
    else:
      # The cotangent of layer i is reduce-scattered in the iteration of layer i - 1.
      def first(full, state, i):
        ct_c, acc, grads = state
        ct_p, ct_c2, ct_k = layer_vjp(full, ct_c, i)
        return (ct_c2, add(acc, ct_k), grads, ct_p), None

      def step(full, state, i):
        ct_c, acc, grads, pending = state
        scattered = _scatter(pending, dims, axis)
        ct_p, ct_c2, ct_k = layer_vjp(full, ct_c, i)
        grads = _store(grads, scattered, i + 1)
        return (ct_c2, add(acc, ct_k), grads, ct_p), None

      (ct_c0, ct_consts, grads, pending), _, _ = run_layers(
        step, first, (ct_carry, zeros_consts, grads0), stacked_, reverse=True, initial=last
      )
      grads = _store(grads, scatter_last(pending), 0)
    if deferred is not None:
      grads = reduce(grads)
    return grads, ct_c0, ct_consts

  run.defvjp(run_fwd, run_bwd)
  return run(stacked, carry, consts)


def _pcast_varying():
  """``x, axes -> x`` typed as varying over ``axes`` (shard_map), or None if unavailable."""
  pcast = getattr(lax, "pcast", None)
  if pcast is not None:
    return lambda x, axes: pcast(x, axes, to="varying")
  pvary = getattr(lax, "pvary", None)
  return None if pvary is None else (lambda x, axes: pvary(x, axes))


def _defer_replicated(layer_fn, layer_out, example_params, stacked, carry, consts, cfg: _Config):
  """Plans one all-reduce after the loop for the cotangents of replicated leaves.

  A leaf that is not gathered (``gather_dim`` None) and does not vary over
  ``axis`` meets activations that do; autodiff then all-reduces its cotangent
  over ``axis`` in every layer's backward, and that small all-reduce holds the
  collective stream between the reduce-scatters and gathers of the loop. If
  the backward instead differentiates with respect to the leaf typed as
  varying, each device keeps its own partial cotangent, and one ``psum``
  after the loop gives the same sums.

  This holds when every use of the leaf meets values that vary over all of
  ``axis`` (else the partials would be replicated and the sum would count them
  more than once). Checked by types: re-traced with the leaf varying,
  ``layer_fn``'s outputs must vary over exactly the axes they did before.

  ``layer_out`` are the output types of ``layer_fn`` as traced for the
  forward pass. Returns ``(fn_b, vary, reduce)`` or None (leave the per-layer reductions):
  with ``remat_policy`` (its residuals are typed by the forward), under
  ``shard_map(check_vma=False)`` or where the types cannot be read.
  """
  pcast = _pcast_varying()
  axes = set(cfg.axes)
  if cfg.remat_policy is not None or pcast is None:
    return None
  leaves = jax.tree.leaves(example_params)
  stacked_leaves = jax.tree.leaves(stacked)
  types = [_varying(x) for x in leaves]
  checked = [_varying(x) for x, d in zip(stacked_leaves, cfg.dims) if d is not None]
  checked += [_varying(x) for x in jax.tree.leaves(carry)]
  if any(t is None for t in types + checked) or not any(axes <= t for t in checked):
    return None  # types unknown, or shard_map does not check them
  mask = [
    d is None and jnp.issubdtype(x.dtype, jnp.inexact) and not (axes & t)
    for x, d, t in zip(leaves, cfg.dims, types)
  ]
  if not any(mask):
    return None

  def vary(tree):
    flat, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(
      treedef, [pcast(x, cfg.axis) if m else x for x, m in zip(flat, mask)]
    )

  def reduce(tree):
    flat, treedef = jax.tree_util.tree_flatten(tree)
    picked = lax.psum([x for x, m in zip(flat, mask) if m], cfg.axis)
    it = iter(picked)
    return jax.tree_util.tree_unflatten(treedef, [next(it) if m else x for x, m in zip(flat, mask)])

  try:
    fn_b, consts_b = jax.closure_convert(layer_fn, jax.eval_shape(vary, example_params), carry)
    if len(consts_b) != len(consts) or any(a is not b for a, b in zip(consts_b, consts)):
      return None
    after = jax.eval_shape(lambda p, c: fn_b(vary(p), c, *consts), example_params, carry)
  except Exception:  # noqa: BLE001 - any failure keeps the per-layer reductions
    return None
  if [_varying(x) for x in jax.tree.leaves(layer_out)] != [
    _varying(x) for x in jax.tree.leaves(after)
  ]:
    return None
  return fn_b, vary, reduce


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
    x = leaves[i] if prev is None else _after(leaves[i], prev)
    out[i] = prev = op(x, dims[i])
  return jax.tree_util.tree_unflatten(treedef, out)


def _after(x, prev):
  """``x``, ordered after ``prev`` by an optimization barrier.

  Only between values that vary over the same mesh axes (the barrier would
  make ``x`` vary over ``prev``'s axes and fail shard_map's checks); otherwise
  ``x`` unchanged.
  """
  if _varying(x) != _varying(prev):
    return x
  x, _ = lax.optimization_barrier((x, prev))
  return x


def _varying(x):
  """The manual mesh axes ``x`` varies over (shard_map's type), or None if unknown."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
  return None if vma is None else frozenset(vma)


def _use_order(closed, n: int) -> list[int]:
  """Indices of the first ``n`` inputs of ``closed`` in the order it first uses them.

  Uses inside nested calls (jit, checkpoint, custom derivatives) count where
  the nested computation uses them.
  """
  never = (float("inf"),)

  def first_uses(jaxpr, invars) -> dict:
    pos = {v: never for v in invars}
    for k, e in enumerate(jaxpr.eqns):
      subs = [getattr(p, "jaxpr", p) for p in e.params.values()]
      subs = [j for j in subs if hasattr(j, "eqns") and len(j.invars) == len(e.invars)]
      for a, v in enumerate(e.invars):
        if hasattr(v, "val") or v not in pos or pos[v] != never:
          continue
        if subs:
          inner = first_uses(subs[0], [subs[0].invars[a]])[subs[0].invars[a]]
          pos[v] = (k, *inner) if inner != never else (k,)
        else:
          pos[v] = (k,)
    return pos

  invars = closed.jaxpr.invars[:n]
  pos = first_uses(closed.jaxpr, invars)
  return sorted(range(n), key=lambda i: (pos[invars[i]], i))


def _check_layer_out(out, carry):
  """``out``: the output shapes of one layer (``jax.make_jaxpr(..., return_shape=True)``)."""
  if not (isinstance(out, tuple) and len(out) == 2):
    raise TypeError(
      f"{_API}: layer_fn must return a pair (carry, y), got {jax.tree.structure(out)}"
    )
  new_c = out[0]
  want = jax.tree.map(lambda x: (tuple(np.shape(x)), jnp.dtype(x.dtype)), carry)
  got = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), new_c)
  if jax.tree.structure(want) != jax.tree.structure(got) or jax.tree.leaves(
    want, is_leaf=lambda x: isinstance(x, tuple)
  ) != jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, tuple)):
    raise TypeError(
      f"{_API}: layer_fn must return a carry with the structure, shapes and dtypes of "
      f"carry; expected {want}, got {got}"
    )


# ---------------------------------------------------------------------------
# remat_policy support: save the policy's residuals, never the gathered params.
# ---------------------------------------------------------------------------


def _vjp_residuals(f, full, c, consts, policy):
  """Runs ``f`` under ``jax.vjp`` of a checkpointed ``f`` and returns its residuals.

  Residual leaves that are the gathered parameters or the input carry
  themselves are replaced by None: the backward pass has them (it re-gathers
  the parameters and saves the carry anyway), so they are not saved twice.
  """
  out, vjp_fn = jax.vjp(jax.checkpoint(f, policy=policy), full, c, consts)
  leaves, _ = jax.tree_util.tree_flatten(vjp_fn)
  known = {id(x) for x in jax.tree.leaves((full, c))}
  kept = [None if id(x) in known else x for x in leaves]
  return out, kept


def _vjp_from_residuals(f, full, c, consts, policy, kept):
  """Rebuilds the vjp function of :func:`_vjp_residuals` from saved residuals."""
  _, vjp_fn = jax.vjp(jax.checkpoint(f, policy=policy), full, c, consts)
  leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
  known = {id(x) for x in jax.tree.leaves((full, c))}
  if len(leaves) != len(kept):
    raise ValueError(
      f"{_API}: remat_policy residuals changed structure between forward and backward"
    )
  merged = [x if id(x) in known else r for x, r in zip(leaves, kept)]
  return jax.tree_util.tree_unflatten(treedef, merged)
