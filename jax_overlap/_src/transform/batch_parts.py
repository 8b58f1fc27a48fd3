"""A loop body evaluated in parts of its batch (halves or quarters), so that one part's
collectives travel while another part computes.

In a tensor-parallel layer every collective sits on the path from the layer's input to its
output: the activations' all-gather feeds the first matmul, the output projection's
reduce-scatter feeds the residual, and one stream of work can only hide a collective under
the matmul next to it. Split along the batch, the parts are independent chains of the same
work; a collective of one part has another part's compute beside it (the dual-stream
schedule of Domino and of DeepSeek-V3's training, with two parts).

:func:`split_dims` finds a loop body's batch (the leading size its activation collectives'
operands share with a carried value); :func:`run_scan` runs the loop with each iteration
evaluated by :mod:`.parts`: once per part wherever an equation allows it (elementwise work,
matmuls whose split dimension is free or a batch dimension, reductions and collectives along
other dimensions, reshapes and transposes that keep the dimension whole, nested jaxprs), a
matmul or sum over the batch as the parts' partial results added, anything else on the parts
put together. The program computes what it computed before, up to the order of the
additions a split reduction makes.

Each collective is issued after the one of its kind before it (one part's, then the
next's): one after the other on the communication stream. Without that order XLA's
combiner joins the parts' collectives back into one (and its dot merger their matmuls: the
variants that split turn it off). No reader of a collective's result waits for the order
(:func:`~jax_overlap._src.fsdp.pipeline.after`). No kernel of an iteration reads a value
the parts share (the loop holds each part of a split value, a constant with the batch such
as an attention mask included, as an array of its own, and each part reads small shared
values through its own copy): XLA's sibling fusion would join the parts' kernels over it
(the parts' RMSNorms, their softmax reductions over the mask), and every part would wait for
the slowest. The parts run in step:
XLA's scheduler, given the second of two halves a step behind the first (its work between
two collectives after the first half's), kept fewer collectives beside compute (MaxText's
tensor-parallel step, 2 layers, h100x8: 25.18 ms against 24.05 ms). More parts leave less of each
collective with nothing beside it, at more, smaller collectives and matmuls: on the
8-layer step 2 parts 82.37 ms, 4 parts 81.37 ms, 8 parts 93.42 ms.
"""

from __future__ import annotations

from collections.abc import Callable

from jax_overlap._src.transform import scan_pipeline
from jax_overlap._src.transform.jaxprs import scan_sizes
from jax_overlap._src.transform.parts import Context, Parts, cut, run, whole


def split_dims(eqn, n: int = 2) -> tuple | None:
  """Where lax.scan ``eqn``'s body is split: for each of its inputs (constants, carries, then
  one iteration's slices), the dimension its batch is cut along into ``n`` parts (0, the
  batch first as JAX code writes it), or None for a whole input. The batch is the leading
  size of a carried value (one ``n`` divides) that the leading dimension of an activation
  all-gather's or reduce-scatter's operand has, where that collective runs along another
  dimension (a tensor-parallel layer's). None where no such collective is in the body (a
  layer whose collectives are its parameters' gathers gains nothing)."""
  if eqn.primitive.name != "scan":
    return None
  body, _ = scan_pipeline.loop_body(eqn)
  n_consts, n_carry = scan_sizes(eqn)
  sizes = {
    v.aval.shape[0]
    for v in body.invars[n_consts : n_consts + n_carry]
    if getattr(v.aval, "ndim", 0) >= 2 and v.aval.shape[0] % n == 0
  }
  batch = None
  for e in body.eqns:
    dim = {"all_gather": "all_gather_dimension", "reduce_scatter": "scatter_dimension"}.get(
      e.primitive.name
    )
    x = e.invars[0] if dim else None
    if dim and getattr(x.aval, "ndim", 0) >= 2 and e.params[dim] != 0:
      if x.aval.shape[0] in sizes:
        batch = x.aval.shape[0]
        break
  if batch is None:
    return None
  return tuple(
    0 if getattr(v.aval, "ndim", 0) >= 2 and v.aval.shape[0] == batch else None for v in body.invars
  )


def run_scan(eqn, invals: list, dims: tuple, bind: Callable, n: int) -> tuple[list, Context]:
  """Scan ``eqn`` on ``invals``, each iteration's body evaluated in ``n`` parts along
  ``dims`` (:func:`split_dims`): its outputs, and the last evaluation's :class:`Context`.

  The loop holds a constant, a carry, a sliced input and a stacked output that are split
  as their parts, one array each (cut or put together outside the loop): no kernel of an
  iteration reads all parts, so XLA's sibling fusion finds no common operand to join the
  parts' kernels over (:class:`~.parts.Context`)."""
  n_consts, n_carry = scan_sizes(eqn)
  const_dims = dims[:n_consts]
  carry_dims, x_dims = dims[n_consts : n_consts + n_carry], dims[n_consts + n_carry :]
  traced: list[Context] = []
  y_dims: list = []

  def pack(consts, carry, xs):
    # A constant with the batch (an attention mask made before the loop) is cut once,
    # before the loop.
    consts = [c if d is None else cut(c, d, n).parts for c, d in zip(consts, const_dims)]
    carry = [c if d is None else _parts_along(c, d, n) for c, d in zip(carry, carry_dims)]
    # A sliced input's parts: cut along its dimension after the loop's.
    xs = [x if d is None else cut(x, d + 1, n).parts for x, d in zip(xs, x_dims)]
    return consts, carry, xs

  def unpack(carry, ys):
    carry = [c if d is None else Parts(tuple(c), d).whole() for c, d in zip(carry, carry_dims)]
    ys = [y if d is None else Parts(tuple(y), d + 1).whole() for y, d in zip(ys, y_dims)]
    return carry, ys

  def evaluate(jaxpr, consts, args):
    args = [a if d is None else Parts(tuple(a), d) for a, d in zip(args, dims)]
    # The parts' keys: a carry's or a sliced input's parts (a constant's, where none is).
    keys = [a.parts for a in args[n_consts:] + args[:n_consts] if isinstance(a, Parts)]
    ctx = Context(bind, keys=keys[0])
    traced[:] = [ctx]
    outs = run(jaxpr, consts, args, ctx)
    carry = [c if d is None else _parts_along(c, d, n) for c, d in zip(outs[:n_carry], carry_dims)]
    ys = outs[n_carry:]
    y_dims[:] = [y.dim if isinstance(y, Parts) else None for y in ys]
    return [*carry, *(y.parts if isinstance(y, Parts) else y for y in ys)]

  return scan_pipeline.rescan(eqn, invals, evaluate, pack, unpack), traced[0]


def _parts_along(x, dim: int, n: int) -> tuple:
  """``x`` (a value or :class:`~.parts.Parts`) as ``n`` parts along ``dim``."""
  if isinstance(x, Parts) and x.dim == dim:
    return x.parts
  return cut(whole(x), dim, n).parts
