"""A user's program re-targeted onto a GPU topology's compile-only mesh.

The arguments' shardings are moved onto the target mesh with the same axis names
(:func:`retarget_arg`, :func:`target_mesh_like`), and meshes captured inside the
function (``shard_map(mesh=...)``, sharding constraints, nested ``jit`` shardings) are
swapped in its jaxpr (:func:`retargeted`), so that :mod:`.compiler` can lower it for
the target.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jax_overlap._src import targets as targets_lib

__all__ = [
  "context_mesh",
  "has_explicit_axes",
  "meshes_in",
  "placed_on",
  "retarget_arg",
  "retargeted",
  "target_mesh_like",
  "undivided_dims",
]


def has_explicit_axes(mesh) -> bool:
  """Whether ``mesh`` (a Mesh or AbstractMesh, or None) has an Explicit axis (sharding in
  types)."""
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ()) or ())


def context_mesh() -> Mesh | None:
  """The mesh the caller's code runs under (``with jax.set_mesh(mesh):``), if any."""
  mesh = jax.sharding.get_mesh() if hasattr(jax.sharding, "get_mesh") else None
  return mesh if isinstance(mesh, Mesh) and not mesh.empty else None


def meshes_in(tree) -> list[Mesh]:
  found = []
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
      found.append(sharding.mesh)
  return found


def target_mesh_like(source: Mesh | Mapping[str, int] | None, target) -> Mesh:
  """The target's compile-only mesh with ``source``'s axis names.

  Axis sizes are kept when the device counts agree. Otherwise the first axis
  whose size can absorb the difference is scaled (a 4x2 fsdp x tensor mesh
  becomes 8x2 on 16 GPUs).

  Raises:
    ValueError: when no axis can absorb the difference.
  """
  topo = targets_lib.get(target)
  if source is None:
    return targets_lib.compile_only_mesh(topo, ("fsdp",))
  shape = dict(source.shape) if isinstance(source, Mesh) else dict(source)
  n = math.prod(shape.values())
  if n == topo.num_devices:
    return _typed_like(targets_lib.compile_only_mesh(topo, shape), source)
  for axis, size in shape.items():
    rest = n // size
    if topo.num_devices % rest == 0:
      new = dict(shape)
      new[axis] = topo.num_devices // rest
      return _typed_like(targets_lib.compile_only_mesh(topo, new), source)
  raise ValueError(
    f"cannot map mesh {shape} ({n} devices) onto {topo.name} ({topo.num_devices} devices); "
    "pass mesh= with axis sizes that multiply to the target's device count"
  )


def _typed_like(mesh: Mesh, source) -> Mesh:
  """``mesh`` with ``source``'s axis types (Explicit axes stay explicit on the target)."""
  types = getattr(source, "axis_types", None)
  if not isinstance(source, Mesh) or types is None or types == mesh.axis_types:
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=types)


def _retarget_sharding(s, mesh: Mesh):
  if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh):
    missing = [a for a in _spec_axes(s.spec) if a not in mesh.axis_names]
    if missing:
      raise ValueError(
        f"the sharding {s.spec} names mesh axes {missing} that the target mesh "
        f"{dict(mesh.shape)} lacks; valid axis names: {', '.join(mesh.axis_names)}"
      )
    return NamedSharding(mesh, s.spec, memory_kind=s.memory_kind)
  return s


def undivided_dims(shape, spec, sizes: Mapping[str, int]) -> list[tuple[int, tuple, int]]:
  """``(dimension, mesh axes, devices)`` for each dimension of ``shape`` that ``spec`` (a
  ``PartitionSpec`` or None) splits over axes of ``sizes`` whose device count does not divide
  it; axes not in ``sizes`` are left out of the count."""
  out = []
  for d, entry in enumerate(tuple(spec or ())[: len(shape)]):
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    n = math.prod(sizes[a] for a in axes if a in sizes)
    if n > 1 and shape[d] % n:
      out.append((d, axes, n))
  return out


