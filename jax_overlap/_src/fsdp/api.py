"""``scan_layers``: checks its arguments and runs the pipelined loop, under its own
``shard_map`` when given a mesh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jax_overlap._src.compile import retarget
from jax_overlap._src.fsdp.checks import (
  _API,
  AxisName,
  PyTree,
  _axis_tuple,
  _bound_axis_size,
  _check_leaves,
  _Config,
  _keystr,
  _normalize_gather_dims,
)
from jax_overlap._src.fsdp.layers import (
  _scan_layers_local,
)

__all__ = ["scan_layers"]


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
    ...   return h, jnp.mean(h, axis=-1)  # one value per example
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
  default_carry = carry_spec is None
  if default_carry:
    carry_spec = jax.tree.map(lambda _: P(cfg.axis), carry)
  _check_carry_divides(carry, carry_spec, mesh, default_carry)
  if ys_spec is None:
    ys_spec = P(None, cfg.axis)
    _check_default_ys(layer_fn, stacked, carry, cfg)
  if retarget.has_explicit_axes(mesh):
    # A mesh with Explicit axes (jax.make_mesh's default) takes arrays already laid out
    # as shard_map's in_specs say: put them so.
    stacked, carry = _laid_out(mesh, (stacked, carry), (param_specs, carry_spec))

  def body(p, c):
    return _scan_layers_local(layer_fn, p, c, cfg)

  fn = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(param_specs, carry_spec),
    out_specs=(carry_spec, ys_spec),
    check_vma=False,
  )
  return fn(stacked, carry)


def _check_carry_divides(carry, carry_spec, mesh, default: bool) -> None:
  """Refuses a carry whose split dimensions do not divide by their mesh axes."""
  from jax.sharding import PartitionSpec as P

  is_spec = lambda x: isinstance(x, P) or x is None  # noqa: E731
  try:
    full = jax.tree.map(
      lambda spec, sub: jax.tree.map(lambda _: spec, sub), carry_spec, carry, is_leaf=is_spec
    )
    specs = jax.tree.leaves(full, is_leaf=is_spec)
  except (ValueError, TypeError):
    return  # carry_spec is not a prefix of carry: shard_map names that
  leaves = jax.tree_util.tree_flatten_with_path(carry)[0]
  if len(specs) != len(leaves):
    return
  bad = []
  for (path, leaf), spec in zip(leaves, specs):
    shape = np.shape(leaf)
    for d, axes, size in retarget.undivided_dims(shape, spec, dict(mesh.shape)):
      axes = tuple(a for a in axes if a in mesh.shape)
      bad.append(
        f"carry{jax.tree_util.keystr(path)} dimension {d} has size {shape[d]}, not "
        f"divisible by {axes if len(axes) > 1 else axes[0]!r} ({size} devices)"
      )
  if bad:
    hint = (
      "the carry is split over the axis along its first (batch) dimension by default: "
      "make the batch a multiple of the axis size, or pass carry_spec (e.g. P() to keep "
      "it whole on every device)"
      if default
      else "make the dimension a multiple of the axis size, or split it over fewer devices "
      "in carry_spec"
    )
    raise ValueError(f"{_API}: {'; '.join(bad)}; {hint}")


def _laid_out(mesh, trees, specs):
  """``trees`` resharded to ``specs`` (PartitionSpecs, or pytree prefixes of them)."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  def put(spec, subtree):
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda x: jax.sharding.reshard(x, sharding), subtree)

  return jax.tree.map(put, specs, trees, is_leaf=lambda x: isinstance(x, P))


def _check_default_ys(layer_fn, stacked, carry, cfg: _Config) -> None:
  """The default ``ys_spec`` stacks per-example outputs (a batch dimension split like the
  carry's): a per-layer output without one (a scalar such as a mean over this device's
  rows) needs a ``ys_spec`` of its own, which the error says."""
  one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), stacked)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), carry)
  try:
    _, ys = jax.eval_shape(layer_fn, one, shapes)
  except Exception:  # noqa: BLE001 - e.g. collectives over the axis: shard_map will say
    return
  flat = jax.tree_util.tree_flatten_with_path(ys)[0]
  scalars = [
    f"y{_keystr(path) if path else ''}: shape {tuple(y.shape)}" for path, y in flat if not y.shape
  ]
  if scalars:
    raise ValueError(
      f"{_API}: with mesh=, the per-layer outputs are stacked as P(None, {cfg.axis!r}) by "
      f"default (a batch dimension split like the carry's), but layer_fn returns "
      f"{'; '.join(scalars)} per layer; return per-example values (e.g. a mean over the "
      f"last dimension only), or pass ys_spec (P() keeps one device's value: reduce it "
      f"over {cfg.axis!r} in layer_fn first, e.g. with lax.pmean)"
    )
