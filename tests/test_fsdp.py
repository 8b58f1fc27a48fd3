"""Tests for jax_overlap.fsdp.scan_layers: values, gradients, errors and the GPU schedule."""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap import ConfigError
from jax_overlap._src.flags import aborts
from jax_overlap.fsdp import scan_layers

shard_map = jax.shard_map if hasattr(jax, "shard_map") else None
if shard_map is None:  # pragma: no cover - older jax
  from jax.experimental.shard_map import shard_map


def _mesh(shape=(8,), names=("fsdp",)):
  return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _params(key, num_layers, width, dtype):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "w": (jax.random.normal(k1, (num_layers, width, width)) / np.sqrt(width)).astype(dtype),
    "b": (0.1 * jax.random.normal(k2, (num_layers, width))).astype(dtype),
    "s": (1.0 + 0.1 * jax.random.normal(k3, (num_layers, width))).astype(dtype),
  }


def _layer(p, c):
  h = jnp.tanh(c @ p["w"] + p["b"]) * p["s"]
  return c + h, jnp.sum(h * h, axis=-1)


def _gather_tree(p, dims, axis):
  return jax.tree.map(
    lambda x, d: x if d is None else lax.all_gather(x, axis, axis=d, tiled=True), p, dims
  )


def _reference(layer, p, c, dims, axis="fsdp"):
  def body(c, pl):
    return layer(_gather_tree(pl, dims, axis), c)

  return lax.scan(body, c, p)


def _specs(dims, axis="fsdp", extra=None):
  def spec(d):
    if d is None:
      return P()
    return P(*([None] * (d + 1)), axis)

  out = jax.tree.map(spec, dims, is_leaf=lambda x: x is None)
  return out if extra is None else extra(out)


_BATCH = P("fsdp")
_YS = P(None, "fsdp")


def _loss_fn(body, mesh, param_specs, carry_spec=_BATCH, ys_spec=_YS):
  fn = shard_map(
    body, mesh=mesh, in_specs=(param_specs, carry_spec), out_specs=(carry_spec, ys_spec)
  )

  def loss(p, c):
    out, ys = fn(p, c)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(ys.astype(jnp.float32))

  return loss


def _run_both(mesh, params, x, dims, *, prefetch, unroll=1, param_specs=None, **kw):
  param_specs = param_specs or _specs(dims)
  ref = _loss_fn(lambda p, c: _reference(_layer, p, c, dims), mesh, param_specs)
  got = _loss_fn(
    lambda p, c: scan_layers(_layer, p, c, prefetch=prefetch, gather_dim=dims, unroll=unroll, **kw),
    mesh,
    param_specs,
  )
  vg = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  return vg(ref)(params, x), vg(got)(params, x)


def _assert_close(a, b, rtol, atol):
  """Elementwise close, with ``atol`` relative to the largest magnitude of each array."""

  def check(x, y):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    scale = max(1.0, float(np.max(np.abs(x)))) if x.size else 1.0
    np.testing.assert_allclose(y, x, rtol=rtol, atol=atol * scale)

  jax.tree.map(check, a, b)


DIMS = {"w": 0, "b": 0, "s": 0}


@pytest.mark.parametrize("prefetch", [0, 1, 2, 4])
def test_matches_reference_every_prefetch(prefetch):
  mesh = _mesh()
  params = _params(jax.random.PRNGKey(0), 4, 16, jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(1), (16, 16))
  ref, got = _run_both(mesh, params, x, DIMS, prefetch=prefetch)
  _assert_close(ref, got, 1e-6, 1e-6)


@pytest.mark.xla_default_cpu_emitters  # bit for bit under XLA's own code generation
def test_forward_values_and_ys_exact():
  mesh = _mesh()
  params = _params(jax.random.PRNGKey(2), 3, 16, jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(3), (8, 16))
  sm = lambda f: jax.jit(
    shard_map(
      f, mesh=mesh, in_specs=(_specs(DIMS), P("fsdp")), out_specs=(P("fsdp"), P(None, "fsdp"))
    )
  )
  ref = sm(lambda p, c: _reference(_layer, p, c, DIMS))(params, x)
  got = sm(lambda p, c: scan_layers(_layer, p, c, prefetch=1))(params, x)
  assert got[1].shape == (3, 8)
  jax.tree.map(np.testing.assert_array_equal, ref, got)