def _check_divisible(shape, sharding: NamedSharding, source) -> None:
  """An argument's dimensions split over the target mesh's axes (whose sizes may differ
  from its own mesh's, scaled to the target's device count) divide by them."""
  sizes = dict(sharding.mesh.shape)
  for d, axes, n in undivided_dims(shape, sharding.spec, sizes)[:1]:
    was = (
      f" (the arguments' mesh {dict(source.shape)} scaled to the target)"
      if (isinstance(source, Mesh) and dict(source.shape) != sizes)
      else ""
    )
    raise ValueError(
      f"an argument of shape {tuple(shape)} is split along dimension {d} over {axes} of "
      f"the target mesh {sizes}{was}: {shape[d]} does not divide by {n}; choose a target "
      "whose device count divides the argument's dimensions, or pass mesh= with sizes "
      "that do"
    )


def _spec_axes(spec) -> list[str]:
  out = []
  for entry in spec:
    if entry is None:
      continue
    if isinstance(entry, (tuple, list)):
      out.extend(e for e in entry if e is not None)
    else:
      out.append(entry)
  return out


def retarget_arg(x, mesh: Mesh | None):
  if (
    isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or hasattr(x, "shape") and hasattr(x, "dtype")
  ):
    sharding = getattr(x, "sharding", None)
    if mesh is not None:
      source = getattr(sharding, "mesh", None)
      sharding = _retarget_sharding(sharding, mesh) if sharding is not None else None
      if sharding is not None and not isinstance(sharding, NamedSharding):
        sharding = None
      if sharding is not None:
        _check_divisible(np.shape(x), sharding, source)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
  return x


def placed_on(tree, mesh: Mesh):
  """``tree`` (retargeted arguments) placed on ``mesh`` where none of its arrays is.

  A program whose arguments carry no sharding (plain arrays, ``ShapeDtypeStruct`` without
  one) is compiled by ``jax.jit`` for the default device, the host's CPU, whatever the
  target. Where no array of ``tree`` has a :class:`NamedSharding`, each is given a replicated
  one on ``mesh`` (the program then runs whole on every device of the target, as it would
  on one); otherwise ``tree`` is returned unchanged (the arrays without a sharding are left
  for XLA to place beside the others, as ``jax.jit`` leaves them).
  """
  leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.ShapeDtypeStruct)]
  if not leaves or any(isinstance(x.sharding, NamedSharding) for x in leaves):
    return tree
  replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(
    lambda x: (
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
      if isinstance(x, jax.ShapeDtypeStruct)
      else x
    ),
    tree,
  )


def _retarget_params(value, mesh: Mesh):
  """Swaps concrete meshes (and shardings on them) inside a jaxpr parameter."""
  from jax.extend import core

  if isinstance(value, Mesh):
    if value == mesh:
      return value
    if set(value.axis_names) - set(mesh.axis_names):
      raise ValueError(
        f"the program uses a mesh with axes {value.axis_names} but the target mesh has "
        f"{mesh.axis_names}"
      )
    return mesh
  if isinstance(value, NamedSharding):
    return _retarget_sharding(value, mesh)
  if isinstance(value, core.ClosedJaxpr):
    return core.ClosedJaxpr(_retarget_jaxpr(value.jaxpr, mesh), value.consts)
  if isinstance(value, core.Jaxpr):
    return _retarget_jaxpr(value, mesh)
  if isinstance(value, tuple):
    items = [_retarget_params(v, mesh) for v in value]
    if all(a is b for a, b in zip(items, value)):
      return value
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
  if isinstance(value, list):
    return [_retarget_params(v, mesh) for v in value]
  return value


def _retarget_jaxpr(jaxpr, mesh: Mesh):
  new_eqns = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "shard_map":
      _check_same_sizes(eqn.params.get("mesh"), mesh)
    params = {k: _retarget_params(v, mesh) for k, v in eqn.params.items()}
    new_eqns.append(eqn.replace(params=params))
  return jaxpr.replace(eqns=new_eqns)


def _check_same_sizes(source, mesh: Mesh) -> None:
  """A ``shard_map`` body is traced for its mesh's per-device shapes: it runs on a target
  mesh only with the same axis sizes."""
  shape = dict(getattr(source, "shape", {}) or {})
  if not shape or shape == dict(mesh.shape):
    return
  raise ValueError(
    f"the program's shard_map runs on mesh {shape} ({math.prod(shape.values())} devices), "
    f"but the target's mesh is {dict(mesh.shape)} ({mesh.devices.size} devices): a "
    "shard_map body is traced for its own mesh's per-device shapes, so it is analysed "
    "for a target with the same axis sizes; build the step on the target's mesh "
    "(jax_overlap.targets.compile_only_mesh(target, {axis: size, ...})) or choose a "
    "target with as many GPUs"
  )


