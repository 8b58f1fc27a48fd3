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
(:func:`~jax_overlap._src.fsdp.pipeline.after`). The parts run in step: XLA's scheduler,
given the second of two halves a step behind the first (its work between two collectives
after the first half's), kept fewer collectives beside compute (MaxText's tensor-parallel
step, 2 layers, h100x8: 25.18 ms against 24.05 ms). More parts leave less of each
collective with nothing beside it, at more, smaller collectives and matmuls: on the
8-layer step 2 parts 82.37 ms, 4 parts 81.37 ms, 8 parts 93.42 ms.
"""

from __future__ import annotations

from collections.abc import Callable

from jax_overlap._src.transform import scan_pipeline
from jax_overlap._src.transform.jaxprs import scan_sizes
from jax_overlap._src.transform.parts import Context, cut, run, whole


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
  ``dims`` (:func:`split_dims`): its outputs, and the last evaluation's :class:`Context`."""
  traced: list[Context] = []

  def evaluate(jaxpr, consts, args):
    args = [a if d is None else cut(a, d, n) for a, d in zip(args, dims)]
    traced[:] = [Context(bind)]
    return [whole(o) for o in run(jaxpr, consts, args, traced[0])]

  return scan_pipeline.rescan(eqn, invals, evaluate), traced[0]
