"""Loop bodies evaluated in two halves of their batch (transform/batch_halves.py and its
evaluator transform/halves.py): the same values, the collectives halved in XLA's program,
and the variants that offer it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType

import jax_overlap
from jax_overlap._src.transform import batch_halves, halves, variants
from jax_overlap._src.transform.evaluate import (
  VariantConfig,
  collect_stats,
  eval_eqn,
  evaluate_program,
)
from jax_overlap._src.transform.settings import Settings
from jax_overlap._src.transform.stats import RewriteStats
from jax_overlap.examples import tp_sp

CFG = dict(
  layers=3, hidden=64, mlp=128, heads=8, seq=64, batch=4, dtype="float32", scan_layers=True
)
HALVES = VariantConfig(prefetch=0, reduce_scatter="as_written", annotate=False, halves=True)


def _rewritten(fn, args, cfg=HALVES):
  """``fn`` re-evaluated under ``cfg``, and what its plan said."""
  closed = jax.make_jaxpr(fn)(*args)
  actions: list = []
  stats = collect_stats(closed.jaxpr, cfg, actions, [0])
  flat = jax.jit(lambda *a: evaluate_program(closed, a, cfg))
  tree = jax.tree.structure(jax.eval_shape(fn, *args))

  def run(*a):
    return jax.tree.unflatten(tree, flat(*jax.tree.leaves(a)))

  return run, stats, actions, closed


@pytest.mark.parametrize("remat", [False, True], ids=["saved", "remat"])
def test_a_tensor_parallel_loop_in_batch_halves_computes_what_it_computed(remat):
  # Tensor + sequence parallel blocks under lax.scan (and jax.checkpoint), batch 4: both
  # loops (the forward and autodiff's transposed one) run in halves of 2; the loss and every
  # gradient as before (a weight gradient is two halves' sums added: float32 rounding).
  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(AxisType.Auto,))
  fn, args = tp_sp.build(mesh=mesh, remat=remat, **CFG)
  params, x = tp_sp.random_inputs(args, seed=3)
  loss, grads = fn(params, x)
  run, stats, actions, _ = _rewritten(fn, (params, x))
  assert stats.halvable_loops == 2
  halved = [a for a in actions if a.kind == "batch_halves"]
  assert len(halved) == 2 and all("lax.scan" in a.where for a in halved), actions
  loss_h, grads_h = run(params, x)
  np.testing.assert_allclose(float(loss_h), float(loss), rtol=1e-6)
  for g, gh in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_h)):
    np.testing.assert_allclose(np.asarray(gh), np.asarray(g), rtol=1e-5, atol=1e-6)


def _eval_halved(f, x, *rest, dim=0):
  """``f(x, *rest)`` by the halves evaluator with ``x`` in halves along ``dim``."""
  closed = jax.make_jaxpr(f)(x, *rest)
  ctx = halves.Context(lambda e, v: eval_eqn(e, v, None))

  def g(x, *rest):
    outs = halves.run(closed.jaxpr, closed.consts, [halves.halve(x, dim), *rest], ctx)
    return [halves.whole(o) for o in outs]

  return jax.jit(g)(x, *rest), ctx


def test_each_rule_gives_the_whole_values():
  # Shapes and reductions around a split batch: reshapes that merge it with the sequence
  # and split it again, a transpose that moves it, matmuls with it free, batched and
  # contracted, sums and maxima over it and over other dimensions, broadcasts, a
  # concatenation, a cumulative sum, a pad, slices, an update in place, a split.
  def f(x, w):
    b, s, h = x.shape
    flat = x.reshape(b * s, h)  # the batch merged with the sequence
    y = jnp.tanh(flat @ w).reshape(b, s, -1)  # free in the matmul, split again
    t = jnp.transpose(y, (1, 0, 2))  # the batch moved to dimension 1
    att = jnp.einsum("bsh,bth->bst", x, x)  # a batch dimension of the matmul
    gram = jnp.einsum("bsh,bsk->hk", x, y)  # contracted: the halves' products added
    total = jnp.sum(x, axis=0)  # a sum over the batch
    peak = jnp.max(x, axis=(0, 1))  # a maximum over it
    rows = jnp.sum(x, axis=2, keepdims=True) * x  # along another dimension, broadcast back
    both = jnp.concatenate([x, rows], axis=2)
    run = jnp.cumsum(x, axis=1)
    padded = jnp.pad(x, ((0, 0), (1, 2), (0, 0)))
    part = lax.dynamic_slice_in_dim(x, 3, 4, axis=1)
    upd = lax.dynamic_update_slice_in_dim(x, part * 2.0, 1, axis=1)
    a, c = jnp.split(x, 2, axis=2)
    first = jnp.argmax(x, axis=2)
    return t, att, gram, total, peak, both, run, padded[:, 1:-2], upd, a - c, first

  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (6, 10, 8), jnp.float32)
  w = jax.random.normal(kw, (8, 12), jnp.float32)
  got, ctx = _eval_halved(f, x, w)
  want = jax.jit(f)(x, w)
  assert not ctx.joined, ctx.joined  # every equation kept the halves apart
  assert ctx.summed == 2  # the contracted matmul and the sum over the batch
  for g, v in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(v), rtol=1e-6, atol=1e-6)


def test_bfloat16_partial_sums_are_added_in_float32():
  # A weight gradient in bfloat16 summed over the batch: each half's product accumulates in
  # float32 and the two are added before the one rounding to bfloat16, as one matmul does.
  kx, ky = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (8, 256, 64), jnp.bfloat16)
  y = jax.random.normal(ky, (8, 256, 32), jnp.bfloat16)

  def f(x, y):
    return jnp.einsum("bsh,bsk->hk", x, y)

  (got,), _ = _eval_halved(f, x, y)
  exact = np.einsum("bsh,bsk->hk", np.asarray(x, np.float32), np.asarray(y, np.float32))
  err_halves = np.abs(np.asarray(got, np.float32) - exact).max()
  err_whole = np.abs(np.asarray(jax.jit(f)(x, y), np.float32) - exact).max()
  assert got.dtype == jnp.bfloat16
  assert err_halves <= err_whole * 1.01 + 1e-6


def test_an_equation_without_a_rule_runs_on_the_whole_value():
  # A sort along the split dimension, and a gather that indexes it: no rule keeps the halves
  # apart there, so they are put together first; the values are the same.
  def f(x, idx):
    return jnp.sort(x, axis=0), x[idx]

  x = jax.random.normal(jax.random.key(2), (6, 5), jnp.float32)
  idx = jnp.array([5, 0, 3])
  (s, g), ctx = _eval_halved(f, x, idx)
  assert "sort" in ctx.joined
  np.testing.assert_array_equal(np.asarray(s), np.sort(np.asarray(x), axis=0))
  np.testing.assert_array_equal(np.asarray(g), np.asarray(x)[np.asarray(idx)])


def test_split_dims_finds_the_batch_of_activation_collectives_only():
  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(AxisType.Auto,))

  def scans(fn, args):
    closed = jax.make_jaxpr(fn)(*args)
    out = []

    def walk(jx):
      for e in jx.eqns:
        if e.primitive.name == "scan":
          out.append(e)
        for v in e.params.values():
          sub = getattr(v, "jaxpr", v)
          if hasattr(sub, "eqns") and e.primitive.name != "scan":
            walk(sub)

    walk(closed.jaxpr)
    return out

  fn, args = tp_sp.build(mesh=mesh, **CFG)
  dims = [batch_halves.split_dims(e) for e in scans(fn, args)]
  assert len(dims) == 2 and all(d is not None and 0 in d for d in dims)
  # One sequence: nothing to halve.
  fn, args = tp_sp.build(mesh=mesh, **{**CFG, "batch": 1})
  assert all(batch_halves.split_dims(e) is None for e in scans(fn, args))


def test_variants_offer_batch_halves_only_where_a_loop_can_run_in_them():
  settings = Settings(target="h100x8")
  cfg = VariantConfig(prefetch=1, reduce_scatter="per_layer", annotate=True)
  stats = RewriteStats(loops=2, loop_bodies=2, max_scatter_out_bytes=1, halvable_loops=2)
  by_name = {c.name: c for c in variants.candidates(settings, cfg, stats)}
  halved = [c for n, c in by_name.items() if "batch halves" in n]
  assert len(halved) == 2 and all(c.config.halves for c in halved)
  assert all(c.options.get("xla_gpu_dot_merger_threshold_mb") == 0 for c in halved)
  assert not any(c.config.halves for n, c in by_name.items() if "batch halves" not in n)
  stats = RewriteStats(loops=2, loop_bodies=2, max_scatter_out_bytes=1)
  assert not any("batch halves" in c.name for c in variants.candidates(settings, cfg, stats))


def test_xla_keeps_the_halves_apart_on_h100():
  # Deviceless for h100x8: in XLA's optimized program the loop bodies hold twice the
  # all-gathers and reduce-scatters of the step as written, each of half the bytes (not
  # combined back into one), and the step's matmul FLOPs are unchanged.
  fn, args = tp_sp.build(
    "h100x8", layers=2, hidden=1024, mlp=4096, heads=16, seq=1024, batch=4, scan_layers=True
  )
  opts = {"xla_gpu_dot_merger_threshold_mb": 0}
  written = jax_overlap.analyze(fn, *args, target="h100x8", xla_options=opts)
  run, _, _, _ = _rewritten(fn, args)
  halved = jax_overlap.analyze(jax.jit(run), *args, target="h100x8", xla_options=opts)

  def in_loop(report, kind):
    return [c for c in report.collectives if c.kind == kind and "while/body" in c.op_name]

  for kind in ("all-gather", "reduce-scatter"):
    before, after = in_loop(written, kind), in_loop(halved, kind)
    assert before and len(after) == 2 * len(before), (kind, len(before), len(after))
    assert max(c.bytes for c in after) * 2 == max(c.bytes for c in before)
  assert halved.flops == pytest.approx(written.flops, rel=0.02)