def test_replicated_leaves_and_other_gather_dims():
  mesh = _mesh()
  dims = {"w": 1, "b": None, "s": 0}
  params = _params(jax.random.PRNGKey(4), 5, 16, jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(5), (16, 16))
  ref, got = _run_both(mesh, params, x, dims, prefetch=2)
  _assert_close(ref, got, 1e-6, 1e-6)


def test_tensor_axis_also_used_in_layer():
  # 4 x 2 mesh: the weight is row-parallel over "tensor" and FSDP-sharded over
  # "fsdp" on its columns; the layer reduces its partial products over "tensor".
  mesh = _mesh((4, 2), ("fsdp", "tensor"))
  width = 16

  def layer(p, c):
    half = width // 2
    c_loc = lax.dynamic_slice_in_dim(c, lax.axis_index("tensor") * half, half, axis=1)
    h = lax.psum(jnp.tanh(c_loc) @ p["w"], "tensor")
    return c + h * p["s"], jnp.mean(h, axis=-1)

  params = _params(jax.random.PRNGKey(6), 4, width, jnp.float32)
  del params["b"]
  specs = {"w": P(None, "tensor", "fsdp"), "s": P(None, "fsdp")}
  dims = {"w": 1, "s": 0}
  x = jax.random.normal(jax.random.PRNGKey(7), (8, width))
  vg = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  ref = vg(_loss_fn(lambda p, c: _reference(layer, p, c, dims), mesh, specs))(params, x)
  for prefetch in (0, 1, 4):
    got = _loss_fn(
      lambda p, c, k=prefetch: scan_layers(layer, p, c, prefetch=k, gather_dim=dims),
      mesh,
      specs,
    )
    _assert_close(ref, vg(got)(params, x), 1e-6, 1e-6)


def test_closed_over_traced_values_get_gradients():
  mesh = _mesh()
  params = _params(jax.random.PRNGKey(8), 3, 16, jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(9), (8, 16))

  def make(use_ours):
    def loss(p, c, scale):
      layer = lambda pl, cc: _layer(pl, cc * scale)

      def body(p, c):
        if use_ours:
          return scan_layers(layer, p, c, prefetch=1)
        return _reference(layer, p, c, DIMS)

      out, ys = shard_map(
        body, mesh=mesh, in_specs=(_specs(DIMS), P("fsdp")), out_specs=(P("fsdp"), P(None, "fsdp"))
      )(p, c)
      return jnp.sum(out**2) + jnp.sum(ys)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  scale = jnp.float32(0.7)
  _assert_close(make(False)(params, x, scale), make(True)(params, x, scale), 1e-6, 1e-6)


@pytest.mark.parametrize(
  "policy",
  [jax.checkpoint_policies.nothing_saveable, jax.checkpoint_policies.dots_saveable],
  ids=["nothing_saveable", "dots_saveable"],
)
def test_remat_policy(policy):
  mesh = _mesh()
  params = _params(jax.random.PRNGKey(10), 4, 16, jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(11), (16, 16))
  ref, got = _run_both(mesh, params, x, DIMS, prefetch=1, remat_policy=policy)
  _assert_close(ref, got, 1e-6, 1e-6)


@pytest.mark.slow
def test_memory_does_not_grow_with_gathered_layers():
  # A plain scan over all_gather saves every gathered layer for the backward
  # pass; scan_layers saves the per-layer carries and re-gathers, so adding
  # layers adds carries and local shards, not gathered layers.
  mesh = _mesh()
  width = 256
  x = jnp.ones((8, width))

  def temp_bytes(body, num_layers):
    params = _params(jax.random.PRNGKey(12), num_layers, width, jnp.float32)
    loss = _loss_fn(body, mesh, _specs(DIMS))
    compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  ours = lambda p, c: scan_layers(_layer, p, c, prefetch=1)
  plain = lambda p, c: _reference(_layer, p, c, DIMS)
  gathered_layer = width * width * 4
  plain_growth = temp_bytes(plain, 12) - temp_bytes(plain, 4)
  ours_growth = temp_bytes(ours, 12) - temp_bytes(ours, 4)
  assert plain_growth >= 8 * gathered_layer, plain_growth
  # Only the 8 extra layers' input carries (8 x 1 x 256 floats per device).
  assert ours_growth < gathered_layer // 4, ours_growth


