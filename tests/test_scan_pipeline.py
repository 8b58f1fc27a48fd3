"""@overlap pipelines the collectives of the user's own lax.scan over layers."""

import jax
import jax.extend
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap._src.flags.validation import version_tuple
from jax_overlap._src.transform import scan_pipeline

POLICIES = {
  "none": None,
  "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
  "dots_saveable": jax.checkpoint_policies.dots_saveable,
  "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


def _model(mesh, layers, hidden, policy, cast, reverse=False):
  """A user's FSDP step: stacked f32 weights sharded over ``fsdp``, a scanned layer that
  gathers its weights (cast to the compute dtype first when ``cast``), under jax.checkpoint
  with ``policy``; SGD on the gradients."""
  fsdp = "fsdp"

  def layer(x, w):
    w1, w2 = w
    if cast:
      w1, w2 = w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16)
    g1 = jax.lax.all_gather(w1, fsdp, axis=0, tiled=True)
    g2 = jax.lax.all_gather(w2, fsdp, axis=1, tiled=True)
    h = jnp.tanh(x.astype(g1.dtype) @ g1) @ g2
    return (x + h.astype(x.dtype)), None

  if policy != "none":
    layer = jax.checkpoint(layer, policy=POLICIES[policy])

  def loss(params, x):
    def body(params, x):
      y, _ = jax.lax.scan(layer, x, params, reverse=reverse)
      return jax.lax.psum(jnp.mean(y**2), mesh.axis_names) / mesh.size

    specs = (P(None, fsdp), P(None, None, fsdp))
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(mesh.axis_names)), out_specs=P())(
      params, x
    )

  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), value

  k1, k2, k3 = jax.random.split(jax.random.key(layers * 7 + hidden), 3)
  w1 = jax.random.normal(k1, (layers, hidden, hidden)) / hidden**0.5
  w2 = jax.random.normal(k2, (layers, hidden, hidden)) / hidden**0.5
  params = (
    jax.device_put(w1, NamedSharding(mesh, P(None, "fsdp"))),
    jax.device_put(w2, NamedSharding(mesh, P(None, None, "fsdp"))),
  )
  x = jax.device_put(
    jax.random.normal(k3, (mesh.size * 2, hidden)), NamedSharding(mesh, P(mesh.axis_names))
  )
  return step, params, x


def _mesh(shape):
  names = ("fsdp", "data")[: len(shape)]
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _steps(step, params, x, n=3):
  losses = []
  for _ in range(n):
    params, loss = step(params, x)
    losses.append(float(loss))
  return params, losses


@pytest.mark.xla_default_cpu_emitters  # bit for bit under XLA's own code generation
@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  layers=st.integers(2, 5),
  hidden=st.sampled_from([16, 32]),
  policy=st.sampled_from(sorted(POLICIES)),
  cast=st.booleans(),
  mesh_shape=st.sampled_from([(8,), (4, 2)]),
  reverse=st.booleans(),
  prefetch=st.integers(1, 3),
)
def test_pipelined_scan_is_bit_identical(
  layers, hidden, policy, cast, mesh_shape, reverse, prefetch
):
  mesh = _mesh(mesh_shape)
  step, params, x = _model(mesh, layers, hidden, policy, cast, reverse)
  ov = jax_overlap.overlap(step, prefetch=prefetch)
  e = ov.explain(params, x)
  # The forward loop's gathers move early (prefetch iterations, at most layers - 1), the
  # backward loop's reduce-scatters late.
  depth = max(1, min(prefetch, layers - 1))
  early = "one iteration early" if depth == 1 else f"{depth} iterations early"
  assert any(early in a.detail for a in e.of_kind("prefetch")), str(e)
  assert any("issued one iteration late" in a.detail for a in e.of_kind("reduce_scatter")), str(e)
  # With loop iterations to spare, the first and last iterations run outside the loop.
  peeled = [a for a in e.actions if "runs before the loop" in a.detail]
  assert bool(peeled) == (layers - 2 > depth), str(e)
  p_ref, l_ref = _steps(jax.jit(step), params, x)
  p_ov, l_ov = _steps(ov, params, x)
  if version_tuple(jaxlib.__version__) < (0, 11):
    assert l_ref == l_ov
    for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(p_ov)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  else:
    # On XLA:CPU 0.11 some float32 results differ from the step as written in the last
    # bit (a loss of 1.82146573 against 1.82146585 at the second step).
    np.testing.assert_allclose(l_ov, l_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(p_ov)):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_plan_reports_what_it_moves_and_why_not():
  mesh = _mesh((8,))
  step, params, x = _model(mesh, 3, 16, "nothing_saveable", cast=True)
  closed = jax.jit(step).trace(params, x).jaxpr
  scans = []

  def walk(jx):
    for e in jx.eqns:
      if e.primitive.name == "scan":
        scans.append(e)
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        walk(sub)

  walk(closed.jaxpr)
  plans = [scan_pipeline.plan(e) for e in scans]
  # Forward: two gathers, each of a cast of its slice; backward (remat): the same two
  # gathers again and two reduce-scatters into the stacked gradients.
  assert sorted((len(p.gathers), len(p.scatters)) for p in plans) == [(2, 0), (2, 2)]
  for p in plans:
    for g in p.gathers:
      pos, chain = p.chains[g]
      assert chain, "the cast to bf16 is part of the gather's input"
  off = [scan_pipeline.plan(e, gathers=False, scatters=False) for e in scans]
  assert all(not p and "no all-gather" in p.reason for p in off)
  # prefetch=0 and reduce_scatter="as_written" keep the loop as written, and say why.
  e = jax_overlap.overlap(step, prefetch=0, reduce_scatter="as_written").explain(params, x)
  kept = [a.detail for a in e.of_kind("left_alone") if "lax.scan" in a.where]
  assert kept and all("keep collectives where written" in d for d in kept)


