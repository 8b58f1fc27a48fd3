"""Parameter gathers issued by time (transform/prefetch.py), gradients that exist before a
scanned backward reduce-scattered before it, embedding lookups without gathering the table
(transform/embedding.py), on a whole Llama-style FSDP model
(jax_overlap.examples.llama_fsdp): the same numbers as the step as written, and the timing the
plan claims checked against XLA's schedule of the deviceless h100x8 compile."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap.examples import llama_fsdp as L

_TIMING = re.compile(
  r"all-gather #(\d+) \(([\d.]+) MiB, ([\d.]+) ms\) (?:issued|placed) (at the start|after equation (\d+)), "
  r"first used at equation (\d+): hides under ([\d.]+) ms of compute"
)


def _small(form, gather, **kw):
  # A table large enough against 64 tokens for the cost model to look rows up where they
  # are held (16 MiB against 32 KiB of activations).
  cfg = dict(
    layers=2, hidden=128, mlp=128, heads=4, kv_heads=2, vocab=32768, seq=8, dtype="float32"
  )
  cfg.update(kw)
  return L.Config(form=form, gather=gather, learning_rate=0.1, **cfg)


@pytest.mark.slow
@pytest.mark.xla_default_cpu_emitters  # bit for bit under XLA's own code generation
@pytest.mark.parametrize("form", L.FORMS)
@pytest.mark.parametrize("gather", L.GATHERS)
def test_same_losses_and_parameters_as_the_step_as_written(form, gather):
  _check_same_as_written(form, gather, layers=2)


@pytest.mark.slow
@pytest.mark.xla_default_cpu_emitters
def test_a_peeled_scan_gives_the_same_losses_and_parameters():
  """Four scanned, rematerialized layers: the loops' first and last iterations run outside
  them (scan_pipeline's peel), with the same numbers bit for bit."""
  e = _check_same_as_written("scan_remat", "per_use", layers=4)
  assert any("runs before the loop" in a.detail for a in e.of_kind("prefetch")), str(e)
  assert any("runs after the loop" in a.detail for a in e.of_kind("reduce_scatter")), str(e)


def _check_same_as_written(form, gather, layers):
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  cfg = _small(form, gather, layers=layers)
  params = L.init_params(cfg, mesh, jax.random.key(0))
  sh = NamedSharding(mesh, P("fsdp"))
  # Ids from a few rows: the same row is looked up (and its gradient added) on many devices.
  tokens = jax.device_put(jax.random.randint(jax.random.key(1), (8, cfg.seq), 0, 24), sh)
  labels = jax.device_put(jax.random.randint(jax.random.key(2), (8, cfg.seq), 0, cfg.vocab), sh)
  step = L.make_step(cfg, mesh)
  # The rewrite planned for h100x8 (gathers timed by its cost model), run on CPU devices.
  ov = jax_overlap.overlap(step, target="h100x8", select="rewrite", cache=False)
  e = ov.explain(params, tokens, labels)
  assert e.of_kind("gather_timing"), str(e)
  lookup, gradient = (a.detail for a in e.of_kind("embedding"))
  assert "without gathering its table" in lookup and "scatter-added where" in gradient
  if form == "scan_remat":
    assert any("finish before it starts" in a.detail for a in e.of_kind("reduce_scatter")), str(e)
  p1, p2, losses = params, params, []
  for _ in range(3):
    p1, l1 = jax.jit(step)(p1, tokens, labels)
    p2, l2 = ov(p2, tokens, labels)
    losses.append((float(l1), float(l2)))
  assert all(a == b for a, b in losses), losses
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The variant that ties each gather where the cost model issues it (and the first ones and
  # the reduce-scatters one after another): optimization barriers only, the same numbers.
  from jax_overlap._src.transform.evaluate import VariantConfig, evaluate_program

  closed = jax.jit(step).trace(params, tokens, labels).jaxpr
  tied = VariantConfig(1, "per_layer", False, "off", "h100x8", chain=True)
  fn = jax.jit(lambda *a: evaluate_program(closed, jax.tree.leaves(a), tied))
  assert "optimization_barrier" in str(jax.make_jaxpr(fn)(params, tokens, labels))
  for a, b in zip(
    jax.tree.leaves(jax.jit(step)(params, tokens, labels)), fn(params, tokens, labels)
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  return e


def _timings(explanation):
  out = []
  for a in explanation.of_kind("gather_timing"):
    m = _TIMING.search(a.detail)
    if m:
      g, mib, ms, _, after, use, hidden = m.groups()
      out.append(
        (int(g), float(ms), None if after is None else int(after), int(use), float(hidden))
      )
  return out


@pytest.mark.slow
def test_gathers_go_in_order_of_first_use_each_hidden_where_the_model_says():
  fn, args = L.build(
    "h100x8", layers=3, hidden=1024, mlp=2816, heads=8, kv_heads=2, vocab=4096, seq=1024
  )
  ov = jax_overlap.overlap(fn, target="h100x8", select="rewrite", cache=False)
  e = ov.explain(*args)
  timings = _timings(e)
  n_params = 3 * 9 + 3  # nine per layer (norm scales included), the embedding, ln_f, head
  assert len(timings) == n_params, str(e)
  (summary,) = e.of_kind("prefetch")
  ahead = float(re.search(r"at most ([\d.]+) MiB gathered ahead of first use", summary.detail)[1])
  layer_mib = (3 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 2816) * 2 / 2**20  # one layer
  assert 0 < ahead < 2 * layer_mib  # just in time: never two layers' weights ahead
  uses = [t[3] for t in timings]
  assert uses == sorted(uses)  # listed, and queued on the link, in order of first use
  issued = [-1 if t[2] is None else t[2] for t in timings]
  assert issued == sorted(
    issued
  )  # so a later-needed gather is never issued ahead of one needed sooner
  tied = [t for t in timings if t[2] is not None]
  assert tied, str(e)
  for g, _, after, use, _ in tied:
    assert after < g and after < use
  # Where the model has room (every gather but the first ones), each hides under compute at
  # least as long as itself.
  hidden_ok = [t for t in tied if "exposed" not in _detail_of(e, t[0])]
  assert hidden_ok and all(hidden >= ms - 1e-3 for _, ms, _, _, hidden in hidden_ok)


def _detail_of(explanation, g):
  return next(
    a.detail for a in explanation.of_kind("gather_timing") if f"all-gather #{g} " in a.detail
  )


@pytest.mark.slow
def test_the_output_projections_gradient_is_scattered_before_the_scanned_backward():
  """In XLA's schedule (deviceless h100x8 compile of the rewritten step), the reduce-scatter
  of the output projection's gradient (computed right after the loss) ends before the
  scanned backward's first reduce-scatter starts; as written it is issued after the loop."""
  fn, args = L.build(
    "h100x8",
    form="scan_remat",
    layers=3,
    hidden=1024,
    mlp=2816,
    heads=8,
    kv_heads=2,
    vocab=8192,
    seq=1024,
  )
  head_bytes = 1024 * 8192 * 2  # bf16 (hidden, vocab)

  def head_scatter_and_loop_start(report):
    scatters = [c for c in report.collectives if c.kind == "reduce-scatter"]
    # The output projection's and the embedding's gradients are the same size (and XLA may
    # combine them).
    head = [c for c in scatters if "while/body" not in c.op_name and c.bytes >= head_bytes]
    in_loop = [c for c in scatters if "while/body" in c.op_name]
    assert len(head) >= 1 and in_loop, [(c.name, c.bytes) for c in report.collectives]
    return head, min(c.start_s for c in in_loop)

  ov = jax_overlap.overlap(fn, target="h100x8", select="rewrite", cache=False)
  rewritten = jax_overlap.analyze(ov, *args, target="h100x8")
  head, loop_start = head_scatter_and_loop_start(rewritten)
  assert any(c.end_s <= loop_start for c in head), [(c.name, c.start_s, c.end_s) for c in head]
  as_written = jax_overlap.analyze(fn, *args, target="h100x8")
  head, loop_start = head_scatter_and_loop_start(as_written)
  assert all(c.start_s >= loop_start for c in head)


@pytest.mark.parametrize("mode", [None, "clip"])
@pytest.mark.parametrize("sharded", ["rows", "columns"])
def test_rows_looked_up_where_held_equal_the_gathered_tables(mode, sharded):
  """A lookup in an all-gathered table and its reduce-scattered gradient, rewritten to look
  rows up where they are held (a table sharded by rows: rows reduce-scattered; by columns:
  exchanged all-to-all): the same rows and gradient bit for bit, ids outside the table
  (filled or clipped rows, dropped or clipped updates) and ids repeated across devices
  included."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  vocab, hidden = 32768, 128  # 16 MiB: the cost model moves the rows instead
  dim = 0 if sharded == "rows" else 1
  spec = P("fsdp") if dim == 0 else P(None, "fsdp")
  table = jax.device_put(
    jax.random.normal(jax.random.key(0), (vocab, hidden)), NamedSharding(mesh, spec)
  )
  sh = NamedSharding(mesh, P("fsdp"))
  ids = np.array(jax.random.randint(jax.random.key(1), (8, 5), 0, 6))
  ids[0, 0], ids[1, 1], ids[2, 2] = vocab + 2, -vocab - 3, vocab - 1  # outside, outside, last
  ids = jax.device_put(ids, sh)
  ct = jax.device_put(jax.random.normal(jax.random.key(2), (8, 5, hidden)), sh)

  def body(t, i, c):
    full = jax.lax.all_gather(t, "fsdp", axis=dim, tiled=True)
    rows, pull = jax.vjp(lambda f: jnp.take(f, i, axis=0, mode=mode), full)
    (g,) = pull(c)
    return rows, jax.lax.psum_scatter(g, "fsdp", scatter_dimension=dim, tiled=True)

  step = jax.shard_map(
    body, mesh=mesh, in_specs=(spec, P("fsdp"), P("fsdp")), out_specs=(P("fsdp"), spec)
  )
  ov = jax_overlap.overlap(step, target="h100x8", select="rewrite", cache=False)
  found = ov.explain(table, ids, ct).of_kind("embedding")
  assert len(found) == 2, found
  if dim:
    assert all("all-to-all" in a.detail for a in found), found
  (rows_a, grad_a), (rows_b, grad_b) = jax.jit(step)(table, ids, ct), ov(table, ids, ct)
  if mode is None:  # filled with NaN
    assert np.isnan(np.asarray(rows_a)[0, 0]).all()
  np.testing.assert_array_equal(np.asarray(rows_a), np.asarray(rows_b))
  np.testing.assert_array_equal(np.asarray(grad_a), np.asarray(grad_b))
  # The rewritten step moves no table (the step as written does): compiled HLO's collectives.
  table_type = f"f32[{vocab},{hidden}]"

  def table_collectives(compiled):
    return [
      line
      for line in compiled.as_text().splitlines()
      if table_type in line and ("all-gather" in line or "reduce-scatter" in line)
    ]

  assert table_collectives(jax.jit(step).lower(table, ids, ct).compile())
  assert not table_collectives(ov.lower(table, ids, ct).compile())


def test_a_small_table_is_gathered_as_written():
  """Where the table's all-gather is cheaper than moving the activations (by the cost
  model), the lookup is left as written."""
  fn, args = L.build(
    "h100x8", layers=1, hidden=256, mlp=512, heads=4, kv_heads=2, vocab=512, seq=2048
  )
  e = jax_overlap.overlap(fn, target="h100x8", select="rewrite", cache=False).explain(*args)
  assert not e.of_kind("embedding") and e.of_kind("gather_timing")


def test_a_table_also_used_as_the_output_projection_is_gathered():
  """Tied embeddings: the gathered table is also the output projection's weight, and its
  gradient sums both uses; the lookup is left as written (the table is needed whole)."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  vocab, hidden = 32768, 128
  sh = NamedSharding(mesh, P("fsdp"))
  table = jax.device_put(jax.random.normal(jax.random.key(0), (vocab, hidden)) * 0.02, sh)
  ids = jax.device_put(jax.random.randint(jax.random.key(1), (8, 4), 0, vocab), sh)

  def loss(t, i):
    full = jax.lax.all_gather(t, "fsdp", axis=0, tiled=True)
    x = jnp.take(full, i, axis=0)
    return jax.lax.psum(jnp.mean(jax.nn.logsumexp(x @ full.T, axis=-1)), "fsdp")

  def step(t, i):
    value, grad = jax.value_and_grad(
      jax.shard_map(loss, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P())
    )(t, i)
    return t - 0.1 * grad, value

  ov = jax_overlap.overlap(step, target="h100x8", select="rewrite", cache=False)
  assert not ov.explain(table, ids).of_kind("embedding")
  for a, b in zip(jax.jit(step)(table, ids), ov(table, ids)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_scatter_add_into_a_nonzero_table_is_reduce_scattered_as_written():
  """Only autodiff's scatter-add into a zero table is computed where the rows are held: a
  scatter-add into other values (here a table of ones) keeps its reduce-scatter."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  vocab, hidden = 32768, 128
  sh = NamedSharding(mesh, P("fsdp"))
  table = jax.device_put(jax.random.normal(jax.random.key(0), (vocab, hidden)), sh)
  ids = jax.device_put(jax.random.randint(jax.random.key(1), (8, 5), 0, 6), sh)
  upd = jax.device_put(jax.random.normal(jax.random.key(2), (8, 5, hidden)), sh)

  def body(t, i, u):  # an update of `t` by a gradient-shaped reduce-scatter
    base = jnp.ones((vocab, hidden), jnp.float32)
    g = base.at[i].add(u, mode="drop")
    return t - 0.5 * jax.lax.psum_scatter(g, "fsdp", scatter_dimension=0, tiled=True)

  step = jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"),) * 3, out_specs=P("fsdp"))
  ov = jax_overlap.overlap(step, target="h100x8", select="rewrite", cache=False)
  assert not ov.explain(table, ids, upd).of_kind("embedding")
  np.testing.assert_array_equal(
    np.asarray(jax.jit(step)(table, ids, upd)), np.asarray(ov(table, ids, upd))
  )
