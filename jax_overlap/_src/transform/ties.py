"""Orderings the evaluator adds to a rewritten body: optimization barriers that tie a value
after others (a gather after the compute the cost model issues it behind, a loop after the
reduce-scatters planned before it)."""

from __future__ import annotations

from jax import lax

from jax_overlap._src.fsdp.pipeline import after, varying
from jax_overlap._src.transform.jaxprs import is_var, scan_sizes


def after_all(x, prevs: list):
  """``x``, ordered after every value in ``prevs`` (see
  :func:`~jax_overlap._src.fsdp.pipeline.after`)."""
  for p in prevs:
    x = after(x, p)
  return x


def tied(x, prev_eqn, read):
  """``x`` ordered after an output of ``prev_eqn`` that varies over the same mesh axes (the
  issue point of a gather placed by time); ``x`` unchanged if none does, or where the body's
  values carry no mesh axes (a GSPMD step's shard_map form, built without shard_map's type
  checks: there the ties gave the selection and the built step different schedules)."""
  axes = varying(x)
  if not axes:
    return x
  for v in prev_eqn.outvars:
    if is_var(v) and axes is not None and varying(read(v)) == axes:
      return after(x, read(v))
  return x


def tied_through(x, prev_eqn, read):
  """:func:`tied`, the output of ``prev_eqn`` passed through the same barrier: ``(x, var,
  value)``, the output's later readers to read ``value`` for ``var``; ``(x, None, None)``
  where no output varies as ``x`` does.

  A barrier operand that nothing reads after the barrier is dropped by XLA's algebraic
  simplifier once the barrier is its only reader (a matmul whose reshape XLA folds into a
  new matmul, as a projection split into heads): the tie goes with it and XLA issues the
  gather from the start. Read through the barrier, the operand stays, and so does the tie.
  """
  axes = varying(x)
  if not axes:
    return x, None, None
  for v in prev_eqn.outvars:
    if is_var(v) and axes is not None and varying(read(v)) == axes:
      x, y = lax.optimization_barrier((x, read(v)))
      return x, v, y
  return x, None, None


def tied_before(i: int, eqn, invals: list, plan, read, jaxpr) -> list:
  """A loop's inputs, one of them tied after the reduce-scatters the plan finishes before
  the loop (``BodyPlan.scatters_before_loop``): the first input that varies over the same
  mesh axes as their results."""
  rs = plan.scatters_before_loop.get(i, ())
  if not rs:
    return invals
  outs = [read(jaxpr.eqns[r].outvars[0]) for r in rs]
  axes = varying(outs[0])
  # A scan's carries first (the first iteration reads them; an unused input's tie would be
  # removed with it), then its other inputs.
  n_consts, n_carry = scan_sizes(eqn) if eqn.primitive.name == "scan" else (0, len(invals))
  carries = range(n_consts, n_consts + n_carry)
  for k in [*carries, *(k for k in range(len(invals)) if k not in carries)]:
    if is_var(eqn.invars[k]) and axes is not None and varying(invals[k]) == axes:
      return [*invals[:k], after_all(invals[k], outs), *invals[k + 1 :]]
  return invals
