"""GSPMD steps on 2-D and 3-D meshes (FSDP on one axis, tensor parallelism on another,
weights split along two dimensions) converted to their shard_map form: the same values,
weights gathered over the FSDP axis only, activations summed over the tensor axis."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_to_shard_map import _assert_same, _collectives, _convert, _mesh, _transformer

import jax_overlap
from jax_overlap.examples import flax_llama


def _axes_of(fn, leaves, primitive: str) -> list[tuple[str, ...]]:
  """The mesh axes of every ``primitive`` equation in ``fn``'s jaxpr (nested ones too)."""
  text = str(jax.make_jaxpr(fn)(*leaves))
  key = "axes" if primitive == "psum" else "axis_name"
  found = re.findall(primitive + r"\[[^\]]*?\b" + key + r"=\(([^)]*)\)", text)
  return [tuple(a.strip(" '") for a in f.split(",") if a.strip(" '")) for f in found]


@pytest.mark.parametrize(
  "shape,form",
  [((4, 2), "unrolled"), ((2, 4), "scan_remat"), ((4, 2), "vocab")],
)
def test_fsdp_and_tensor_parallel_transformer_computes_the_original(shape, form):
  # fsdp_transformer with a tensor axis: column-parallel weights P(fsdp, tensor),
  # row-parallel ones P(tensor, fsdp), constrained whole over fsdp at their use.
  mesh = _mesh(shape, ("fsdp", "tensor"))
  extra = {"unrolled": {}, "scan_remat": {"scan": True, "remat": True}, "vocab": {"vocab": 64}}
  layers = 2
  fn, fresh, batch = _transformer(mesh, layers=layers, tensor_axis="tensor", **extra[form])
  conv, leaves = _convert(fn, (fresh(), batch))
  _assert_same(jax.jit(conv.fn)(*leaves), fn(fresh(), batch), rtol=1e-4, atol=1e-5)
  assert not conv.replicated
  # Weights are gathered over fsdp only (each device keeps its tensor-parallel slice), and
  # their gradients reduce-scattered over fsdp: once per layer, or once in the scan body.
  gathers = _axes_of(conv.fn, leaves, "all_gather")
  scatters = _axes_of(conv.fn, leaves, "reduce_scatter")
  per_layer = 7 * (1 if form == "scan_remat" else layers)
  assert gathers and set(gathers) == {("fsdp",)}
  assert len(scatters) >= per_layer and set(scatters) == {("fsdp",)}
  # The row-parallel matmuls' partial sums are all-reduced over the tensor axis.
  assert ("tensor",) in _axes_of(conv.fn, leaves, "psum")


def _llama(mesh, **overrides):
  cfg = flax_llama.Config(
    layers=2, hidden=64, mlp=128, heads=8, kv_heads=4, seq=16, vocab=96, dtype="float32",
    batch_per_device=2, model_axis=mesh.shape["model"], **overrides,
  )  # fmt: skip
  fn = flax_llama.make_step(cfg)
  tokens = flax_llama.random_tokens(cfg, mesh, jax.random.key(1))

  def fresh():  # the step donates its parameters and optimizer state: made anew per call
    return flax_llama.init(cfg, mesh, jax.random.key(0))

  return fn, fresh, tokens


def _assert_like_the_step(got, want):
  """The AdamW step's outputs: the loss and the optimizer's moments (the gradients) to
  float32 rounding; the parameters to a tenth of the learning rate (Adam's update of a
  near-zero gradient, g / (|g| + eps), turns its last bits into a visible change)."""
  params = len(jax.tree.leaves(want[0]))  # the step returns (params, opt_state, loss)
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  _assert_same(got[:params], want[:params], rtol=1e-4, atol=3e-5)
  _assert_same(got[params:], want[params:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(4, 2), (2, 4)])
def test_flax_llama_on_a_data_model_mesh(shape):
  # Logical axis rules lay most kernels out along two dimensions (embed over data, heads,
  # MLP and vocabulary over model); grouped-query attention repeats KV heads split over
  # model; AdamW with clipping; the optimizer state laid out like the parameters.
  mesh = _mesh(shape, ("data", "model"))
  fn, fresh, tokens = _llama(mesh)
  p, s = fresh()
  conv, leaves = _convert(fn, (p, s, tokens), params_argnums=(0, 1))
  got = jax.jit(conv.fn)(*leaves)
  _assert_like_the_step(got, fn(*fresh(), tokens))
  assert not conv.replicated
  n = _collectives(conv.fn, leaves)
  assert n["all_gather"] and n["reduce_scatter"]
  # Weight gradients are reduce-scattered over data (FSDP), along both their dimensions
  # where the other is split over model (the vocabulary-split embedding's), never summed
  # whole: only scalars (the loss, the clipping norm's parts) are all-reduced over data.
  assert ("data",) in _axes_of(conv.fn, leaves, "reduce_scatter")
  text = str(jax.make_jaxpr(conv.fn)(*leaves))
  summed = re.findall(r"(\w+\[[\d,]*\]) = psum\[axes=\('data',\)", text)
  assert summed and all(t.endswith("[]") for t in summed), summed