def _gathered_bytes(jaxpr, times=1):
  """Bytes all-gathered when ``jaxpr`` runs, counting loop bodies once per iteration."""
  total = 0
  for e in jaxpr.eqns:
    if e.primitive.name == "all_gather":
      total += times * e.outvars[0].aval.size * e.outvars[0].aval.dtype.itemsize
    n = e.params["length"] if e.primitive.name == "scan" else 1
    for v in e.params.values():
      sub = getattr(v, "jaxpr", v)
      if hasattr(sub, "eqns"):
        total += _gathered_bytes(sub, times * n)
  return total


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_backward_starts_with_the_forward_gathered_layers(prefetch):
  # The forward pass ends holding the last `prefetch` gathered layers; the
  # backward pass starts with exactly those, so it gathers L - prefetch layers.
  mesh = _mesh()
  n, width = 5, 16
  params = _params(jax.random.PRNGKey(3), n, width, jnp.float32)
  x = jnp.ones((16, width))
  loss = _loss_fn(lambda p, c: scan_layers(_layer, p, c, prefetch=prefetch), mesh, _specs(DIMS))
  layer = (width * width + 2 * width) * 4
  grad_jaxpr = jax.make_jaxpr(jax.grad(loss))(params, x).jaxpr
  assert _gathered_bytes(grad_jaxpr) == (2 * n - prefetch) * layer
  assert _gathered_bytes(jax.make_jaxpr(loss)(params, x).jaxpr) == n * layer
  ref = _loss_fn(lambda p, c: _reference(_layer, p, c, DIMS), mesh, _specs(DIMS))
  g = lambda f: jax.jit(jax.grad(f))(params, x)  # noqa: E731 - one compile, not one per op
  _assert_close(g(ref), g(loss), rtol=1e-5, atol=1e-6)


def test_last_layer_reduce_scatters_go_in_backward_order():
  # Layer 0's gradient reduce-scatters have only layer 0's own backward left to
  # hide under: they are issued one by one as the backward produces them, the
  # cotangent of the last-used parameter ("b") first.
  mesh = _mesh()

  def layer(p, c):
    h = jnp.tanh(c @ p["a"])
    return (h @ p["b"])[:, :16], jnp.sum(h * h, axis=-1)

  params = {"a": jnp.ones((3, 16, 16)) * 0.1, "b": jnp.ones((3, 16, 32)) * 0.1}
  specs = {"a": P(None, "fsdp"), "b": P(None, "fsdp")}
  loss = _loss_fn(lambda p, c: scan_layers(layer, p, c, prefetch=1), mesh, specs)
  bwd = [
    e
    for e in jax.make_jaxpr(jax.grad(loss))(params, jnp.ones((16, 16))).jaxpr.eqns
    if e.primitive.name == "shard_map"
  ][-1].params["jaxpr"]
  tail = [e for e in bwd.eqns if e.primitive.name in ("reduce_scatter", "optimization_barrier")]
  assert [e.primitive.name for e in tail] == [
    "reduce_scatter",
    "optimization_barrier",
    "reduce_scatter",
  ]
  assert tail[0].outvars[0].aval.shape == (2, 32)  # b's cotangent first
  assert tail[2].outvars[0].aval.shape == (2, 16)


def _primitives_in_loops(jaxpr, inside=False):
  names = set()
  for e in jaxpr.eqns:
    if inside:
      names.add(e.primitive.name)
    for v in e.params.values():
      sub = getattr(v, "jaxpr", v)
      if hasattr(sub, "eqns"):
        names |= _primitives_in_loops(sub, inside or e.primitive.name == "scan")
  return names


