"""Forms of a sequence-parallel block boundary: reduce-scatter, residual add, all-gather.

The boundary between a tensor + sequence parallel block's attention and its MLP: the
output projection ``o @ wo`` (``o`` the attention output on local heads, whole sequence)
is reduce-scattered along the sequence, added to the residual ``x`` (this device's rows),
and the sum all-gathered along the sequence for the MLP's up projection (``@ w1``). The
forward pass only, in ``shard_map`` over a ``tensor`` axis of 8, bf16, compiled
deviceless and read by jax_overlap.analyze (XLA's own schedule under the recommended
flags; a model's estimate). Forms:

* one collective each: as written;
* pieces (what @overlap issues): the reduce-scatter in pieces of slices ``--rs_pieces``,
  put together, the sum cut again into slices ``--ag_pieces`` for an all-gather in pieces
  (jax_overlap.collective_matmul's ``method="pieces"``);
* chained: piece ``j`` of the all-gather takes piece ``j`` of the reduce-scatter through
  the add, both on the all-gather's slices; "interleaved" also issues each reduce-scatter
  after the previous all-gather; "paced" also issues each all-gather after the up
  projection of the piece before it (so its add waits for that GEMM, not for every GEMM
  XLA would put first) and each up projection before the next reduce-scatter;
* all-reduce: the output projection's pieces all-reduced and added to the gathered
  residual the block already keeps (the all-gather of ``x + r`` is ``all_gather(x) +
  psum(o @ wo)``), each all-reduce issued after the up projection two pieces back.

Writes benchmarks/results/transform_tp_boundary.{json,md}.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.use_cpu_devices(8)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app  # noqa: E402
from absl import flags as absl_flags  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_overlap  # noqa: E402
from jax_overlap._src import targets as targets_lib  # noqa: E402
from jax_overlap._src.collective_matmul.pieces import pieces_in_order  # noqa: E402

FLAGS = absl_flags.FLAGS
absl_flags.DEFINE_string("target", "h100x8", "Target.")
absl_flags.DEFINE_string("size", "large", "Model size (see _common.TP_SIZES).")
# The slices @overlap chose for this boundary's two sites on the TP+SP step
# (benchmarks/results/transform_tp.md, h100x8, large).
absl_flags.DEFINE_list("rs_pieces", ["128", "320", "576"], "Reduce-scatter slices.")
absl_flags.DEFINE_list("ag_pieces", ["64", "128", "192", "256", "384"], "All-gather slices.")

AXIS = "t"
FORMS = (
  "one collective each",
  "pieces",
  "chained",
  "chained, interleaved",
  "chained, paced",
  "all-reduce",
)
DN = (((1,), (0,)), ((), ()))


def _rows(v, n, off, q):
  """Rows ``off:off + q`` of every device's block of ``v`` (whole sequence, device-major)."""
  return v.reshape(n, -1, *v.shape[1:])[:, off : off + q].reshape(n * q, *v.shape[1:])


def _dot(a, b):
  a, b = lax.optimization_barrier((a, b))  # one GEMM per piece (XLA's dot merger joins them)
  return a @ b


def block(form, sizes_rs, sizes_ag, o, x, xg, wo, w1):
  n = lax.axis_size(AXIS)
  offs = [sum(sizes_ag[:j]) for j in range(len(sizes_ag))]
  if form == "one collective each":
    x1 = x + lax.psum_scatter(o @ wo, AXIS, scatter_dimension=0, tiled=True)
    return x1, lax.all_gather(x1, AXIS, axis=0, tiled=True) @ w1
  if form == "pieces":
    r = jax_overlap.collective_matmul.dot_general_reduce_scatter(
      o, wo, dimension_numbers=DN, axis=AXIS, scatter_dim=0, method="pieces", pieces=sizes_rs
    )
    x1 = x + r
    dot = (w1, True, DN, None, None, (o.shape[0], w1.shape[1]), w1.dtype)
    (up,), _ = jax_overlap.collective_matmul.all_gather_dot_generals(
      x1, [dot], axis=AXIS, gather_dim=0, method="pieces", pieces=sizes_ag
    )
    return x1, up
  if form == "all-reduce":
    ars, ups = [], []
    for j, (off, q) in enumerate(zip(offs, sizes_ag)):
      y = _dot(_rows(o, n, off, q), wo)
      if j >= 1:  # one all-reduce after the other
        y, ars[-1] = lax.optimization_barrier((y, ars[-1]))
      if j >= 2:  # and after the up projection two pieces back, which it travels beside
        y, ups[j - 2] = lax.optimization_barrier((y, ups[j - 2]))
      ars.append(lax.psum(y, AXIS))
      ups.append(_dot(_rows(xg, n, off, q) + ars[-1], w1))
    me = lax.axis_index(AXIS)
    mine = [lax.dynamic_index_in_dim(a.reshape(n, -1, a.shape[-1]), me, 0, False) for a in ars]
    return x + jnp.concatenate(mine, 0), pieces_in_order(ups, 0, n)
  if form == "chained, paced":
    return _paced(sizes_ag, o, x, wo, w1)
  # chained
  rs, ag = [], []
  for j, (off, q) in enumerate(zip(offs, sizes_ag)):
    y = _dot(_rows(o, n, off, q), wo)
    if j >= 1:
      prev = ag if form == "chained, interleaved" else rs
      y, prev[-1] = lax.optimization_barrier((y, prev[-1]))
    rs.append(lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True))
    piece = x[off : off + q] + rs[-1]
    if ag:  # one all-gather after the other
      piece, ag[-1] = lax.optimization_barrier((piece, ag[-1]))
    ag.append(lax.all_gather(piece, AXIS, axis=0, tiled=True))
  ups = [_dot(g, w1) for g in ag]
  return x + jnp.concatenate(rs, 0), pieces_in_order(ups, 0, n)


