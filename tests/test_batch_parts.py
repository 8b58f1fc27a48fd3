"""Loop bodies evaluated in parts of their batch (transform/batch_parts.py and its evaluator
transform/parts.py): the same values, the collectives split in XLA's program, and the
variants that offer it."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap._src.transform import batch_parts, parts, variants
from jax_overlap._src.transform.evaluate import (
  VariantConfig,
  collect_stats,
  eval_eqn,
  evaluate_program,
)
from jax_overlap._src.transform.jaxprs import scan_sizes, subjaxprs
from jax_overlap._src.transform.settings import Settings
from jax_overlap._src.transform.stats import RewriteStats
from jax_overlap.examples import tp_sp

CFG = dict(
  layers=3, hidden=64, mlp=128, heads=8, seq=64, batch=4, dtype="float32", scan_layers=True
)


def _config(n: int) -> VariantConfig:
  return VariantConfig(prefetch=0, reduce_scatter="as_written", annotate=False, batch_parts=n)


def _rewritten(fn, args, cfg):
  """``fn`` re-evaluated under ``cfg``, and what its plan said."""
  closed = jax.make_jaxpr(fn)(*args)
  actions: list = []
  stats = collect_stats(closed.jaxpr, cfg, actions, [0])
  flat = jax.jit(lambda *a: evaluate_program(closed, a, cfg))
  tree = jax.tree.structure(jax.eval_shape(fn, *args))

  def run(*a):
    return jax.tree.unflatten(tree, flat(*jax.tree.leaves(a)))

  return run, stats, actions, closed


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("remat", [False, True], ids=["saved", "remat"])
def test_a_tensor_parallel_loop_in_batch_parts_computes_what_it_computed(remat, n):
  # Tensor + sequence parallel blocks under lax.scan (and jax.checkpoint), batch 4: both
  # loops (the forward and autodiff's transposed one) run in n parts; the loss and every
  # gradient as before (a weight gradient is the parts' sums added: float32 rounding).
  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(AxisType.Auto,))
  fn, args = tp_sp.build(mesh=mesh, remat=remat, **CFG)
  params, x = tp_sp.random_inputs(args, seed=3)
  loss, grads = fn(params, x)
  run, stats, actions, _ = _rewritten(fn, (params, x), _config(n))
  assert stats.split_loops == stats.split4_loops == 2
  split = [a for a in actions if a.kind == "batch_parts"]
  assert len(split) == 2 and all(f"in {n} parts" in a.detail for a in split), actions
  loss_p, grads_p = run(params, x)
  np.testing.assert_allclose(float(loss_p), float(loss), rtol=1e-6)
  for g, gp in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_p)):
    np.testing.assert_allclose(np.asarray(gp), np.asarray(g), rtol=1e-5, atol=1e-6)


def _eval_split(f, x, *rest, n=2, dim=0):
  """``f(x, *rest)`` by the parts evaluator with ``x`` in ``n`` parts along ``dim``."""
  closed = jax.make_jaxpr(f)(x, *rest)
  ctx = parts.Context(lambda e, v: eval_eqn(e, v, None))

  def g(x, *rest):
    outs = parts.run(closed.jaxpr, closed.consts, [parts.cut(x, dim, n), *rest], ctx)
    return [parts.whole(o) for o in outs]

  return jax.jit(g)(x, *rest), ctx


@pytest.mark.parametrize("n", [2, 3])
def test_each_rule_gives_the_whole_values(n):
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
    gram = jnp.einsum("bsh,bsk->hk", x, y)  # contracted: the parts' products added
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
  got, ctx = _eval_split(f, x, w, n=n)
  want = jax.jit(f)(x, w)
  assert not ctx.joined, ctx.joined  # every equation kept the parts apart
  assert ctx.summed == 2  # the contracted matmul and the sum over the batch
  for g, v in zip(got, want):  # the sums' order differs: float32 rounding of the largest
    scale = max(1.0, float(np.abs(np.asarray(v)).max()))
    np.testing.assert_allclose(np.asarray(g), np.asarray(v), rtol=1e-6, atol=1e-6 * scale)


def test_bfloat16_partial_sums_are_added_in_float32():
  # A weight gradient in bfloat16 summed over the batch: each part's product accumulates in
  # float32 and they are added before the one rounding to bfloat16, as one matmul does.
  kx, ky = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (8, 256, 64), jnp.bfloat16)
  y = jax.random.normal(ky, (8, 256, 32), jnp.bfloat16)

  def f(x, y):
    return jnp.einsum("bsh,bsk->hk", x, y)

  (got,), _ = _eval_split(f, x, y, n=4)
  exact = np.einsum("bsh,bsk->hk", np.asarray(x, np.float32), np.asarray(y, np.float32))
  err_parts = np.abs(np.asarray(got, np.float32) - exact).max()
  err_whole = np.abs(np.asarray(jax.jit(f)(x, y), np.float32) - exact).max()
  assert got.dtype == jnp.bfloat16
  assert err_parts <= err_whole * 1.01 + 1e-6


def test_an_equation_without_a_rule_runs_on_the_whole_value():
  # A sort along the split dimension, and a gather that indexes it: no rule keeps the parts
  # apart there, so they are put together first; the values are the same.
  def f(x, idx):
    return jnp.sort(x, axis=0), x[idx]

  x = jax.random.normal(jax.random.key(2), (6, 5), jnp.float32)
  idx = jnp.array([5, 0, 3])
  (s, g), ctx = _eval_split(f, x, idx)
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
  for n in (2, 4):
    dims = [batch_parts.split_dims(e, n) for e in scans(fn, args)]
    assert len(dims) == 2 and all(d is not None and 0 in d for d in dims)
  # A batch of 4 does not divide into 8 parts; one sequence into none.
  assert all(batch_parts.split_dims(e, 8) is None for e in scans(fn, args))
  fn, args = tp_sp.build(mesh=mesh, **{**CFG, "batch": 1})
  assert all(batch_parts.split_dims(e, 2) is None for e in scans(fn, args))


def test_variants_offer_batch_parts_only_where_a_loop_can_run_in_them():
  settings = Settings(target="h100x8")
  cfg = VariantConfig(prefetch=1, reduce_scatter="per_layer", annotate=True)

  def split(**kw):
    stats = RewriteStats(loops=2, loop_bodies=2, max_scatter_out_bytes=1, **kw)
    return {c.config.batch_parts: c for c in variants.candidates(settings, cfg, stats)}

  by_parts = split(split_loops=2, split4_loops=2)
  assert sorted(by_parts) == [1, 2, 4]
  assert all(by_parts[n].options.get("xla_gpu_dot_merger_threshold_mb") == 0 for n in (2, 4))
  assert all(f"in {n} batch parts" in by_parts[n].name for n in (2, 4))
  assert sorted(split(split_loops=2, split4_loops=1)) == [1, 2]  # not every loop in 4
  assert sorted(split()) == [1]


def test_xla_keeps_the_parts_apart_on_h100():
  # Deviceless for h100x8: in XLA's optimized program the loop bodies hold twice the
  # all-gathers and reduce-scatters of the step as written, each of half the bytes (not
  # combined back into one), and the step's matmul FLOPs are unchanged.
  fn, args = tp_sp.build(
    "h100x8", layers=2, hidden=1024, mlp=4096, heads=16, seq=1024, batch=4, scan_layers=True
  )
  opts = {"xla_gpu_dot_merger_threshold_mb": 0}
  written = jax_overlap.analyze(fn, *args, target="h100x8", xla_options=opts)
  run, _, _, _ = _rewritten(fn, args, _config(2))
  split = jax_overlap.analyze(jax.jit(run), *args, target="h100x8", xla_options=opts)

  def in_loop(report, kind):
    return [c for c in report.collectives if c.kind == kind and "while/body" in c.op_name]

  for kind in ("all-gather", "reduce-scatter"):
    before, after = in_loop(written, kind), in_loop(split, kind)
    assert before and len(after) == 2 * len(before), (kind, len(before), len(after))
    assert max(c.bytes for c in after) * 2 == max(c.bytes for c in before)
  assert split.flops == pytest.approx(written.flops, rel=0.02)


# Steps of a random program over x: [batch, seq, hidden] (batch first); each keeps that shape
# or returns to it, so that any sequence of them is a program.
_STEPS = {
  "tanh": lambda x, w: jnp.tanh(x),
  "matmul": lambda x, w: x @ w,  # the batch free
  "merge": lambda x, w: (x.reshape(-1, x.shape[-1]) * 2.0).reshape(x.shape),
  "swap": lambda x, w: jnp.swapaxes(jnp.swapaxes(x, 0, 1) + 1.0, 0, 1),
  "norm": lambda x, w: x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6),
  "softmax": lambda x, w: jax.nn.softmax(jnp.einsum("bsh,bth->bst", x, x), axis=-1) @ x,
  "cumsum": lambda x, w: jnp.cumsum(x, axis=1) / x.shape[1],
  "gram": lambda x, w: x @ (jnp.einsum("bsh,bsk->hk", x, x) / x.size),  # sums the batch
  "centre": lambda x, w: x - jnp.mean(x, axis=0),  # a mean over the batch
  "maxnorm": lambda x, w: x / (jnp.max(jnp.abs(x)) + 1.0),
  "shift": lambda x, w: jnp.pad(x[:, 1:], ((0, 0), (0, 1), (0, 0))),
}


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
  steps=st.lists(st.sampled_from(sorted(_STEPS)), min_size=1, max_size=6),
  n=st.sampled_from([2, 4]),
)
def test_property_any_program_in_parts_computes_the_whole(steps, n):
  # Any chain of these steps, evaluated with its input in n parts of the batch, gives the
  # whole program's values (to float32 rounding where the batch is summed).
  kx, kw = jax.random.split(jax.random.key(len(steps)))
  x = jax.random.normal(kx, (4, 6, 8), jnp.float32)
  w = jax.random.normal(kw, (8, 8), jnp.float32) / 8**0.5

  def f(x, w):
    for s in steps:
      x = _STEPS[s](x, w)
    return x

  (got,), _ = _eval_split(f, x, w, n=n)
  want = jax.jit(f)(x, w)
  scale = max(1.0, float(jnp.abs(want).max()))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * scale)


def test_a_split_loop_carries_and_stacks_each_part_apart():
  # The loop holds a split carry, sliced input and stacked output as one array per part
  # (put together outside it): no kernel of an iteration reads a value every part is cut
  # from, which XLA's sibling fusion would join the parts' kernels over.
  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(AxisType.Auto,))
  fn, args = tp_sp.build(mesh=mesh, remat=True, **CFG)
  params, x = tp_sp.random_inputs(args, seed=3)
  for n in (2, 4):
    run, _, _, closed = _rewritten(fn, (params, x), _config(n))
    before = _scans(closed.jaxpr)
    after = _scans(jax.make_jaxpr(run)(params, x).jaxpr)
    assert len(after) == len(before) == 2
    for b, a in zip(before, after):
      # The batch of the split values (4 sequences) in n parts of 4 // n.
      loop_b, loop_a = b.invars[scan_sizes(b)[0] :], a.invars[scan_sizes(a)[0] :]
      split_b = [v for v in loop_b if CFG["batch"] in _dims(v)]
      split_a = [v for v in loop_a if CFG["batch"] // n in _dims(v)]
      assert split_b and len(split_a) >= n * len(split_b), (n, len(split_b), len(split_a))
      assert not [v for v in loop_a if CFG["batch"] in _dims(v)]


def test_a_loop_constant_with_the_batch_is_cut_before_the_loop():
  # A constant of the loop that has the batch (an attention mask made before the layers'
  # scan) is cut into its parts once, before the loop: inside, each part reads its own
  # array, and no kernel reads the mask every part is cut from (XLA's sibling fusion joined
  # the parts' softmax reductions over it).
  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(AxisType.Auto,))
  batch, seq, hidden = 4, 8, 16

  def local(x, ws, mask):
    def body(c, w):
      g = lax.all_gather(c, "tensor", axis=2, tiled=True)  # the activations' gather
      y = jnp.tanh(g @ w) * mask[:, :, None]
      return c + lax.psum_scatter(y, "tensor", scatter_dimension=2, tiled=True), None

    return lax.scan(body, x, ws)[0]

  fn = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(P(None, None, "tensor"), P(), P()),
      out_specs=P(None, None, "tensor"),
    )
  )
  kx, kw, km = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (batch, seq, hidden), jnp.float32)
  ws = jax.random.normal(kw, (3, hidden, hidden), jnp.float32) / 4
  mask = (jax.random.uniform(km, (batch, seq)) > 0.3).astype(jnp.float32)
  want = fn(x, ws, mask)
  for n in (2, 4):
    run, stats, _, _ = _rewritten(fn, (x, ws, mask), _config(n))
    assert stats.split_loops == 1
    (scan,) = _scans(jax.make_jaxpr(run)(x, ws, mask).jaxpr)
    consts = scan.invars[: scan_sizes(scan)[0]]
    assert [tuple(v.aval.shape) for v in consts if v.aval.shape[-1:] == (seq,)] == [
      (batch // n, seq)
    ] * n, consts
    np.testing.assert_allclose(np.asarray(run(x, ws, mask)), np.asarray(want), rtol=1e-6)


def _dims(v) -> tuple:
  return tuple(getattr(v.aval, "shape", ()))[:2]


def _scans(jaxpr) -> list:
  """The scan equations of ``jaxpr`` and of the jaxprs it calls, in order."""
  out = []
  for e in jaxpr.eqns:
    if e.primitive.name == "scan":
      out.append(e)
    else:
      for sub in subjaxprs(e):
        out += _scans(sub)
  return out


def test_each_part_reads_its_own_copy_of_a_small_shared_value():
  # A norm's scale (small) multiplies every part: each part reads it through a copy of its
  # own, tied to the part, so no two parts' kernels share it; a large shared value stays
  # one (a copy would be written out). Without keys (the evaluator alone) nothing changes.
  x = jnp.ones((4, 16, 32), jnp.float32)
  scale = jnp.arange(32, dtype=jnp.float32)
  table = jnp.ones((4, 2048, 32), jnp.float32)[:, :16]  # computed: 128 KiB, small too
  big = jnp.ones((4, 16, 32 * 2048), jnp.float32)  # 8 MiB

  def g(x, scale, table, big, n=2):
    closed = jax.make_jaxpr(lambda x, s, t, b: (x * s, x + t, x.repeat(2048, 2) * b))(
      x, scale, table, big
    )
    xp = parts.cut(x, 0, n)
    ctx = parts.Context(lambda e, v: eval_eqn(e, v, None), keys=xp.parts)
    outs = parts.run(closed.jaxpr, closed.consts, [xp, scale, table, big], ctx)
    return [parts.whole(o) for o in outs]

  jaxpr = jax.make_jaxpr(g)(x, scale, table, big)
  barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
  # scale and table once per part; big (8 MiB) not copied.
  assert len(barriers) == 4, jaxpr
  assert all(np.prod(e.outvars[0].aval.shape) * 4 <= parts.SMALL_BYTES for e in barriers)
  got = jax.jit(g)(x, scale, table, big)
  want = (x * scale, x + table, x.repeat(2048, 2) * big)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
