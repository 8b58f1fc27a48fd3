"""Tests for @jax_overlap.overlap: same numbers, real rewrites, annotations in the GPU HLO."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap.examples import shard_map_fsdp as S


def _mesh(shape):
  names = ("fsdp",) if len(shape) == 1 else ("fsdp", "tensor")
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _setup(form="unrolled", layers=3, hidden=64, mlp=128, dtype="float32", mesh_shape=(8,)):
  mesh = _mesh(mesh_shape)
  cfg = S.Config(
    layers=layers, hidden=hidden, mlp=mlp, heads=4, seq=8, dtype=dtype, form=form, learning_rate=0.1
  )
  params = S.init_params(cfg, mesh, jax.random.key(0))
  x = jax.device_put(
    jax.random.normal(jax.random.key(1), (8, 8, hidden)).astype(dtype),
    NamedSharding(mesh, P(tuple(mesh.axis_names))),
  )
  return cfg, mesh, params, x


def _run(step, params, x, n=3):
  losses = []
  for _ in range(n):
    params, loss = step(params, x)
    losses.append(float(loss))
  return params, losses


@pytest.mark.slow
@pytest.mark.xla_default_cpu_emitters  # bit for bit under XLA's own code generation
@pytest.mark.parametrize("form", ["unrolled", "scan", "scan_layers"])
@pytest.mark.parametrize("mesh_shape", [(8,), (4, 2)])
def test_same_losses_and_parameters_over_three_steps(form, mesh_shape):
  cfg, mesh, params, x = _setup(form, mesh_shape=mesh_shape)
  step = S.make_step(cfg, mesh)
  p1, l1 = _run(jax.jit(step), params, x)
  p2, l2 = _run(jax_overlap.overlap(step, prefetch=1), params, x)
  # Only the order of operations changes, never the arithmetic.
  assert l1 == l2
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  layers=st.integers(1, 4),
  hidden=st.sampled_from([32, 64]),
  dtype=st.sampled_from(["float32", "bfloat16"]),
  prefetch=st.integers(0, 2),
  mesh_shape=st.sampled_from([(8,), (4, 2)]),
  form=st.sampled_from(["unrolled", "scan"]),
)
def test_property_rewrite_matches_plain_jit(layers, hidden, dtype, prefetch, mesh_shape, form):
  cfg, mesh, params, x = _setup(
    form, layers=layers, hidden=hidden, mlp=2 * hidden, dtype=dtype, mesh_shape=mesh_shape
  )
  step = S.make_step(cfg, mesh)
  prefetch = min(prefetch, layers)
  p1, l1 = _run(jax.jit(step), params, x, n=2)
  p2, l2 = _run(jax_overlap.overlap(step, prefetch=prefetch), params, x, n=2)
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    # Sums reassociated by the pipelined collectives differ in their last bits, which is
    # more than rtol where they cancel to near zero: the tolerance is scaled to the array.
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(a).max()))


def test_explain_lists_prefetch_reduce_scatter_and_options():
  cfg, mesh, params, x = _setup("unrolled", layers=4)
  ov = jax_overlap.overlap(S.make_step(cfg, mesh), prefetch=1)
  e = ov.explain(params, x)
  (prefetched,) = e.of_kind("prefetch")  # one body, its gathers issued by time
  timing = e.of_kind("gather_timing")
  n_gathers = 4 * 7  # the seven matrices of each of 4 layers (norm scales are replicated)
  assert len(timing) == n_gathers and f"{n_gathers} parameter all-gather(s)" in prefetched.detail
  # Layer 0's first weight has nothing before it; later layers' are tied after earlier
  # compute (this model is small: on h100x8 most of its gathers outlast its matmuls).
  assert "issued at the start" in timing[0].detail
  later = [a.detail for a in timing[7:]]
  assert all("hides under" in d for d in later)
  assert any("after equation" in d for d in later), later
  # On CPU devices nothing reads the annotations; "auto" leaves them off.
  assert not e.of_kind("annotate")
  assert (
    jax_overlap.overlap(S.make_step(cfg, mesh), annotate=True)
    .explain(params, x)
    .of_kind("annotate")
  )
  opts = e.xla_options
  assert opts["xla_gpu_all_gather_combine_threshold_bytes"] > 0
  assert opts["xla_gpu_reduce_scatter_combine_threshold_bytes"] > 0
  assert "prefetch" in str(e)


def test_auto_annotations_when_compiled_for_a_gpu_without_a_target():
  fn, args = S.build("h100x8", layers=2, hidden=1024, mlp=2816, heads=8, seq=512)
  ov = jax_overlap.overlap(fn)  # no target: the arguments' devices decide
  report = jax_overlap.analyze(ov, *args, target="h100x8")
  assert any("_jax_overlap_priority" in c.annotations for c in report.collectives)
  with pytest.raises(ValueError, match="annotate must be True, False or 'auto'"):
    jax_overlap.overlap(fn, annotate="yes")


def test_prefetch_zero_moves_nothing():
  cfg, mesh, params, x = _setup("unrolled", layers=3)
  e = jax_overlap.overlap(S.make_step(cfg, mesh), prefetch=0).explain(params, x)
  assert e.of_kind("prefetch") == []


def test_annotations_reach_the_compiled_gpu_hlo():
  fn, args = S.build("h100x8", layers=2, hidden=1024, mlp=2816, heads=8, seq=512)
  ov = jax_overlap.overlap(fn, target="h100x8", select="rewrite")
  report = jax_overlap.analyze(ov, *args, target="h100x8")
  tagged = [c for c in report.collectives if "_jax_overlap_priority" in c.annotations]
  assert tagged, [c.annotations for c in report.collectives]
  assert all(c.annotations["_jax_overlap_priority"] == "high" for c in tagged)
  # Combiners join pair ids with commas; every id is one the transform assigned.
  for c in tagged:
    for pair in c.annotations["_jax_overlap_pair"].split(","):
      assert pair.startswith(("g", "op"))
  # The compile saw the transform's options.
  assert report.xla_options["xla_gpu_all_gather_combine_threshold_bytes"] > 0


@pytest.mark.slow
def test_cost_model_choice_is_never_worse_than_the_flags_alone():
  # The step test_selection_cache.py and the quickstart notebook choose for too (the
  # session's compile store shares XLA's results between them).
  fn, args = S.build("h100x8", layers=2, hidden=1024, mlp=2816, heads=8, seq=512)
  ov = jax_overlap.overlap(fn, target="h100x8")
  e = ov.explain(*args)
  times = dict(e.candidates)
  assert "as written, recommended flags" in times
  assert times[e.chosen] == min(times.values())
  # A few are also tried scheduled from the cost model's own estimates: the fastest first,
  # then those with the least compute (the rule: test_latency_profiles_go_to_the_fastest_...).
  from jax_overlap._src.transform import search

  suffix = ", scheduled by the cost model's estimates"
  profiled = [n[: -len(suffix)] for n in times if n.endswith(suffix)]
  plain = sorted((t, n) for n, t in times.items() if not n.endswith(suffix))
  assert 1 <= len(profiled) <= search.PROFILED_VARIANTS
  assert set(profiled) <= {n for _, n in plain}
  assert profiled[0] == plain[0][1]
  off = jax_overlap.overlap(fn, target="h100x8", schedule_from_estimates=False).explain(*args)
  assert not any("scheduled by" in n for n, _ in off.candidates)
  with pytest.raises(TypeError, match="schedule_from_estimates must be True or False"):
    jax_overlap.overlap(fn, schedule_from_estimates="yes")
  chosen = jax_overlap.analyze(ov, *args, target="h100x8")
  flags_only = jax_overlap.analyze(
    fn, *args, target="h100x8", xla_options=jax_overlap.flags.as_compiler_options(target="h100x8")
  )
  assert chosen.step_time_s <= flags_only.step_time_s * (1 + 1e-9)
  # The decorated step, compiled anew, is the variant the selection reported choosing.
  assert chosen.step_time_s == pytest.approx(times[e.chosen], rel=1e-6)


def test_gspmd_program_gets_options_and_a_note():
  mesh = _mesh((8,))
  w = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("fsdp")))

  def step(w, x):
    return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

  ov = jax_overlap.overlap(step, target="h100x8")
  x = jnp.ones((16, 64))
  np.testing.assert_allclose(np.asarray(ov(w, x)), np.asarray(jax.jit(step)(w, x)), rtol=1e-6)
  e = ov.explain(w, x)
  assert any("the SPMD partitioner inserts its collectives" in n for n in e.notes)
  # Its shard_map form is among the variants: the weight gathered at its use (x is
  # replicated, so every device computes the whole gradient, as the partitioner does).
  (conv,) = [n for n in e.notes if n.startswith("converted to shard_map")]
  assert conv.endswith("inserted 1 all-gather")
  assert e.xla_options["xla_gpu_enable_latency_hiding_scheduler"] is True
  never = jax_overlap.overlap(step, target="h100x8", gspmd="as_written", cache=False)
  assert any("needs shard_map" in n for n in never.explain(w, x).notes)


def test_grad_of_a_decorated_function_and_lower():
  cfg, mesh, params, x = _setup("unrolled", layers=2)
  loss = S.make_loss(cfg, mesh)
  ov_loss = jax_overlap.overlap(loss)
  g1 = jax.jit(jax.grad(loss))(params, x)
  g2 = jax.jit(jax.grad(ov_loss))(params, x)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  text = ov_loss.lower(params, x).as_text()
  assert "all_gather" in text or "all-gather" in text


def test_priority_context_manager_tags_hlo():
  mesh = _mesh((8,))

  def body(w):
    with jax_overlap.priority("low"):
      g = jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)
    return g * 2

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=P(), check_vma=False))
  text = f.lower(jnp.ones((16, 4))).as_text()
  assert '_jax_overlap_priority = "low"' in text or '_jax_overlap_priority="low"' in text
  with pytest.raises(
    ValueError, match="priority: level must be one of high, normal, low, got 'urgent'"
  ):
    jax_overlap.priority("urgent")


def test_bad_input():
  cfg, mesh, params, x = _setup("unrolled", layers=2)
  step = S.make_step(cfg, mesh)
  with pytest.raises(ValueError, match="prefetch must be a non-negative integer, got -1"):
    jax_overlap.overlap(step, prefetch=-1)
  with pytest.raises(
    ValueError, match=r"prefetch must be between 0 and the number of layers \(2\), got 5"
  ):
    jax_overlap.overlap(step, prefetch=5)(params, x)
  with pytest.raises(TypeError, match=r"argument args\[1\] is a str, not an array"):
    jax_overlap.overlap(step)(params, "tokens")
  other = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  with pytest.raises(
    ValueError, match=r"uses mesh axes \['fsdp'\] that mesh= \{'data': 8\} does not have"
  ):
    jax_overlap.overlap(step, mesh=other)(params, x)
  with pytest.raises(ValueError, match="unknown target 'q100x8'"):
    jax_overlap.overlap(step, target="q100x8")
  with pytest.raises(ValueError, match="reduce_scatter must be 'per_layer' or 'as_written'"):
    jax_overlap.overlap(step, reduce_scatter="end")
  with pytest.raises(ValueError, match="select must be 'cost_model', 'measure' or 'rewrite'"):
    jax_overlap.overlap(step, select="best")
  with pytest.raises(TypeError, match="expected a function, got int"):
    jax_overlap.overlap(3)


def test_indivisible_shapes_are_named():
  mesh = _mesh((8,))
  # A sharding that cannot be realised: 12 rows over 8 devices.
  bad = jax.ShapeDtypeStruct((12, 4), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
  with pytest.raises(
    ValueError, match=r"argument args\[0\] has dimension 0 of size 12, not divisible"
  ):
    jax_overlap.overlap(lambda a: a * 2).explain(bad)


def test_collectives_in_loops_are_pipelined_and_sized_per_layer():
  cfg, mesh, params, x = _setup("scan", layers=2)
  e = jax_overlap.overlap(S.make_step(cfg, mesh)).explain(params, x)
  assert any("lax.scan" in a.where and "7 all-gather(s)" in a.detail for a in e.of_kind("prefetch"))
  assert any(
    "lax.scan" in a.where and "7 gradient reduce-scatter(s)" in a.detail
    for a in e.of_kind("reduce_scatter")
  )
  # One iteration gathers one layer (4 h x h and 3 h x mlp float32 matrices):
  # the combine threshold lets one layer's gathers merge, not two layers'.
  layer_bytes = (4 * 64 * 64 + 3 * 64 * 128) * 4
  assert e.xla_options["xla_gpu_all_gather_combine_threshold_bytes"] == layer_bytes
  assert e.xla_options["xla_gpu_reduce_scatter_combine_threshold_bytes"] == layer_bytes // 8


def _tp_step():
  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(AxisType.Auto,))

  def body(x, w1, w2):
    h = jax.nn.gelu(jax.lax.all_gather(x, "tensor", axis=0, tiled=True) @ w1)
    return jax.lax.psum_scatter(h @ w2, "tensor", scatter_dimension=0, tiled=True)

  f = jax.shard_map(
    body, mesh=mesh, in_specs=(P("tensor"), P(None, "tensor"), P("tensor")), out_specs=P("tensor")
  )
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.normal(size=(64, 32)).astype(np.float32), NamedSharding(mesh, P("tensor")))
  w1 = jax.device_put(
    rng.normal(size=(32, 128)).astype(np.float32) * 0.1, NamedSharding(mesh, P(None, "tensor"))
  )
  w2 = jax.device_put(
    rng.normal(size=(128, 32)).astype(np.float32) * 0.1, NamedSharding(mesh, P("tensor"))
  )
  return f, (x, w1, w2)


@pytest.mark.parametrize("method", ["ring", "pieces"])
def test_collective_matmul_decomposition(method):
  f, args = _tp_step()
  ov = jax_overlap.overlap(f, collective_matmul=method)
  e = ov.explain(*args)
  kinds = [a.detail for a in e.of_kind("collective_matmul")]
  assert any("all-gather -> matmul (64x32 @ 32x16)" in d for d in kinds)
  how = "decomposed into a" if method == "ring" else "issued as "
  assert sum(how in d for d in kinds) == 2, kinds
  assert any("-> reduce-scatter " + how in d for d in kinds)
  counts = [int(m) for d in kinds for m in re.findall(r"issued as (\d+) chained", d)]
  np.testing.assert_allclose(
    np.asarray(ov(*args)), np.asarray(jax.jit(f)(*args)), rtol=1e-6, atol=1e-6
  )
  text = ov.lower(*args).as_text()
  if method == "ring":
    assert "collective_permute" in text
  else:  # the pieces' all-gathers and reduce-scatters, no send/recv
    assert "collective_permute" not in text and len(counts) == 2 and min(counts) >= 2
    assert text.count("all_gather") >= counts[0] and text.count("reduce_scatter") >= counts[1]
  # Gradients through the rings match too.
  loss = lambda *a: jnp.sum(f(*a) ** 2)
  g1 = jax.jit(jax.grad(loss, argnums=(1, 2)))(*args)
  g2 = jax.jit(jax.grad(lambda *a: jnp.sum(ov(*a) ** 2), argnums=(1, 2)))(*args)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  # "auto" asks the cost model: these matrices are far too small to gain on an H100.
  assert (
    jax_overlap.overlap(f, collective_matmul="auto").explain(*args).of_kind("collective_matmul")
    == []
  )
  assert (
    jax_overlap.overlap(f, collective_matmul="off").explain(*args).of_kind("collective_matmul")
    == []
  )


def test_collectives_issued_one_by_one_on_a_2d_mesh():
  # The variant that ties the first layer's gathers and the reduce-scatters
  # together with optimization barriers passes shard_map's type checks on a
  # 4x2 mesh and gives the same results.
  from jax_overlap._src.transform.evaluate import VariantConfig, evaluate_program

  cfg, mesh, params, x = _setup("unrolled", mesh_shape=(4, 2))
  step = S.make_step(cfg, mesh)
  closed = jax.jit(step).trace(params, x).jaxpr
  chained = VariantConfig(1, "per_layer", False, "off", None, chain=True)
  fn = jax.jit(lambda p, x_: evaluate_program(closed, jax.tree.leaves((p, x_)), chained))
  assert "optimization_barrier" in str(jax.make_jaxpr(fn)(params, x))
  for a, b in zip(jax.tree.leaves(jax.jit(step)(params, x)), fn(params, x)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_first_layer_gathers_chained_in_order_of_first_use():
  # The step's jaxpr gathers a layer's weights in pytree (alphabetical) order:
  # w1, w2, w3, wk, wo, wq, wv. Issued one by one, they go in the order the
  # layer's matmuls need them, so compute starts on wq while the rest arrive.
  from jax_overlap._src.transform import planning
  from jax_overlap._src.transform.evaluate import VariantConfig, evaluate_program

  cfg, mesh, params, x = _setup("unrolled", layers=2)
  closed = jax.jit(S.make_step(cfg, mesh)).trace(params, x).jaxpr
  body = next(e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map").params["jaxpr"]
  names = {v: k for v, k in zip(body.invars, [k for layer in params for k in sorted(layer)])}
  plan = planning.plan_body(body, "", 1, "per_layer", False, chain=True)
  follows = {
    b: a for b, a in plan.chain_prev.items() if body.eqns[b].primitive.name == "all_gather"
  }
  (head,) = set(follows.values()) - set(follows)
  chain = [head]
  by_prev = {a: b for b, a in follows.items()}
  while chain[-1] in by_prev:
    chain.append(by_prev[chain[-1]])
  assert [names[body.eqns[i].invars[0]] for i in chain] == [
    "wq",
    "wk",
    "wv",
    "wo",
    "w1",
    "w3",
    "w2",
  ]
  # The evaluation order puts each gather after the one it waits for, and the
  # results do not change.
  pos = {i: p for p, i in enumerate(plan.order)}
  assert all(pos[a] < pos[b] for b, a in plan.chain_prev.items())
  chained = VariantConfig(1, "per_layer", False, "off", None, chain=True)
  fn = jax.jit(lambda p, x_: evaluate_program(closed, jax.tree.leaves((p, x_)), chained))
  for a, b in zip(jax.tree.leaves(jax.jit(S.make_step(cfg, mesh))(params, x)), fn(params, x)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_topological_order_keeps_dependencies_and_adds_links():
  from jax_overlap._src.transform import planning

  deps = [[], [], [0], [1], [2, 3]]
  # Extra link: 3 must wait for 2 (2 came after 3 in the given order).
  order = planning.topological([0, 1, 3, 2, 4], deps, {3: 2})
  pos = {i: p for p, i in enumerate(order)}
  assert pos[2] < pos[3]
  assert all(pos[d] < pos[i] for i in range(5) for d in deps[i])
  assert planning.topological([1, 0, 2, 3, 4], deps, {}) == [1, 0, 2, 3, 4]
  # A link against a dependency (2 needs 0) closes a cycle: no order.
  assert planning.topological([0, 1, 2, 3, 4], deps, {0: 2}) is None


def test_loop_pipeliner_turned_off_in_either_spelling():
  from jax_overlap._src.transform import variants

  assert variants.pipeliner_off(
    {"xla_gpu_enable_pipelined_all_gather": True, "xla_gpu_enable_pipelined_reduce_scatter": False}
  ) == {"xla_gpu_enable_pipelined_all_gather": False}
  assert variants.pipeliner_off(
    {"xla_gpu_pipeline_all_gather": "on", "xla_gpu_pipeline_reduce_scatter": "off"}
  ) == {"xla_gpu_pipeline_all_gather": "off"}
  assert variants.pipeliner_off({}) == {}


def test_chain_with_a_gather_feeding_another():
  # The first matmul uses a gathered tensor whose gather needs another gathered
  # tensor: that one counts as used by the same matmul, so it stays first, the
  # chain follows the dependency, and the results do not change.
  from jax_overlap._src.transform import planning
  from jax_overlap._src.transform.evaluate import VariantConfig, evaluate_program

  mesh = _mesh((8,))

  def body(a, b, x):
    ga = jax.lax.all_gather(a, "fsdp", tiled=True)
    gb = jax.lax.all_gather(b + ga[: b.shape[0]], "fsdp", tiled=True)
    y = x @ gb
    return jax.lax.psum(y @ ga, "fsdp")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P("fsdp"), P()), out_specs=P()))
  a = jnp.arange(16 * 16, dtype=jnp.float32).reshape(16, 16) / 256
  b = jnp.ones((16, 16), jnp.float32)
  x = jnp.ones((4, 16), jnp.float32)
  closed = f.trace(a, b, x).jaxpr
  body_jaxpr = closed.jaxpr.eqns[0].params["jaxpr"]
  plan = planning.plan_body(body_jaxpr, "", 1, "per_layer", False, chain=True)
  gathers = [i for i, e in enumerate(body_jaxpr.eqns) if e.primitive.name == "all_gather"]
  assert plan.chain_prev == {gathers[1]: gathers[0]}
  chained = VariantConfig(1, "per_layer", False, "off", None, chain=True)
  g = jax.jit(lambda *v: evaluate_program(closed, list(v), chained))
  np.testing.assert_array_equal(np.asarray(f(a, b, x)), np.asarray(g(a, b, x)[0]))


def test_latency_profiles_go_to_the_fastest_then_the_least_compute():
  import types

  from jax_overlap._src.transform import search

  def r(compute):
    return types.SimpleNamespace(compute_time_s=compute)

  times = [10.0, 10.0, 10.9, 12.0, 9.5, float("inf"), 10.5, 11.0]
  reports = [r(8.0), r(8.0), r(7.0), r(9.6), r(9.0), None, r(9.7), r(6.0)]
  # 4 is the fastest; 2 and 0 have the least compute; 1 is 0 again (same estimates);
  # 3's compute alone is longer than the best step; 7, with the least compute, is 16 %
  # behind the best step (more than search.FAR_BEHIND).
  assert search.worth_profiling(times, reports) == [4, 2, 0]
  assert search.worth_profiling([5.0, 6.0], [r(5.0), r(6.0)]) == []
  assert search.worth_profiling([float("inf")], [None]) == []
  # With 4 profiled already (the first pass's fastest), the fastest of the others goes
  # first, passing over those whose estimates equal 4's (the same schedule again): the
  # profiles are not spent on what was tried.
  times = [10.0, 10.0, 10.9, 12.0, 9.5, float("inf"), 10.5, 9.5, 9.8]
  reports = [r(8.0), r(8.0), r(7.0), r(9.6), r(9.0), None, r(9.7), r(9.0), r(9.1)]
  assert search.worth_profiling(times, reports, frozenset({4})) == [8, 2, 0]


def test_a_jitted_step_keeps_its_donation():
  # @overlap re-jits the (rewritten) program: the user's donated arguments stay donated
  # (buffers reused in place), unless donation is given to overlap itself.
  def step(p, x):
    return jax.tree.map(lambda a: a - 0.1 * a.mean(), p), x.sum()

  p = {"b": jnp.ones((64,)), "w": jnp.ones((64, 64))}
  x = jnp.ones((8, 64))

  def donated(f):
    return [a.donated for a in jax.tree.leaves(f.lower(p, x).args_info)]

  assert donated(jax_overlap.overlap(jax.jit(step, donate_argnums=0))) == [True, True, False]
  assert donated(jax_overlap.overlap(jax.jit(step, donate_argnums=0), donate_argnums=1)) == [
    False,
    False,
    True,
  ]
  assert donated(jax_overlap.overlap(step)) == [False, False, False]

  # Called: the donated parameters' buffers are consumed, the batch after them is not
  # (jax numbers a traced step's donation by leaves: passed on as argument positions it
  # donated the batch), also behind a static argument and with donation by name.
  def scaled(k, p, x):
    return step(jax.tree.map(lambda a: a * k, p), x)

  for jitted in (
    jax.jit(step, donate_argnums=0),
    jax.jit(functools.partial(scaled, 2.0), donate_argnames="p"),
  ):
    ov = jax_overlap.overlap(jitted, cache=False)
    params = jax.tree.map(jnp.copy, p)
    ov(params, x)
    assert all(a.is_deleted() for a in jax.tree.leaves(params))
    assert not x.is_deleted()
  ov = jax_overlap.overlap(jax.jit(scaled, static_argnums=0, donate_argnums=1), cache=False)
  params = jax.tree.map(jnp.copy, p)
  ov(3.0, params, x)
  assert all(a.is_deleted() for a in jax.tree.leaves(params)) and not x.is_deleted()


def _static_step(scale, params, x, *, act="tanh", layers=2):
  # A shard_map FSDP step whose static arguments choose the program: the number of
  # layers, the activation's name and a Python scale.
  cfg = S.Config(layers=layers, hidden=64, mlp=128, heads=4, seq=8, learning_rate=0.1)
  return S.make_step(cfg, _mesh((8,)))(params, getattr(jax.nn, act)(x) * scale)


def _positional(params, x, act, scale):
  return _static_step(scale, params, x, act=act)


@pytest.mark.parametrize(
  "how", ["jit static_argnums", "jit static_argnames", "overlap static_argnums", "str positional"]
)
def test_static_arguments_choose_the_program_and_are_not_inputs(how):
  # Static arguments (before the arrays, by keyword, strings) are hashable values that
  # choose the program: not checked as arrays, not passed to the traced program, and
  # kept static by the rewritten step's jit.
  _, _, params, x = _setup("unrolled", layers=2)
  ref, ov, args, kwargs = {
    "jit static_argnums": lambda: (
      jit := jax.jit(_static_step, static_argnums=0, static_argnames=("act", "layers")),
      jax_overlap.overlap(jit, params_argnums=1),
      (2.0, params, x),
      {"layers": 2},
    ),
    "jit static_argnames": lambda: (
      jit := jax.jit(_static_step, static_argnames=("scale", "act", "layers")),
      jax_overlap.overlap(jit, params_argnums=1),
      (),
      {"scale": 0.5, "params": params, "x": x, "act": "relu"},
    ),
    "overlap static_argnums": lambda: (
      jax.jit(_static_step, static_argnums=0, static_argnames="act"),
      jax_overlap.overlap(_static_step, params_argnums=1, static_argnums=0, static_argnames="act"),
      (3.0, params, x),
      {"act": "gelu"},
    ),
    "str positional": lambda: (
      jit := jax.jit(_positional, static_argnums=(2, 3)),
      jax_overlap.overlap(jit),
      (params, x, "relu", 2.0),
      {},
    ),
  }[how]()
  (p1, l1), (p2, l2) = ref(*args, **kwargs), ov(*args, **kwargs)
  assert float(l1) == float(l2)
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The FSDP rewrite still applies: the static arguments shift no parameter position.
  assert "prefetch" in {a.kind for a in ov.explain(*args, **kwargs).actions}


def test_static_arguments_of_a_gspmd_step_for_a_target():
  # Deviceless for h100x8, abstract arrays: the GSPMD step's variants, its shard_map form
  # included, are built with the static arguments kept out of the program.
  mesh = _mesh((8,))
  w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
  x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P()))

  def step(layers, w, x, act):
    def loss(w):
      h = x
      for _ in range(layers):
        h = getattr(jax.nn, act)(h @ w)
      return jnp.sum(h)

    return jax.grad(loss)(w)

  ov = jax_overlap.overlap(jax.jit(step, static_argnums=(0, 3)), target="h100x8", params_argnums=1)
  e = ov.explain(2, w, x, "relu")
  (conv,) = [n for n in e.notes if n.startswith("converted to shard_map")]
  assert "all-gather" in conv
  report = jax_overlap.analyze(ov, 2, w, x, "relu", target="h100x8")
  assert report.step_time_s > 0 and report.collectives
  # Not marked static: the error names the argument and the way to mark it.
  with pytest.raises(TypeError, match=r"argument args\[2\] is a str, not an array.*static"):
    jax_overlap.overlap(step, params_argnums=1)(2, jnp.ones((64, 64)), "relu", jnp.ones((16, 64)))