def test_three_axis_mesh_with_a_dimension_over_two_axes():
  # A plain jax.jit MLP step: weights split along one dimension over (data, fsdp) and along
  # the other over tensor, the batch over (data, fsdp), SGD; outputs laid out as inputs.
  mesh = _mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  dp = ("data", "fsdp")
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  w1 = jax.device_put(jax.random.normal(k1, (32, 64)) * 0.1, NamedSharding(mesh, P(dp, "tensor")))
  w2 = jax.device_put(jax.random.normal(k2, (64, 32)) * 0.1, NamedSharding(mesh, P("tensor", dp)))
  x = jax.device_put(jax.random.normal(k3, (16, 32)), NamedSharding(mesh, P(dp, None)))

  def loss(w, x):
    h = jax.nn.gelu(x @ w[0])
    return jnp.mean((h @ w[1]) ** 2)

  def step(w, x):
    value, g = jax.value_and_grad(loss)(w, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, w, g), value

  shardings = (w1.sharding, w2.sharding)
  fn = jax.jit(step, out_shardings=(shardings, NamedSharding(mesh, P())))
  conv, leaves = _convert(fn, ((w1, w2), x))
  _assert_same(jax.jit(conv.fn)(*leaves), fn((w1, w2), x), rtol=1e-4, atol=1e-5)
  assert not conv.replicated
  # The weights are gathered over the axes that split their FSDP dimension, not tensor.
  assert set(_axes_of(conv.fn, leaves, "all_gather")) <= {dp, ("data",), ("fsdp",)}


def test_overlap_runs_a_2d_step_in_its_shard_map_form():
  # @overlap(gspmd="convert") on the CPU mesh: the converted, rewritten step it chooses
  # gives the step's numbers, and explain() says the step was converted.
  mesh = _mesh((4, 2), ("data", "model"))
  fn, fresh, tokens = _llama(mesh)
  ov = jax_overlap.overlap(fn, gspmd="convert", cache=False)
  e = ov.explain(*fresh(), tokens)
  assert any(n.startswith("converted to shard_map") for n in e.notes), e.notes
  assert e.chosen.startswith("shard_map form"), e.chosen
  _assert_like_the_step(ov(*fresh(), tokens), fn(*fresh(), tokens))


def test_the_shard_map_form_does_the_models_matmul_work():
  # Deviceless for h100x8: the converted step's dots, as the analysis counts them from
  # XLA's HLO, do the matmul work counted from the model's shapes (less only where XLA
  # does not recompute a rematerialized forward it still holds), not the partitioned
  # step's redundant work.
  cfg = dict(layers=2, hidden=512, mlp=1024, heads=8, kv_heads=4, seq=256, vocab=1024)
  fn, args = flax_llama.build("h100x8", **cfg)
  ov = jax_overlap.overlap(fn, target="h100x8", gspmd="convert", select="rewrite", cache=False)
  r = jax_overlap.analyze(ov, *args, target="h100x8")
  got = sum(k.flops for k in r.kernels if k.kind == "gemm")
  want = flax_llama.step_flops(flax_llama.Config(**cfg), data=4) / 8
  assert 0.85 * want <= got <= 1.01 * want, (got, want)


def test_a_scanned_tensor_parallel_residual_is_reduced_where_it_is_made():
  # The residual stream of a scanned, rematerialized layer comes out of its row-parallel
  # matmuls unreduced over tensor and is read whole by the next layer's norm: it is
  # all-reduced at the end of each iteration, so the backward pass recomputes each layer
  # from a whole residual. Megatron's count: 2 all-reduces of activations per layer
  # forward, 2 more for the forward recomputed and 2 in the backward proper.
  mesh = _mesh((4, 2), ("fsdp", "tensor"))
  fn, fresh, batch = _transformer(mesh, layers=2, tensor_axis="tensor", scan=True, remat=True)
  conv, leaves = _convert(fn, (fresh(), batch))
  _assert_same(jax.jit(conv.fn)(*leaves), fn(fresh(), batch), rtol=1e-4, atol=1e-5)
  text = str(jax.make_jaxpr(conv.fn)(*leaves))
  act = batch["x"].shape[0] // mesh.shape["fsdp"], *batch["x"].shape[1:]
  shape = "f32[" + ",".join(map(str, act)) + "]"
  summed = re.findall(re.escape(shape) + r" = psum\[axes=\('tensor',\)", text)
  assert len(summed) == 6, len(summed)


def test_a_gradient_accumulated_over_microbatches_is_reduced_once():
  # A carry the loop only adds to stays an unreduced sum through the iterations and is
  # reduce-scattered once, after the loop.
  from test_to_shard_map import _walk

  mesh = _mesh((8,), ("fsdp",))
  w = jax.device_put(jax.random.normal(jax.random.key(0), (64, 32)), NamedSharding(mesh, P("fsdp")))
  xs = jax.random.normal(jax.random.key(1), (4, 16, 64))
  xs = jax.device_put(xs, NamedSharding(mesh, P(None, "fsdp")))

  def step(w, xs):
    def body(g, x):
      gi = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
      return g + gi, None

    g, _ = jax.lax.scan(body, jnp.zeros_like(w), xs)
    return w - 0.1 * g

  fn = jax.jit(step, out_shardings=w.sharding)
  conv, leaves = _convert(fn, (w, xs))
  _assert_same(jax.jit(conv.fn)(*leaves), fn(w, xs), rtol=1e-4, atol=1e-5)
  closed = jax.make_jaxpr(conv.fn)(*leaves)
  reductions = [(p, loop) for p, loop, _ in _walk(closed.jaxpr) if p in ("reduce_scatter", "psum")]
  assert reductions == [("reduce_scatter", False)], reductions