def _paced(sizes, o, x, wo, w1):
  """The chained form with the up projections between the collectives: reduce-scatter
  ``j`` after all-gather ``j - 1`` (whose up projection then runs beside it), all-gather
  ``j`` after up projection ``j - 1``."""
  n = lax.axis_size(AXIS)
  offs = [sum(sizes[:j]) for j in range(len(sizes))]
  rs, ag, ups = [], [], []
  for j, (off, q) in enumerate(zip(offs, sizes)):
    y = _dot(_rows(o, n, off, q), wo)
    if j >= 1:
      y, ag[-1] = lax.optimization_barrier((y, ag[-1]))
      ups.append(_dot(ag[-1], w1))
    rs.append(lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True))
    piece = x[off : off + q] + rs[-1]
    if ups:
      piece, ups[-1] = lax.optimization_barrier((piece, ups[-1]))
    ag.append(lax.all_gather(piece, AXIS, axis=0, tiled=True))
  ups.append(_dot(ag[-1], w1))
  return x + jnp.concatenate(rs, 0), pieces_in_order(ups, 0, n)


def run(form: str):
  sz = _common.TP_SIZES[FLAGS.size]
  s, h, f = sz["seq"], sz["hidden"], sz["mlp"]
  mesh = targets_lib.compile_only_mesh(FLAGS.target, (AXIS,))
  sizes_rs = [int(v) for v in FLAGS.rs_pieces]
  sizes_ag = [int(v) for v in FLAGS.ag_pieces]

  def body(o, x, xg, wo, w1):
    return block(form, sizes_rs, sizes_ag, o, x, xg, wo, w1)

  specs = (P(None, AXIS), P(AXIS), P(), P(AXIS), P(None, AXIS))
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(AXIS), P(None, AXIS))))
  shapes = ((s, h), (s, h), (s, h), (h, h), (h, f))
  args = [
    jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    for shape, spec in zip(shapes, specs)
  ]
  opts = jax_overlap.flags.as_compiler_options(target=FLAGS.target)
  r = jax_overlap.analyze(fn, *args, target=FLAGS.target, xla_options=opts, name=form)
  return {
    "form": form,
    "step_s": r.step_time_s,
    "compute_s": r.compute_time_s,
    "comm_s": r.comm_time_s,
    "exposed_s": r.exposed_comm_s,
  }


def main(argv):
  del argv
  rows = []
  for form in FORMS:
    rows.append(run(form))
    print(rows[-1], flush=True)
  sz = _common.TP_SIZES[FLAGS.size]
  md = [
    "# Forms of a sequence-parallel block boundary (reduce-scatter, add, all-gather)",
    "",
    f"Output projection -> reduce-scatter -> residual add -> all-gather -> MLP up projection, "
    f"forward only, bf16, tensor axis of 8, {FLAGS.target}, sizes {sz}; reduce-scatter "
    f"slices {FLAGS.rs_pieces}, all-gather slices {FLAGS.ag_pieces} (the chained and "
    "all-reduce forms use the all-gather's). Deviceless estimates of jax_overlap.analyze "
    "on XLA's schedule (a model; see benchmarks/transform_tp_boundary.py for the forms).",
    "",
    "| form | step ms | compute ms | communication ms | exposed ms |",
    "|---|---:|---:|---:|---:|",
    *[
      f"| {r['form']} | {_common.ms(r['step_s'])} | {_common.ms(r['compute_s'])} "
      f"| {_common.ms(r['comm_s'])} | {_common.ms(r['exposed_s'])} |"
      for r in rows
    ],
  ]
  _common.publish(
    "transform_tp_boundary",
    {
      "target": FLAGS.target,
      "size": FLAGS.size,
      "rs_pieces": [int(v) for v in FLAGS.rs_pieces],
      "ag_pieces": [int(v) for v in FLAGS.ag_pieces],
      "rows": rows,
    },
    md,
  )


if __name__ == "__main__":
  app.run(main)
