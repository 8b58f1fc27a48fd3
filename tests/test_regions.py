"""Occupancy regions: custom calls under jit, grad, vmap and shard_map (8 CPU devices)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

import jax_overlap.runtime as rt
from jax_overlap._src.runtime import regions


@pytest.fixture(autouse=True)
def _clear_events():
  regions.clear_region_events()
  yield
  regions.clear_region_events()


def mlp(x, w):
  return jnp.tanh(x @ w)


X = jnp.arange(32.0).reshape(4, 8) / 32
W = jnp.linspace(-1, 1, 64).reshape(8, 8)


def test_identity_under_jit_and_events_on_cpu():
  f = rt.occupancy(mlp, blocks_per_sm=2, name="mlp")
  out = jax.jit(f)(X, W)
  np.testing.assert_allclose(out, mlp(X, W), rtol=1e-6)
  rid = rt.region_id("mlp")
  assert regions.region_events() == [("begin", rid, 2), ("end", rid, 2)]


def test_events_bracket_the_enclosed_computation():
  seen = []

  def probe(x):
    seen.append(len(regions.region_events()))
    return x

  def body(x, w):
    y = mlp(x, w)
    return io_callback(probe, jax.ShapeDtypeStruct(y.shape, y.dtype), y, ordered=False)

  f = jax.jit(rt.occupancy(body, blocks_per_sm=3))
  for _ in range(3):
    regions.clear_region_events()
    seen.clear()
    np.testing.assert_allclose(f(X, W), mlp(X, W), rtol=1e-6)
    # The enclosed op ran after begin and before end.
    assert seen == [1]
    assert [e[0] for e in regions.region_events()] == ["begin", "end"]


def test_custom_calls_are_in_the_hlo_with_aliasing():
  text = jax.jit(rt.occupancy(mlp, blocks_per_sm=2, name=11)).lower(X, W).as_text()
  assert text.count("@jax_overlap_region_begin") == 1
  assert text.count("@jax_overlap_region_end") == 1
  assert "output_operand_alias" in text
  assert re.search(r"blocks_per_sm = 2 : i64, region_id = 11 : i64", text)


def test_cuda_lowering_uses_the_same_targets():
  f = jax.jit(rt.occupancy(mlp, blocks_per_sm=2))
  try:
    text = f.trace(X, W).lower(lowering_platforms=("cuda",)).as_text()
  except Exception as e:  # noqa: BLE001 - jaxlib without CUDA lowering support
    pytest.skip(f"no CUDA lowering in this jaxlib: {e}")
  assert "@jax_overlap_region_begin" in text and "@jax_overlap_region_end" in text


def test_grad_matches_and_brackets_the_backward_pass():
  f = rt.occupancy(mlp, blocks_per_sm=2)

  def loss(w):
    return jnp.sum(f(X, w) ** 2)

  def ref(w):
    return jnp.sum(mlp(X, w) ** 2)

  np.testing.assert_allclose(jax.jit(jax.grad(loss))(W), jax.grad(ref)(W), rtol=1e-5)
  kinds = [e[0] for e in regions.region_events()]
  assert kinds.count("begin") == 2 and kinds.count("end") == 2
  assert kinds[0] == "begin"
  depth = 0
  for k in kinds:  # every end closes an open region
    depth += 1 if k == "begin" else -1
    assert depth >= 0


def test_grad_with_integer_and_non_array_arguments():
  @rt.occupancy(blocks_per_sm=1)
  def f(x, n, scale):
    return x * n * scale

  g = jax.grad(lambda x: f(x, jnp.int32(3), 2.0).sum())(jnp.ones(4))
  np.testing.assert_allclose(g, np.full(4, 6.0))


def test_vmap():
  f = rt.occupancy(mlp, blocks_per_sm=2)
  xs = jnp.stack([X, 2 * X])
  np.testing.assert_allclose(
    jax.vmap(f, in_axes=(0, None))(xs, W),
    jax.vmap(mlp, in_axes=(0, None))(xs, W),
    rtol=1e-5,  # fp32: the region's boundaries change XLA's fusions, so the op order
    atol=1e-6,
  )


def test_shard_map_on_eight_devices():
  assert jax.device_count() == 8
  mesh = jax.make_mesh((8,), ("x",))
  xs = jnp.arange(8 * 4 * 8, dtype=jnp.float32).reshape(32, 8) / 256
  xs = jax.device_put(xs, jax.sharding.NamedSharding(mesh, P("x")))
  w = jax.device_put(W, jax.sharding.NamedSharding(mesh, P()))

  def body(x, w):
    y = rt.occupancy(mlp, blocks_per_sm=2, name="sharded")(x, w)
    return jax.lax.psum(y.sum(0, keepdims=True), "x")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P()))
  out = f(xs, w)
  np.testing.assert_allclose(out, mlp(xs, W).sum(0, keepdims=True), rtol=1e-5)
  events = regions.region_events()
  assert [e[0] for e in events].count("begin") == 8
  assert [e[0] for e in events].count("end") == 8
  # grad under shard_map too.
  g = jax.jit(jax.grad(lambda w: f(xs, w).sum()))(w)
  np.testing.assert_allclose(g, jax.grad(lambda w: mlp(np.asarray(xs), w).sum())(W), rtol=1e-4)


def test_context_manager_form():
  @jax.jit
  def step(x, w):
    with rt.occupancy(blocks_per_sm=2, name="ctx") as r:
      x, w = r.begin(x, w)
      y = r.end(mlp(x, w))
    return y

  np.testing.assert_allclose(step(X, W), mlp(X, W), rtol=1e-6)
  assert [e[0] for e in regions.region_events()] == ["begin", "end"]


def test_context_manager_without_begin_end_is_an_error():
  with pytest.raises(RuntimeError, match=r"was entered but begin\(\) was called 0 and end\(\) 0"):
    with rt.occupancy(blocks_per_sm=2):
      mlp(X, W)
  r = rt.occupancy(blocks_per_sm=2)
  with pytest.raises(RuntimeError, match=r"end\(\) called before begin\(\)"):
    r.end(X)


@pytest.mark.parametrize(
  "kwargs,exc,message",
  [
    ({"blocks_per_sm": 0}, ValueError, "jax_overlap.occupancy: blocks_per_sm must be >= 1, got 0"),
    ({"blocks_per_sm": -2}, ValueError, "blocks_per_sm must be >= 1, got -2"),
    ({"blocks_per_sm": 1.5}, TypeError, "blocks_per_sm must be an integer, got float"),
    ({}, ValueError, "give blocks_per_sm, or a name whose blocks_per_sm the plan's 'regions' sets"),
    ({"blocks_per_sm": 1, "name": ""}, ValueError, "region name must not be empty"),
  ],
)
def test_bad_arguments(kwargs, exc, message):
  with pytest.raises(exc, match=re.escape(message)):
    rt.occupancy(**kwargs)


def test_name_only_region_defers_to_the_plan():
  f = jax.jit(rt.occupancy(mlp, name="planned"))
  f(X, W)
  assert regions.region_events()[0] == ("begin", rt.region_id("planned"), 0)


def test_wrapping_a_non_callable():
  with pytest.raises(TypeError, match="expected a function to wrap, got int"):
    rt.occupancy(blocks_per_sm=1)(3)


def test_deviceless_h100_compile_keeps_the_region_around_the_gemm():
  from jax.sharding import NamedSharding

  from jax_overlap._src import targets

  try:
    mesh = targets.compile_only_mesh("h100x8")
  except (ImportError, RuntimeError, ValueError) as e:
    pytest.skip(f"deviceless CUDA compilation unavailable: {e}")
  f = rt.occupancy(lambda x, w: jnp.tanh(x @ w), blocks_per_sm=2, name="mlp")
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("fsdp"), P()), out_specs=P("fsdp")))
  x = jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
  w = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=NamedSharding(mesh, P()))
  text = g.lower(x, w).compile().as_text()
  entry = text[text.index("ENTRY") :]
  begin = entry.index('custom_call_target="jax_overlap_region_begin"')
  end = entry.index('custom_call_target="jax_overlap_region_end"')
  assert begin < end
  # The GEMM fusion is scheduled between begin and end.
  between = entry[begin:end]
  assert "gemm_fusion" in between or "__cublas$gemm" in between