def test_replicated_leaf_cotangents_are_reduced_once_after_the_loop():
  # "b" is replicated and meets batch-sharded activations: autodiff would
  # all-reduce its cotangent in every layer's backward; scan_layers keeps
  # per-device partials in the loop and reduces them once, with equal results.
  mesh = _mesh()
  dims = {"w": 0, "b": None, "s": 0}
  params = _params(jax.random.PRNGKey(4), 4, 16, jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(5), (16, 16))

  def loops(**kw):
    loss = _loss_fn(
      lambda p, c: scan_layers(_layer, p, c, gather_dim=dims, **kw), mesh, _specs(dims)
    )
    return _primitives_in_loops(jax.make_jaxpr(jax.grad(loss))(params, x).jaxpr)

  psums = {"psum", "psum_invariant", "psum2"}
  assert not loops(prefetch=1) & psums
  assert not loops(prefetch=0) & psums
  # A remat policy types its residuals in the forward pass: reductions stay per layer.
  assert loops(prefetch=1, remat_policy=jax.checkpoint_policies.nothing_saveable) & psums
  for prefetch in (0, 1, 2):
    ref, got = _run_both(mesh, params, x, dims, prefetch=prefetch)
    _assert_close(ref, got, 1e-6, 1e-6)


def test_replicated_leaf_that_meets_no_sharded_value_is_reduced_per_layer():
  # "b" reaches the per-layer output without meeting batch-sharded values, so
  # its partial cotangents would be replicated; the per-layer reduction stays.
  mesh = _mesh()
  dims = {"w": 0, "b": None}

  def layer(p, c):
    return jnp.tanh(c @ p["w"]), jnp.sum(p["b"] ** 2)

  params = {"w": jnp.ones((3, 16, 16)) * 0.05, "b": jnp.arange(48.0).reshape(3, 16) / 48}
  specs = {"w": P(None, "fsdp"), "b": P()}
  x = jax.random.normal(jax.random.PRNGKey(6), (16, 16))
  fn = lambda p, c: scan_layers(layer, p, c, gather_dim=dims, prefetch=1)
  loss = _loss_fn(fn, mesh, specs, ys_spec=P())
  ref = _loss_fn(lambda p, c: _reference(layer, p, c, dims), mesh, specs, ys_spec=P())
  _assert_close(jax.jit(jax.grad(ref))(params, x), jax.jit(jax.grad(loss))(params, x), 1e-6, 1e-6)


def test_under_vmap():
  # A batch of independent carries (e.g. microbatches) through the same layers.
  mesh = _mesh()
  params = _params(jax.random.PRNGKey(20), 3, 16, jnp.float32)
  xs = jax.random.normal(jax.random.PRNGKey(21), (3, 16, 16))

  def make(body):
    fn = shard_map(
      lambda p, c: jax.vmap(lambda ci: body(p, ci)[0])(c),
      mesh=mesh,
      in_specs=(_specs(DIMS), P(None, "fsdp")),
      out_specs=P(None, "fsdp"),
    )
    return jax.jit(jax.value_and_grad(lambda p, c: jnp.sum(fn(p, c) ** 2), argnums=(0, 1)))

  ref = make(lambda p, c: _reference(_layer, p, c, DIMS))(params, xs)
  got = make(lambda p, c: scan_layers(_layer, p, c, prefetch=1))(params, xs)
  _assert_close(ref, got, 1e-6, 1e-6)


def test_tuple_axis_gathers_over_both():
  # Parameters sharded over both mesh axes at once.
  mesh = _mesh((4, 2), ("fsdp", "tensor"))
  axes = ("fsdp", "tensor")
  params = _params(jax.random.PRNGKey(22), 3, 16, jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(23), (16, 16))
  specs = jax.tree.map(lambda _: P(None, axes), params)
  batch, ys = P(axes), P(None, axes)
  ref = _loss_fn(lambda p, c: _reference(_layer, p, c, DIMS, axis=axes), mesh, specs, batch, ys)
  got = _loss_fn(lambda p, c: scan_layers(_layer, p, c, axis=axes), mesh, specs, batch, ys)
  vg = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  _assert_close(vg(ref)(params, x), vg(got)(params, x), 1e-6, 1e-6)