def _has_concrete_mesh(jaxpr) -> bool:
  from jax.extend import core

  def visit(v) -> bool:
    if isinstance(v, Mesh):
      return True
    if isinstance(v, NamedSharding):
      return isinstance(v.mesh, Mesh)
    if isinstance(v, core.ClosedJaxpr):
      return _has_concrete_mesh(v.jaxpr)
    if isinstance(v, core.Jaxpr):
      return _has_concrete_mesh(v)
    if isinstance(v, (tuple, list)):
      return any(visit(x) for x in v)
    return False

  return any(visit(v) for eqn in jaxpr.eqns for v in eqn.params.values())


def _unwrap(fn):
  return getattr(fn, "__wrapped__", None) if hasattr(fn, "lower") else None


def _is_input(x) -> bool:
  return (hasattr(x, "shape") and hasattr(x, "dtype")) or isinstance(x, (int, float, complex))


def of_inputs(fn: Callable, args, kwargs) -> tuple[Callable, list[int]]:
  """(``fn(*args, **kwargs)`` as a function of the program's inputs, their positions among
  the arguments' leaves). The inputs are the arrays and numbers; the other leaves (a
  static argument's parts, such as Equinox's non-array leaves) are passed as they are."""
  leaves, tree = jax.tree.flatten((args, kwargs))
  inputs = [i for i, x in enumerate(leaves) if _is_input(x)]

  def whole(*values):
    full = list(leaves)
    for i, v in zip(inputs, values):
      full[i] = v
    a, kw = jax.tree.unflatten(tree, full)
    return fn(*a, **kw)

  return whole, inputs


def retargeted(fn: Callable, tmesh: Mesh, args, kwargs):
  """``fn`` with every captured mesh swapped for ``tmesh``, to trace or lower (``.trace``,
  ``.lower``) on arguments shaped like ``args`` and ``kwargs``.

  The function is traced once on its original arguments (through a wrapper, so
  that a jitted ``fn``'s own in/out shardings appear in the jaxpr as well), and
  the concrete meshes in the jaxpr are replaced.
  """
  from jax.extend import core

  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  whole, inputs = of_inputs(jitted, args, kwargs)
  leaves = jax.tree.leaves((args, kwargs))
  abstract = [
    jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
    if hasattr(x, "shape") and hasattr(x, "dtype")
    else x
    for x in (leaves[i] for i in inputs)
  ]
  # Traced inside a jit of its own: a step that inlines itself under a trace (a shard_map
  # at the top of the program) is one jit call here, whose body is compiled as retargeted
  # rather than traced again (which would meet the source mesh in its values' types).
  inner = jax.jit(whole)
  try:
    traced = jax.jit(lambda *values: inner(*values)).trace(*abstract)
    closed, out_shape = traced.jaxpr, traced.out_info
  except Exception:  # noqa: BLE001 - the compile below reports the real error
    return jitted
  if not _has_concrete_mesh(closed.jaxpr):
    return jitted
  run = core.jaxpr_as_fun(core.ClosedJaxpr(_retarget_jaxpr(closed.jaxpr, tmesh), closed.consts))
  out_tree = jax.tree.structure(out_shape)

  return _Inputs(jax.jit(lambda *values: jax.tree.unflatten(out_tree, run(*values))), inputs)


class _Inputs:
  """``jitted`` traced or lowered on the program's inputs among a call's arguments."""

  def __init__(self, jitted, inputs: list[int]):
    self._jitted, self._inputs = jitted, inputs

  def _values(self, args, kwargs) -> list:
    values = jax.tree.leaves((args, kwargs))
    return [values[i] for i in self._inputs]

  def trace(self, *args, **kwargs):
    return self._jitted.trace(*self._values(args, kwargs))

  def lower(self, *args, **kwargs):
    return self._jitted.lower(*self._values(args, kwargs))
