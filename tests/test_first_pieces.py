"""The step's first parameter gather in pieces (jax_overlap/_src/transform/first_pieces.py)."""

import re

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap._src.transform import first_pieces
from jax_overlap._src.transform.evaluate import eval_eqn
from jax_overlap.examples import shard_map_fsdp as S


def _gather_then_dot(w, x):
  full = jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)
  return x @ full, full


def test_pieces_equal_the_whole_gather_and_matmul():
  """The gather in k pieces along the weight's output columns, one matmul per piece: the
  same products and the same gathered weight, bit for bit (the equations bound are the
  traced program's own)."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  w = jax.device_put(
    jax.random.normal(jax.random.key(0), (256, 96)), NamedSharding(mesh, P("fsdp"))
  )
  x = jax.device_put(
    jax.random.normal(jax.random.key(1), (8 * 16, 256)), NamedSharding(mesh, P("fsdp"))
  )
  specs = dict(mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=(P("fsdp"), P()))
  whole = jax.jit(jax.shard_map(_gather_then_dot, **specs, check_vma=False))
  closed = jax.make_jaxpr(jax.shard_map(_gather_then_dot, **specs, check_vma=False))(w, x)
  (sm,) = closed.jaxpr.eqns
  body = sm.params["jaxpr"]
  gather_eqn, dot_eqn = body.eqns
  for k in (2, 3, 4):
    p = first_pieces.Pieces(0, 1, dim=1, out_dim=1, k=k)

    def pieced(w, x, p=p):
      g = first_pieces.Gathering(gather_eqn, w, p, _bind)
      return g.dot(dot_eqn, [x, None], gather_eqn.outvars[0]), g.whole()

    got = jax.jit(jax.shard_map(pieced, **specs, check_vma=False))(w, x)
    for a, b in zip(whole(w, x), got):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _bind(eqn, invals):
  return eval_eqn(eqn, invals, None)


def test_the_first_gather_goes_in_pieces_in_xlas_schedule():
  """On an FSDP layer whose first matmul is long enough (h100x8, deviceless), the cost model
  splits the step's first gather; XLA's compiled schedule has each piece as a collective of
  its own (not merged back into one) at the start of the step."""
  fn, args = S.build("h100x8", form="unrolled", layers=1, hidden=2048, mlp=5632, heads=8, seq=2048)
  ov = jax_overlap.overlap(fn, target="h100x8", select="rewrite", cache=False)
  found = [a.detail for a in ov.explain(*args).of_kind("prefetch") if " pieces " in a.detail]
  assert len(found) == 1, found
  m = re.search(r"\(([\d.]+) MiB, nothing before it\) in (\d+) pieces", found[0])
  mib, k = float(m[1]), int(m[2])
  assert k >= 2
  report = jax_overlap.analyze(ov, *args, target="h100x8")
  gathers = sorted(
    (c for c in report.collectives if c.kind == "all-gather"), key=lambda c: c.start_s
  )
  piece = mib * 2**20 / k
  # The step's first k gathers are the pieces, one after another.
  assert all(abs(c.bytes - piece) < 1024 for c in gathers[:k]), [
    (c.name, c.bytes) for c in gathers[: k + 2]
  ]
  assert all(a.end_s <= b.start_s + 1e-9 for a, b in zip(gathers[: k - 1], gathers[1:k]))


def test_a_first_matmul_fed_by_a_collective_is_left_whole():
  """Where the first matmul's other operand itself comes from a collective (the embedding's
  rows, reduce-scattered at the step's start), the link carries both before it: no pieces."""
  from jax_overlap.examples import llama_fsdp as L

  fn, args = L.build(
    "h100x8", layers=1, hidden=2048, mlp=5632, heads=16, kv_heads=4, vocab=32000, seq=2048
  )
  e = jax_overlap.overlap(fn, target="h100x8", select="rewrite", cache=False).explain(*args)
  assert e.of_kind("embedding"), str(e)  # the rows are reduce-scattered
  assert not [a for a in e.of_kind("prefetch") if " pieces " in a.detail], str(e)


def test_pieces_pay_only_where_the_matmul_outlasts_a_piece():
  """The cost model's pipeline: k pieces gain where the matmul is long against one piece's
  gather, and never where the gather is all there is."""
  t_gather, t_dot = 1.0, 1.0
  whole = first_pieces.pipelined(t_gather, t_dot, 1, t_gather)
  assert first_pieces.pipelined(t_gather, t_dot, 4, 0.25) < whole
  # A matmul of no time: nothing to overlap, pieces only add their latencies.
  assert first_pieces.pipelined(t_gather, 0.0, 4, 0.3) > first_pieces.pipelined(
    t_gather, 0.0, 1, t_gather
  )
