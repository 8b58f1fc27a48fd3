"""The step's arguments as :func:`jax_overlap.overlap` reads them: which are static (chosen
by ``jax.jit``'s ``static_argnums``/``static_argnames`` or ``overlap``'s), whether the others
are arrays laid out over their mesh, the platform they name, the signature a built step is
kept under, and the abstract values a GSPMD step is converted with."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

__all__ = ["Statics", "abstract_leaves", "check_args", "devices", "platform", "signature"]


@dataclasses.dataclass(frozen=True)
class Statics:
  """The step's static arguments (``static_argnums`` / ``static_argnames`` of a jitted
  ``fn``, or given to ``overlap``): hashable values that choose the program, not inputs
  of it. The traced program takes the other arguments' leaves."""

  argnums: tuple[int, ...] = ()
  argnames: tuple[str, ...] = ()

  @classmethod
  def of(cls, jitted) -> Statics:
    info = getattr(jitted, "_jit_info", None)
    return cls(
      tuple(getattr(info, "static_argnums", ()) or ()),
      tuple(getattr(info, "static_argnames", ()) or ()),
    )

  def positions(self, n: int) -> frozenset:
    return frozenset(i % n for i in self.argnums if -n <= i < n)

  def dynamic(self, args, kwargs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` without the static ones: what the traced program takes."""
    static = self.positions(len(args))
    return (
      tuple(a for i, a in enumerate(args) if i not in static),
      {k: v for k, v in kwargs.items() if k not in self.argnames},
    )

  def jit_kwargs(self) -> dict:
    """``jax.jit``'s keywords that keep these arguments static."""
    out: dict = {}
    if self.argnums:
      out["static_argnums"] = self.argnums
    if self.argnames:
      out["static_argnames"] = self.argnames
    return out


def donation(traced, args, kwargs, statics: Statics) -> dict:
  """``jax.jit``'s donation keywords that donate what the traced step donates, for a call
  with ``args`` and ``kwargs``: the positions and names of the arguments all of whose
  leaves it donates.

  ``traced.donate_argnums`` numbers the *leaves* of the dynamic arguments, not the
  arguments: passed on as ``donate_argnums`` it would donate the arguments at those
  positions (a batch after donated parameters). ``traced.args_info`` says per leaf."""
  info = getattr(traced, "args_info", None)
  if info is None:
    return {}
  info_args, info_kwargs = info

  def donated(tree) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(getattr(a, "donated", False) for a in leaves)

  static = statics.positions(len(args))
  positions = [i for i in range(len(args)) if i not in static]
  out: dict = {}
  nums = tuple(i for i, a in zip(positions, info_args) if donated(a))
  names = tuple(k for k, a in info_kwargs.items() if donated(a))
  if nums:
    out["donate_argnums"] = nums
  if names:
    out["donate_argnames"] = names
  return out


def check_args(args, kwargs, mesh) -> None:
  """Checks the step's (dynamic) arguments: arrays, laid out over their mesh's axes."""
  flat = [
    ("args" + jax.tree_util.keystr(p), leaf)
    for p, leaf in jax.tree_util.tree_flatten_with_path(tuple(args))[0]
  ]
  flat += [
    ("kwargs" + jax.tree_util.keystr(p), leaf)
    for p, leaf in jax.tree_util.tree_flatten_with_path(dict(kwargs))[0]
  ]
  for where, leaf in flat:
    if isinstance(
      leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, int, float, bool, complex)
    ):
      pass
    elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      pass
    else:
      raise TypeError(
        f"overlap: argument {where} is a {type(leaf).__name__}, not an array; pass arrays "
        "(or jax.ShapeDtypeStruct), close over other values, or mark the argument static "
        "(static_argnums / static_argnames of jax.jit or of overlap)"
      )
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      m = sharding.mesh
      for dim, entry in enumerate(sharding.spec):
        if entry is None:
          continue
        axes = entry if isinstance(entry, tuple) else (entry,)
        for a in axes:
          if a not in m.axis_names:
            raise ValueError(
              f"overlap: argument {where} is sharded over mesh axis {a!r}, which the mesh "
              f"{dict(m.shape)} does not have"
            )
        size = math.prod(m.shape[a] for a in axes)
        if leaf.shape[dim] % size:
          raise ValueError(
            f"overlap: argument {where} has dimension {dim} of size {leaf.shape[dim]}, not "
            f"divisible by the mesh axes {axes} ({size} devices)"
          )
  if mesh is not None:
    for where, leaf in flat:
      sharding = getattr(leaf, "sharding", None)
      if isinstance(sharding, jax.sharding.NamedSharding):
        missing = [a for a in sharding.mesh.axis_names if a not in mesh.axis_names]
        if missing:
          raise ValueError(
            f"overlap: argument {where} uses mesh axes {missing} that "
            f"mesh= {dict(mesh.shape)} does not have"
          )


def abstract_leaves(leaves: list, invars, in_shardings) -> list:
  """The arguments as the traced program takes them (shape, dtype and weak type from its
  inputs: a Python scalar is one too), each with its own layout or, for one without
  (host arrays, scalars), the layout the step's jit gives it (``in_shardings``)."""
  named = jax.sharding.NamedSharding
  jit_sharding = list(in_shardings or ())
  if len(jit_sharding) != len(leaves):
    jit_sharding = [None] * len(leaves)
  out = []
  for x, v, s in zip(leaves, invars, jit_sharding):
    own = getattr(x, "sharding", None)
    sharding = own if isinstance(own, named) or not isinstance(s, named) else s
    out.append(
      jax.ShapeDtypeStruct(
        v.aval.shape,
        v.aval.dtype,
        weak_type=bool(getattr(v.aval, "weak_type", False)),
        sharding=sharding,
      )
    )
  return out


def platform(args, kwargs, mesh) -> str:
  """The platform the step compiles for, read from the arguments' shardings."""
  for x in jax.tree.leaves((args, kwargs)):
    if isinstance(x, jax.core.Tracer):
      # Traced under an outer jit: the abstract mesh still names the platform.
      mesh_ = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
      platform = getattr(getattr(mesh_, "abstract_device", None), "platform", None)
      if platform:
        return str(platform)
      continue
    devices = getattr(getattr(x, "sharding", None), "_device_assignment", None)
    if devices:
      return str(devices[0].platform)
  if mesh is not None and getattr(mesh, "devices", None) is not None and mesh.devices.size:
    return str(mesh.devices.flat[0].platform)
  return jax.default_backend()


def signature(args, kwargs):
  leaves, tree = jax.tree.flatten((args, kwargs))
  sig = []
  for x in leaves:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      sig.append((tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))))
    else:
      sig.append(("static", repr(x)))
  return tree, tuple(sig)


def devices(args, kwargs, mesh) -> list:
  """The devices the step runs on: those of the arguments' layouts (every process's), or
  of ``mesh``; empty for arguments without devices (``jax.ShapeDtypeStruct`` without
  sharding, tracers)."""
  found: dict[int, object] = {}
  for x in jax.tree.leaves((args, kwargs)):
    if isinstance(x, jax.core.Tracer):
      continue
    sharding = getattr(x, "sharding", None)
    for d in getattr(sharding, "device_set", ()) or ():
      found.setdefault(d.id, d)
  if not found and mesh is not None and getattr(mesh, "devices", None) is not None:
    for d in np.asarray(mesh.devices).flat:
      found.setdefault(d.id, d)
  return [found[i] for i in sorted(found)]
