"""@overlap on Equinox steps written the Equinox way: an ``eqx.Module`` with a static field,
FSDP-sharded weights, optax, and a train step under ``eqx.filter_jit`` that returns the
new model."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap


class MLP(eqx.Module):
  layers: list
  act: callable = eqx.field(static=True)  # not an array: filter_jit keeps it static

  def __init__(self, key):
    keys = jax.random.split(key, 3)
    self.layers = [
      eqx.nn.Linear(128, 512, key=keys[0]),
      eqx.nn.Linear(512, 512, key=keys[1]),
      eqx.nn.Linear(512, 16, key=keys[2]),
    ]
    self.act = jax.nn.gelu

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = self.act(layer(x))
    return self.layers[-1](x)


OPT = optax.adam(1e-3)


@eqx.filter_jit
def train_step(model, opt_state, x, y):
  def loss_fn(m):
    return jnp.mean((jax.vmap(m)(x) - y) ** 2)

  loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
  updates, opt_state = OPT.update(grads, opt_state, eqx.filter(model, eqx.is_array))
  return eqx.apply_updates(model, updates), opt_state, loss


@pytest.fixture(scope="module")
def inputs():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

  def place(a):  # FSDP: each weight split along its first dimension
    spec = P("data") if a.ndim == 2 else P()
    return jax.device_put(a, NamedSharding(mesh, spec))

  model = jax.tree.map(lambda a: place(a) if eqx.is_array(a) else a, MLP(jax.random.key(0)))
  opt_state = OPT.init(eqx.filter(model, eqx.is_array))
  rows = NamedSharding(mesh, P("data"))
  x = jax.device_put(jax.random.normal(jax.random.key(1), (64, 128)), rows)
  y = jax.device_put(jax.random.normal(jax.random.key(2), (64, 16)), rows)
  return model, opt_state, x, y


def _arrays(tree):
  return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def test_a_filter_jit_step_runs_as_filter_jit_runs_it(inputs):
  ov = jax_overlap.overlap(train_step)
  assert isinstance(ov, jax_overlap._src.framework_jits.WrappedOverlapped)
  model, opt_state, want_loss = train_step(*inputs)
  with pytest.warns(jax_overlap.NothingToOverlapWarning) as said:
    got_model, got_state, got_loss = ov(*inputs)
  assert said[0].filename == __file__  # the user's line, through Equinox's frames
  assert float(got_loss) == float(want_loss)
  assert got_model.act is jax.nn.gelu  # the static field comes back as it went in
  for a, b in zip(_arrays((model, opt_state)), _arrays((got_model, got_state))):
    np.testing.assert_array_equal(a, b)
  # The analysis compiles filter_jit's jax.jit on the arrays (the static parts apart).
  report = jax_overlap.analyze(train_step, *inputs, target=None)
  assert report.flops > 2 * 3 * 64 * 512 * 512 / 8


def test_a_filter_jit_step_converted_for_a_target(inputs):
  ov = jax_overlap.overlap(train_step, target="h100x8", gspmd="convert", cache=False)
  e = ov.explain(*inputs)
  assert e.chosen.startswith("shard_map form"), e.chosen
  assert not [n for n in e.notes if n.startswith("variant not compiled") and "devices" in n]
  model, _, want_loss = train_step(*inputs)
  got_model, _, got_loss = ov(*inputs)
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  for a, b in zip(_arrays(model), _arrays(got_model)):
    np.testing.assert_allclose(a, b, atol=1e-4)  # Adam: a tenth of the learning rate
  report = jax_overlap.analyze(ov, *inputs, target="h100x8")
  (judged,) = [n for n in e.notes if n.startswith("chosen variant judged twice")]
  assert f"the analysis {report.step_time_s * 1e3:.3f} ms" in judged
