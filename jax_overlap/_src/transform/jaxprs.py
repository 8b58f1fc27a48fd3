"""Reading jaxprs: the primitive families the transform looks for, value sizes and the
jaxprs nested in an equation's parameters. Shared by the planning, the evaluation and the
conversion to shard_map."""

from __future__ import annotations

import math

import numpy as np

GATHER = "all_gather"
SCATTER = "reduce_scatter"
COLLECTIVES = {
  "all_gather",
  "reduce_scatter",
  "psum",
  "psum_invariant",
  "ppermute",
  "all_to_all",
  "pmax",
  "pmin",
}
OPAQUE = ("scan", "while", "cond", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call")
MATMUL = {"dot_general", "conv_general_dilated", "ragged_dot_general"}


def is_pure(eqn) -> bool:
  """No effects other than naming a mesh axis (which every collective has)."""
  return all(type(eff).__name__ == "NamedAxisEffect" for eff in eqn.effects)


def is_var(x) -> bool:
  return not hasattr(x, "val")


def producers(eqns) -> dict:
  """Each value -> the index of the equation that makes it."""
  return {v: i for i, e in enumerate(eqns) for v in e.outvars}


def var_users(eqns) -> dict:
  """Each value -> the indices of the equations that read it, in order."""
  users: dict = {}
  for i, e in enumerate(eqns):
    for v in e.invars:
      if is_var(v):
        users.setdefault(v, []).append(i)
  return users


def ancestors_of(deps: list[list[int]], i: int) -> set[int]:
  """The equations ``i`` depends on, directly or not (``deps``: each one's producers)."""
  seen: set[int] = set()
  stack = [i]
  while stack:
    for d in deps[stack.pop()]:
      if d not in seen:
        seen.add(d)
        stack.append(d)
  return seen


def gathered_dim_role(dot, gathered, dim: int) -> str | None:
  """What dimension ``dim`` of ``gathered`` is in ``dot``: "batch", "contracting" or
  "free"; None when ``dot`` is not a ``dot_general`` reading ``gathered`` as exactly one
  operand."""
  if dot.primitive.name != "dot_general" or (dot.invars[0] is gathered) == (
    dot.invars[1] is gathered
  ):
    return None
  (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
  lhs = dot.invars[0] is gathered
  if dim in (lb if lhs else rb):
    return "batch"
  return "contracting" if dim in (lc if lhs else rc) else "free"


def nbytes(aval) -> int:
  try:
    return int(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)
  except (TypeError, AttributeError):
    return 0


# Operations after which a value counts as computed in the step (an activation).
COMPUTE = MATMUL | set(OPAQUE)
HEAVY = COMPUTE | COLLECTIVES


def subjaxprs(eqn):
  from jax.extend import core

  for p in eqn.params.values():
    for q in p if isinstance(p, (tuple, list)) else (p,):
      sub = q.jaxpr if isinstance(q, core.ClosedJaxpr) else q
      if isinstance(sub, core.Jaxpr):
        yield sub


def contains_collectives(eqn) -> bool:
  """Whether a sub-jaxpr of ``eqn`` (recursively) holds a collective or a shard_map."""
  return any(
    e.primitive.name in COLLECTIVES or e.primitive.name == "shard_map" or contains_collectives(e)
    for sub in subjaxprs(eqn)
    for e in sub.eqns
  )


def scan_sizes(eqn) -> tuple[int, int]:
  """``(constants, carried values)`` of a ``lax.scan`` equation: its first inputs, then the
  loop's carry, then the scanned arrays. jax up to 0.10 names the counts in the params
  (``num_consts``, ``num_carry``); later versions group the inputs in a flat tree
  (``ft_in``)."""
  p = eqn.params
  if "num_consts" in p:
    return int(p["num_consts"]), int(p["num_carry"])
  tree = p.get("ft_in")
  try:
    # jax's FlatTree: the inputs' grouping, applied to the positions.
    consts, carry, xs = (list(g) for g in tree.update(list(range(len(eqn.invars)))).unpack())
  except (AttributeError, TypeError, ValueError):
    consts = carry = xs = None
  if consts is not None and len(consts) + len(carry) + len(xs) == len(eqn.invars):
    return len(consts), len(carry)
  raise NotImplementedError(
    "jax_overlap: this jax's lax.scan equation does not say which inputs are constants and "
    f"which are carried (params {sorted(p)}); jax_overlap reads num_consts/num_carry or ft_in"
  )