# The steps grow the weights (to ~200): a last-bit difference in the first step's rounding
# grows to 0.4% by the third. Under XLA's own code generation the two programs round alike.
@pytest.mark.xla_default_cpu_emitters
def test_sgd_three_steps_match():
  mesh = _mesh()
  params = _params(jax.random.PRNGKey(13), 3, 16, jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(14), (16, 16))
  ref = _loss_fn(lambda p, c: _reference(_layer, p, c, DIMS), mesh, _specs(DIMS))
  got = _loss_fn(lambda p, c: scan_layers(_layer, p, c, prefetch=1), mesh, _specs(DIMS))

  def train(loss, p):
    @jax.jit
    def step(p):
      g = jax.grad(loss)(p, x)
      return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    for _ in range(3):
      p = step(p)
    return p

  _assert_close(train(ref, params), train(got, params), 1e-6, 1e-6)


def test_mesh_argument_wraps_shard_map():
  mesh = _mesh()
  params = _params(jax.random.PRNGKey(15), 3, 16, jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(16), (16, 16))

  def loss_ours(p, c):
    out, ys = scan_layers(_layer, p, c, mesh=mesh, prefetch=1)
    return jnp.sum(out**2) + jnp.sum(ys)

  def loss_plain(p, c):
    out, ys = lax.scan(lambda c, pl: _layer(pl, c), c, p)
    return jnp.sum(out**2) + jnp.sum(ys)

  ref = jax.jit(jax.value_and_grad(loss_plain, argnums=(0, 1)))(params, x)
  got = jax.jit(jax.value_and_grad(loss_ours, argnums=(0, 1)))(params, x)
  _assert_close(ref, got, 1e-5, 1e-5)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_the_docstring_example_on_both_kinds_of_mesh(axis_type):
  # jax.make_mesh's default axes are Explicit (shard_map then takes its inputs laid out
  # as its in_specs say): scan_layers lays them out itself, eagerly and under jit.
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))

  def layer(p, x):
    h = jnp.tanh(x @ p["w"])
    return h, jnp.mean(h, axis=-1)  # one value per example

  w = jnp.ones((4, 16, 16)) * 0.1
  x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 128
  ref = lax.scan(lambda c, w: layer({"w": w}, c), x, w)
  _assert_close(ref, scan_layers(layer, {"w": w}, x, mesh=mesh), 1e-6, 1e-6)
  jitted = jax.jit(lambda w, x: scan_layers(layer, {"w": w}, x, mesh=mesh))
  _assert_close(ref, jitted(w, x), 1e-6, 1e-6)
  # A scalar per layer (a mean over this device's rows) has no batch dimension for the
  # default ys_spec: the error says what to return or pass instead.
  with pytest.raises(ValueError, match=r"layer_fn returns y: shape \(\) per layer.*ys_spec"):
    scan_layers(lambda p, x: (jnp.tanh(x @ p["w"]), jnp.mean(x)), {"w": w}, x, mesh=mesh)


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(
  num_layers=st.integers(1, 6),
  width=st.sampled_from([8, 16]),
  dtype=st.sampled_from(["float32", "bfloat16"]),
  mesh_shape=st.sampled_from([(8,), (4, 2)]),
  data=st.data(),
)
def test_property_matches_reference(num_layers, width, dtype, mesh_shape, data):
  prefetch = data.draw(st.integers(0, num_layers), label="prefetch")
  unroll = data.draw(st.sampled_from([1, 2]), label="unroll")
  w_dim = data.draw(st.sampled_from([0, 1]), label="w_gather_dim")
  dims = {"w": w_dim, "b": 0, "s": None}
  if len(mesh_shape) == 1:
    mesh = _mesh()
    carry_spec = P("fsdp")
  else:
    mesh = _mesh(mesh_shape, ("fsdp", "tensor"))
    carry_spec = P(("fsdp", "tensor"))  # batch over both axes; params on fsdp only
  params = _params(jax.random.PRNGKey(num_layers * 100 + width), num_layers, width, dtype)
  x = jax.random.normal(jax.random.PRNGKey(17), (16, width)).astype(dtype)
  ys_spec = P(None, *carry_spec)
  ref = _loss_fn(
    lambda p, c: _reference(_layer, p, c, dims), mesh, _specs(dims), carry_spec, ys_spec
  )
  got = _loss_fn(
    lambda p, c: scan_layers(_layer, p, c, prefetch=prefetch, unroll=unroll, gather_dim=dims),
    mesh,
    _specs(dims),
    carry_spec,
    ys_spec,
  )
  vg = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  tol = 1e-5 if dtype == "float32" else 2e-2
  _assert_close(vg(ref)(params, x), vg(got)(params, x), tol, tol)


