"""@overlap on Flax NNX steps written the NNX way: Modules with sharded parameters
(``nnx.with_partitioning``) made under ``jax.set_mesh``, an ``nnx.Optimizer``, and a
train step under ``nnx.jit`` that updates both in place."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap

VOCAB, D, F = 128, 64, 256


class Block(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.norm = nnx.RMSNorm(D, rngs=rngs)
    self.up = nnx.Linear(
      D, F, use_bias=False, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("data", "model"))
    )
    self.down = nnx.Linear(
      F, D, use_bias=False, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("model", "data"))
    )

  def __call__(self, x):
    return x + self.down(nnx.gelu(self.up(self.norm(x))))


class Model(nnx.Module):
  def __init__(self, rngs, layers=2):
    self.embed = nnx.Embed(
      VOCAB,
      D,
      rngs=rngs,
      embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), (None, "data")),
    )
    self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
    self.head = nnx.Linear(
      D,
      VOCAB,
      use_bias=False,
      rngs=rngs,
      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", "model")),
    )

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def _train_step(graph: bool, **jit_kwargs):
  @nnx.jit(graph=graph, **jit_kwargs)
  def train_step(model, optimizer, tokens, targets):
    def loss_fn(model):
      logits = model(tokens)
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  return train_step


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _setup(mesh):
  """(model, optimizer, tokens, targets), made under the mesh as NNX users make them, and
  laid out by their partition metadata as Flax's documentation does (Flax's eager
  sharding is a global flag, which MaxText, imported by other tests, turns off)."""
  with jax.set_mesh(mesh):
    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    state = nnx.state((model, optimizer))
    specs = nnx.get_partition_spec(state)
    nnx.update(
      (model, optimizer),
      jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), state, specs),
    )
  rng = np.random.default_rng(0)
  batch = NamedSharding(mesh, P("data"))
  tokens = jax.device_put(rng.integers(0, VOCAB, (16, 32)), batch)
  targets = jax.device_put(rng.integers(0, VOCAB, (16, 32)), batch)
  return model, optimizer, tokens, targets


def _params(model):
  return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "tree"])
def test_an_nnx_step_updates_its_modules_as_nnx_jit_does(mesh, graph):
  step = _train_step(graph)
  ov = jax_overlap.overlap(step)
  assert isinstance(ov, jax_overlap._src.framework_jits.WrappedOverlapped)
  model, optimizer, tokens, targets = _setup(mesh)
  twin, twin_opt, _, _ = _setup(mesh)
  with jax.set_mesh(mesh):
    before = _params(twin)
    # explain() traces (and chooses) without running the step: nothing moves. On CPU with
    # no target the step runs as written, and says so once.
    with pytest.warns(jax_overlap.NothingToOverlapWarning, match="train_step") as said:
      e = ov.explain(twin, twin_opt, tokens, targets)
    assert said[0].filename == __file__  # the user's line, through NNX's frames
    assert any(n.startswith("no shard_map in this program") for n in e.notes)
    assert all(np.array_equal(a, b) for a, b in zip(before, _params(twin)))
    for _ in range(3):
      want = step(model, optimizer, tokens, targets)
      got = ov(twin, twin_opt, tokens, targets)
      assert float(got) == float(want)  # the step as written, on CPU: the same numbers
  assert int(twin_opt.step[...]) == int(optimizer.step[...]) == 3
  moved = [not np.array_equal(a, b) for a, b in zip(before, _params(twin))]
  assert all(moved)  # every parameter updated in the caller's Module
  for a, b in zip(_params(model), _params(twin)):
    np.testing.assert_array_equal(a, b)
  assert step.jitted_fn is not ov.step  # the wrapper's own jax.jit is back after a call


def test_an_nnx_step_converted_for_a_target(mesh):
  # A target: the GSPMD step NNX jits is converted to its shard_map form and chosen among
  # the variants compiled for 8 H100s; it still runs here and updates the Modules.
  step = _train_step(True, donate_argnames=("model", "optimizer"))
  ov = jax_overlap.overlap(step, target="h100x8", gspmd="convert", cache=False)
  model, optimizer, tokens, targets = _setup(mesh)
  twin, twin_opt, _, _ = _setup(mesh)
  with jax.set_mesh(mesh):
    e = ov.explain(twin, twin_opt, tokens, targets)
    assert e.chosen.startswith("shard_map form"), e.chosen
    assert any(a.kind == "convert" for a in e.actions)
    for _ in range(2):
      want = step(model, optimizer, tokens, targets)
      got = ov(twin, twin_opt, tokens, targets)
      np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    report = jax_overlap.analyze(ov, twin, twin_opt, tokens, targets, target="h100x8")
  assert not tokens.is_deleted() and not targets.is_deleted()  # only the Modules donated
  assert int(twin_opt.step[...]) == 2
  # Adam turns float32 sum order into visible differences of near-zero gradients: a
  # tenth of the learning rate.
  for a, b in zip(_params(model), _params(twin)):
    np.testing.assert_allclose(a, b, atol=1e-4)
  (judged,) = [n for n in e.notes if n.startswith("chosen variant judged twice")]
  assert f"the analysis {report.step_time_s * 1e3:.3f} ms" in judged


def test_a_plain_function_over_nnx_modules_is_refused(mesh):
  def train_step(model, optimizer, tokens, targets):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(tokens)))(model)
    optimizer.update(model, grads)
    return loss

  model, optimizer, tokens, targets = _setup(mesh)
  with pytest.raises(TypeError, match=r"Flax NNX objects \(Model, Optimizer\).*nnx\.jit"):
    jax_overlap.overlap(train_step)(model, optimizer, tokens, targets)

  # A jitted function over Modules keeps jax.jit's meaning (here it returns what it
  # computes): not refused, the same numbers.
  @jax.jit
  def grads_of(model, tokens):
    return nnx.grad(lambda m: jnp.mean(m(tokens)))(model)

  with jax.set_mesh(mesh), pytest.warns(jax_overlap.NothingToOverlapWarning):
    got = jax_overlap.overlap(grads_of)(model, tokens)
  want = grads_of(model, tokens)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_analysis_of_an_nnx_step_keeps_its_updates(mesh):
  # nnx.jit updates the Modules in place: the program analysed is its jax.jit, which
  # returns the new parameters and optimizer state (a trace of the wrapper alone would
  # leave them out, and XLA would drop the backward pass and the update with them).
  step = _train_step(True)
  model, optimizer, tokens, targets = _setup(mesh)
  with jax.set_mesh(mesh):
    report = jax_overlap.analyze(step, model, optimizer, tokens, targets, target="h100x8")
  params = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(nnx.state(model)))
  assert report.memory.outputs >= 2 * params > 0  # new parameters and optimizer state
  assert report.flops > 3 * 2 * 16 * 32 * VOCAB * D / 8  # forward and backward of the head


@pytest.mark.slow
def test_the_nnx_llama_converts_and_trains_as_nnx_jit_does():
  # jax_overlap.examples.nnx_llama: nnx.vmap'd blocks under nnx.scan(nnx.remat), weights
  # split over both axes of a (4, 2) mesh, AdamW with clipping, the step under nnx.jit.
  from jax_overlap.examples import nnx_llama

  cfg = nnx_llama.Config(
    layers=2,
    hidden=64,
    mlp=128,
    heads=4,
    kv_heads=2,
    seq=32,
    vocab=128,
    model_axis=2,
    dtype="float32",  # activations too: the comparison is to float32 rounding
  )
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  step = nnx_llama.make_step(cfg)
  ov = jax_overlap.overlap(step, target="h100x8", gspmd="convert", cache=False)
  model, optimizer = nnx_llama.init(cfg, mesh)
  twin, twin_opt = nnx_llama.init(cfg, mesh)
  tokens = nnx_llama.random_tokens(cfg, mesh, jax.random.key(1))
  with jax.set_mesh(mesh):
    e = ov.explain(twin, twin_opt, tokens)
    assert e.chosen.startswith("shard_map form"), e.chosen
    for _ in range(2):
      want = step(model, optimizer, tokens)
      got = ov(twin, twin_opt, tokens)
      np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for a, b in zip(_params(model), _params(twin)):
    np.testing.assert_allclose(a, b, atol=3e-5)  # a tenth of the learning rate
  # Deviceless, on the target's mesh: the update is in the program the analysis compiles.
  fn, args = nnx_llama.build("h100x8", **dataclasses.asdict(cfg))
  report = jax_overlap.analyze(fn, *args, target="h100x8")
  params = sum(
    math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
    for a in jax.tree.leaves(nnx.state(args[0], nnx.Param))
  )
  assert report.memory.outputs >= 2 * params > 0