def test_one_iteration_scan_is_left_alone():
  mesh = _mesh((8,))
  step, params, x = _model(mesh, 1, 16, "none", cast=False)
  e = jax_overlap.overlap(step).explain(params, x)
  assert any("1 iteration(s)" in a.detail for a in e.of_kind("left_alone")), str(e)
  p_ref, _ = _steps(jax.jit(step), params, x, n=1)
  p_ov, _ = _steps(jax_overlap.overlap(step), params, x, n=1)
  for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(p_ov)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_scanned_fsdp_step_hides_its_loop_collectives_on_h100():
  from jax_overlap.examples import shard_map_fsdp as S

  fn, args = S.build("h100x8", form="scan", layers=4, hidden=1024, mlp=2816, heads=8, seq=1024)
  # Without XLA's own loop pipeliner, so the two are compared on the loop as written
  # (given as overrides: the result spells them as the installed jaxlib takes them).
  pipeliner = ("all_gather", "reduce_scatter", "all_reduce")
  options = jax_overlap.flags.as_compiler_options(
    target="h100x8", xla_options={f"xla_gpu_enable_pipelined_{k}": False for k in pipeliner}
  )
  for k in pipeliner:
    off = (options.get(f"xla_gpu_enable_pipelined_{k}"), options.get(f"xla_gpu_pipeline_{k}"))
    assert off in ((False, None), (None, "COLLECTIVE_PIPELINING_MODE_OFF")), (k, off)
  plain = jax_overlap.analyze(fn, *args, target="h100x8", xla_options=options)
  ov = jax_overlap.overlap(fn, target="h100x8", select="rewrite", xla_options=options)
  piped = jax_overlap.analyze(ov, *args, target="h100x8")
  assert piped.exposed_comm_s < 0.5 * plain.exposed_comm_s
  assert piped.step_time_s < plain.step_time_s


@pytest.mark.slow
def test_budget_memory_counts_the_carried_layers():
  # XLA's buffer assignment of the pipelined step, read by budget.memory: one gathered layer
  # carried through the loops, and one unscattered layer gradient in the backward loop;
  # prefetch=2 carries a second gathered layer. Three layers: no iteration is peeled.
  from jax_overlap.budget import memory
  from jax_overlap.examples import shard_map_fsdp as S

  hidden, mlp = 512, 1408
  fn, args = S.build(
    "h100x8", form="scan_remat", layers=3, hidden=hidden, mlp=mlp, heads=8, seq=512
  )
  layer = (4 * hidden * hidden + 3 * hidden * mlp) * 2  # one gathered bf16 layer
  plain = memory.breakdown(fn, *args, target="h100x8")
  grown = {}
  for prefetch in (1, 2):
    ov = jax_overlap.overlap(fn, target="h100x8", select="rewrite", prefetch=prefetch)
    piped = memory.breakdown(ov, *args, target="h100x8")
    grown[prefetch] = (piped.total_bytes - plain.total_bytes) / layer
    if prefetch == 1:
      assert piped.categories["gathered_weights"] >= layer
  # At least the carried gathered layer; XLA 0.10 also keeps the unscattered gradient
  # live at the peak (2.3 layers), XLA 0.11 places it off the peak (1.3).
  assert 1 <= grown[1] <= 3, grown
  assert 0.9 <= grown[2] - grown[1] <= 2, grown