# ---------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------


def _in_shard_map(fn, params, x, specs=None, mesh=None):
  mesh = mesh or _mesh()
  specs = specs or jax.tree.map(lambda _: P(None, "fsdp"), params)
  return jax.jit(shard_map(fn, mesh=mesh, in_specs=(specs, P("fsdp")), out_specs=P("fsdp")))(
    params, x
  )


@pytest.mark.parametrize("prefetch", [-1, 4])
def test_error_prefetch_out_of_range(prefetch):
  params = {"w": jnp.ones((3, 16, 16))}
  with pytest.raises(
    ValueError,
    match=rf"scan_layers: prefetch must be between 0 and the number of layers \(3\), got {prefetch}",
  ):
    _in_shard_map(
      lambda p, c: scan_layers(_layer_w, p, c, prefetch=prefetch)[0], params, jnp.ones((8, 16))
    )


def _layer_w(p, c):
  return c @ p["w"], None


def test_error_mismatched_layer_dims():
  params = {"w": jnp.ones((3, 16, 16)), "b": jnp.ones((4, 16))}
  with pytest.raises(
    ValueError, match=r"same leading layer dimension, got stacked_params\['b'\]: 4"
  ):
    _in_shard_map(lambda p, c: scan_layers(_layer_w, p, c)[0], params, jnp.ones((8, 16)))


def test_error_leaf_without_layer_dim():
  with pytest.raises(
    ValueError, match=r"needs a leading layer dimension, got scalars at stacked_params\['s'\]"
  ):
    scan_layers(_layer_w, {"w": jnp.ones((3, 16, 16)), "s": jnp.float32(1.0)}, jnp.ones((8, 16)))


def test_error_non_array_leaf():
  with pytest.raises(
    TypeError, match=r"must be an array, got non-arrays at stacked_params\['n'\] \(str\)"
  ):
    scan_layers(_layer_w, {"w": jnp.ones((3, 16, 16)), "n": "relu"}, jnp.ones((8, 16)))


def test_error_integer_leaf():
  with pytest.raises(TypeError, match=r"floating dtype.*stacked_params\['i'\] \(int32\)"):
    scan_layers(
      _layer_w, {"w": jnp.ones((3, 16, 16)), "i": jnp.ones((3, 2), jnp.int32)}, jnp.ones((8, 16))
    )


def test_error_axis_not_bound():
  with pytest.raises(ValueError, match=r"scan_layers: axis 'fsdp' is not bound here"):
    scan_layers(_layer_w, {"w": jnp.ones((3, 16, 16))}, jnp.ones((8, 16)))


def test_error_axis_not_in_mesh():
  with pytest.raises(ValueError, match=r"axis 'data' is not an axis of mesh \(axes \('fsdp',\)\)"):
    scan_layers(
      _layer_w, {"w": jnp.ones((3, 16, 16))}, jnp.ones((8, 16)), axis="data", mesh=_mesh()
    )


def test_error_sharded_dim_not_divisible():
  with pytest.raises(
    ValueError,
    match=r"divisible by the size of axis 'fsdp' \(8\), got stacked_params\['w'\] dimension 0 .* has size 12",
  ):
    scan_layers(_layer_w, {"w": jnp.ones((3, 12, 16))}, jnp.ones((8, 16)), mesh=_mesh())


def test_error_carry_batch_not_divisible():
  # The carry is split over the axis along its batch: a batch of 6 on 8 devices is named
  # with scan_layers' remedy (shard_map's own error speaks of sharding specs).
  w = {"w": jnp.ones((3, 16, 16))}
  with pytest.raises(
    ValueError,
    match=r"scan_layers: carry dimension 0 has size 6, not divisible by 'fsdp' \(8 devices\); "
    r"the carry is split over the axis along its first \(batch\) dimension by default",
  ):
    scan_layers(_layer_w, w, jnp.ones((6, 16)), mesh=_mesh())
  with pytest.raises(ValueError, match=r"carry\['h'\] dimension 1 has size 3, .* in carry_spec"):
    scan_layers(
      lambda p, c: ({"h": c["h"]}, None),
      w,
      {"h": jnp.ones((8, 3))},
      mesh=_mesh(),
      carry_spec={"h": P(None, "fsdp")},
    )
  # Kept whole on every device, the same batch runs.
  out, _ = scan_layers(_layer_w, w, jnp.ones((6, 16)), mesh=_mesh(), carry_spec=P(), ys_spec=P())
  assert out.shape == (6, 16)


def test_error_gather_dim_out_of_range():
  with pytest.raises(ValueError, match=r"gather_dim for stacked_params\['w'\] must index .* got 2"):
    scan_layers(
      _layer_w, {"w": jnp.ones((3, 16, 16))}, jnp.ones((8, 16)), gather_dim=2, mesh=_mesh()
    )


def test_error_layer_fn_not_callable():
  with pytest.raises(TypeError, match="scan_layers: layer_fn must be callable, got int"):
    scan_layers(3, {"w": jnp.ones((3, 16, 16))}, jnp.ones((8, 16)))


def test_error_layer_fn_changes_carry():
  params = {"w": jnp.ones((3, 16, 32))}
  with pytest.raises(TypeError, match="layer_fn must return a carry with the structure, shapes"):
    _in_shard_map(lambda p, c: scan_layers(_layer_w, p, c)[0], params, jnp.ones((8, 16)))


def test_error_layer_fn_fails_to_trace():
  def layer(p, c):
    return c @ p["w"].T @ p["w"][:3], None  # shapes do not line up

  with pytest.raises(TypeError, match=r"scan_layers: tracing layer_fn\(params, carry\) failed"):
    _in_shard_map(
      lambda p, c: scan_layers(layer, p, c)[0], {"w": jnp.ones((3, 16, 16))}, jnp.ones((8, 16))
    )


def test_error_layer_fn_not_differentiable():
  def layer(p, c):
    # A while_loop with a data-dependent trip count has no reverse-mode rule.
    def cond(s):
      return s[0] < 3

    def body(s):
      return s[0] + 1, s[1] @ p["w"]

    return lax.while_loop(cond, body, (0, c))[1], None

  params = {"w": jnp.ones((3, 16, 16)) * 0.1}
  x = jnp.ones((8, 16))
  fwd = _in_shard_map(lambda p, c: scan_layers(layer, p, c)[0], params, x)  # forward is fine
  assert fwd.shape == (8, 16)
  with pytest.raises(TypeError, match="scan_layers: layer_fn could not be differentiated"):
    jax.grad(lambda p: jnp.sum(_in_shard_map(lambda p, c: scan_layers(layer, p, c)[0], p, x)))(
      params
    )


# ---------------------------------------------------------------------------
# Schedule on a compile-only 8 x H100 mesh.
# ---------------------------------------------------------------------------

_HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda13") is not None

# Flags under which the overlap appears (see docs/fsdp.md for the findings).
SCHEDULE_FLAGS = {
  "xla_gpu_enable_latency_hiding_scheduler": True,
  "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
  "xla_gpu_all_gather_combine_threshold_bytes": 1 << 30,
  "xla_gpu_reduce_scatter_combine_threshold_bytes": 1 << 30,
}


@functools.cache
def _compiled_schedule(prefetch, flags):
  """The collectives of each while-loop body of grad(scan_layers stack) on h100x8."""
  from jax_overlap._src.analysis import hlo, schedule

  module = hlo.parse_module(_compiled_hlo(flags, prefetch))
  return [schedule.collective_brackets(module, body) for body in schedule.while_bodies(module)]