def _check_pipelined_and_bit_identical(step, params, x):
  """The forward and rematerialized loops prefetch, the backward loop reduce-scatters late,
  and three decorated steps give the undecorated step's losses and parameters exactly."""
  ov = jax_overlap.overlap(step)
  e = ov.explain(params, x)
  assert len(e.of_kind("prefetch")) == 2 and len(e.of_kind("reduce_scatter")) == 1, str(e)
  p_ref, l_ref = _steps(jax.jit(step), params, x)
  p_ov, l_ov = _steps(ov, params, x)
  assert l_ref == l_ov
  for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(p_ov)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.xla_default_cpu_emitters  # bit for bit under XLA's own code generation
def test_flax_nn_scan_with_remat_is_pipelined_and_bit_identical():
  # A Flax Linen model as FSDP users write it under shard_map: nn.scan over nn.remat of a
  # block whose parameters nn.map_variables gathers on the way in.
  import flax.linen as nn

  layers, hidden = 3, 32
  mesh = _mesh((8,))

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      h = nn.Dense(hidden, use_bias=False)(x)
      return x + nn.Dense(hidden, use_bias=False)(jnp.tanh(h)), None

  def gather(tree):
    return jax.tree.map(lambda p: jax.lax.all_gather(p, "fsdp", axis=0, tiled=True), tree)

  scan = dict(variable_axes={"params": 0}, split_rngs={"params": True}, length=layers)
  stack = nn.scan(
    nn.remat(nn.map_variables(Block, "params", trans_in_fn=gather, init=True)), **scan
  )
  params = nn.scan(Block, **scan)().init(jax.random.key(0), jnp.zeros((4, hidden)), None)["params"]
  params = jax.tree.map(lambda p: jax.device_put(p, NamedSharding(mesh, P(None, "fsdp"))), params)
  x = jax.device_put(
    jax.random.normal(jax.random.key(1), (16, hidden)), NamedSharding(mesh, P("fsdp"))
  )

  def loss(params, x):
    def body(params, x):
      y, _ = stack().apply({"params": params}, x, None)
      return jax.lax.psum(jnp.mean(y**2), "fsdp") / 8

    spec = jax.tree.map(lambda _: P(None, "fsdp"), params)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, P("fsdp")), out_specs=P())(params, x)

  def step(params, x):
    v, g = jax.value_and_grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), v

  _check_pipelined_and_bit_identical(step, params, x)


@pytest.mark.xla_default_cpu_emitters  # bit for bit under XLA's own code generation
def test_flax_nnx_scan_with_remat_is_pipelined_and_bit_identical():
  # A Flax NNX model: blocks stacked by nnx.vmap, run by nnx.scan over nnx.remat, each
  # block gathering its own FSDP-sharded weights, under shard_map on the split state.
  from flax import nnx

  layers, hidden = 3, 32
  mesh = _mesh((8,))

  class Block(nnx.Module):
    def __init__(self, rngs):
      init = nnx.initializers.lecun_normal()
      self.w1 = nnx.Param(init(rngs.params(), (hidden, hidden)))
      self.w2 = nnx.Param(init(rngs.params(), (hidden, hidden)))

    def __call__(self, x):
      w1 = jax.lax.all_gather(self.w1[...], "fsdp", axis=0, tiled=True)
      w2 = jax.lax.all_gather(self.w2[...], "fsdp", axis=0, tiled=True)
      return x + jnp.tanh(x @ w1) @ w2

  @nnx.split_rngs(splits=layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return Block(rngs)

  graphdef, state = nnx.split(make(nnx.Rngs(0)))
  state = jax.tree.map(lambda p: jax.device_put(p, NamedSharding(mesh, P(None, "fsdp"))), state)
  x = jax.device_put(
    jax.random.normal(jax.random.key(1), (16, hidden)), NamedSharding(mesh, P("fsdp"))
  )

  def forward(state, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return nnx.remat(lambda b, x: b(x))(block, x)

    return run(x, nnx.merge(graphdef, state))

  def loss(state, x):
    def body(state, x):
      return jax.lax.psum(jnp.mean(forward(state, x) ** 2), "fsdp") / 8

    spec = jax.tree.map(lambda _: P(None, "fsdp"), state)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, P("fsdp")), out_specs=P())(state, x)

  def step(state, x):
    v, g = jax.value_and_grad(loss)(state, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, state, g), v

  _check_pipelined_and_bit_identical(step, state, x)