@functools.cache
def _compiled_hlo(flags, prefetch=1):
  """The scheduled HLO of grad(scan_layers stack) on h100x8."""
  from jax_overlap._src.compile.compiler import compile_for_target
  from jax_overlap._src.targets import compile_only_mesh

  mesh = compile_only_mesh("h100x8", {"fsdp": 8})
  num_layers, width, batch = 6, 4096, 8192

  def layer(p, c):
    h = jnp.tanh(c @ p["w1"]) @ p["w2"]
    return c + h, None

  specs = {"w1": P(None, "fsdp"), "w2": P(None, "fsdp")}
  fn = shard_map(
    lambda p, c: scan_layers(layer, p, c, prefetch=prefetch)[0],
    mesh=mesh,
    in_specs=(specs, P("fsdp")),
    out_specs=P("fsdp"),
  )
  loss = lambda p, c: jnp.sum(fn(p, c).astype(jnp.float32) ** 2)
  ps = {
    n: jax.ShapeDtypeStruct(
      (num_layers, width, width), jnp.bfloat16, sharding=NamedSharding(mesh, specs[n])
    )
    for n in specs
  }
  cs = jax.ShapeDtypeStruct((batch, width), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
  step = compile_for_target(
    jax.jit(jax.grad(loss)), ps, cs, target="h100x8", xla_options=dict(flags)
  )
  return step.hlo_text


def _bracketed(body, kind):
  """GEMMs scheduled between each ``kind`` start and its done."""
  return [b.gemms for b in body if b.kind == kind]


@pytest.mark.skipif(not _HAS_CUDA_PLUGIN, reason="needs jax-cuda13-plugin for deviceless compiles")
@pytest.mark.parametrize("estimator", [False, True], ids=["default", "analytical"])
def test_schedule_h100_gather_and_reduce_scatter_bracket_compute(estimator):
  from jax_overlap._src.flags.configuration import loop_schedule_options

  # With the loop options jax_overlap recommends for this XLA: without its async
  # dynamic-slice copies where it has them (on jaxlib 0.12 they take the reduce-scatter's
  # GEMMs).
  flags = dict(
    SCHEDULE_FLAGS, **loop_schedule_options(), xla_gpu_enable_analytical_latency_estimator=estimator
  )
  if estimator and aborts.aborts("xla_gpu_enable_analytical_latency_estimator")[0]:
    # This jaxlib's XLA aborts compiling loops with the estimator: refused, not aborted.
    with pytest.raises(ConfigError, match="abort the process compiling a program with a while"):
      _compiled_schedule(1, tuple(sorted(flags.items())))
    return
  bodies = _compiled_schedule(1, tuple(sorted(flags.items())))
  fwd = [b for b in bodies if not any(c.kind == "reduce-scatter" for c in b)]
  bwd = [b for b in bodies if any(c.kind == "reduce-scatter" for c in b)]
  assert fwd and bwd
  for b in bodies:
    assert not any(c.synchronous for c in b), "an async collective was made synchronous"
  # Forward: the next layer's gather starts before this layer's GEMMs, ends after them.
  fwd_gathers = [n for b in fwd for n in _bracketed(b, "all-gather")]
  assert fwd_gathers and min(fwd_gathers) >= 2, fwd
  # Backward: the gather and the previous layer's reduce-scatter both bracket GEMMs.
  for b in bwd:
    assert min(_bracketed(b, "all-gather")) >= 2, b
    assert min(_bracketed(b, "reduce-scatter")) >= 2, b


@pytest.mark.skipif(not _HAS_CUDA_PLUGIN, reason="needs jax-cuda13-plugin for deviceless compiles")
def test_loop_schedule_options_name_a_pass_this_xla_runs():
  # The option is recommended exactly where the compiled loop has async slice copies.
  from jax_overlap._src.flags import configuration

  opts = configuration.loop_schedule_options()
  flags = dict(SCHEDULE_FLAGS, xla_gpu_enable_analytical_latency_estimator=False)
  text = _compiled_hlo(tuple(sorted(flags.items())))
  assert ("fusion-start" in text) == configuration.async_slice_copies()
  assert opts == (
    {"xla_disable_hlo_passes": configuration.ASYNC_SLICE_COPY_PASS}
    if configuration.async_slice_copies()
    else {}
  )
  if opts:
    assert "fusion-start" not in _compiled_hlo(tuple(sorted({**flags, **opts}.items())))
    assert opts.items() <= configuration.recommended(target="h100x8", workload="fsdp").items()
