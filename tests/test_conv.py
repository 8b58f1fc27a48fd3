"""Convolutions in the GSPMD step's shard_map form: the batch stays split (data
parallelism), a kernel split over the batch's axis is gathered (FSDP), weight gradients
are sums over the devices; values equal to the jitted step's."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap._src.transform import to_shard_map


class CNN(nn.Module):
  """Convolutions as vision models write them: padded, strided, grouped, BatchNorm, max and
  average pooling."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(16, (3, 3))(x)))
    x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))
    x = nn.max_pool(nn.Conv(32, (3, 3), feature_group_count=4)(x), (2, 2), strides=(2, 2))
    x = nn.avg_pool(x, (3, 3), padding="SAME")
    return nn.Dense(10)(x.mean(axis=(1, 2)))


class PatchEmbed(nn.Module):
  """A vision transformer's patch embedding (a convolution with stride = patch) and MLP."""

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(64, (4, 4), strides=4, padding="VALID")(x)
    x = nn.LayerNorm()(x.reshape(x.shape[0], -1, x.shape[-1]))
    x = nn.Dense(64)(nn.gelu(nn.Dense(128)(x)))
    return nn.Dense(10)(x.mean(1))


@pytest.mark.parametrize("model, fsdp", [(CNN(), False), (PatchEmbed(), True)])
def test_a_convolutional_step_is_converted_on_its_batch_split(model, fsdp):
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  x = jax.random.normal(jax.random.key(1), (16, 16, 16, 3))
  y = jax.random.randint(jax.random.key(2), (16,), 0, 10)
  variables = model.init(jax.random.key(0), x)

  def spec(a):  # FSDP: kernels split along their output features
    split = fsdp and a.ndim >= 2 and a.shape[-1] % 8 == 0
    return P(*[None] * (a.ndim - 1), "data") if split else P()

  variables = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec(a))), variables)
  rows = NamedSharding(mesh, P("data"))
  x, y = jax.device_put(x, rows), jax.device_put(y, rows)
  tx = optax.sgd(0.1)

  @jax.jit
  def step(variables, x, y):
    def loss(params):
      rest = {k: v for k, v in variables.items() if k != "params"}
      logits, new = model.apply({"params": params, **rest}, x, mutable=list(rest))
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new

    (value, new), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"])
    updates, _ = tx.update(grads, tx.init(variables["params"]))
    return {"params": optax.apply_updates(variables["params"], updates), **new}, value

  leaves = jax.tree.leaves((variables, x, y))
  conv = to_shard_map.convert(
    jax.make_jaxpr(step)(variables, x, y), leaves, params_leaves=range(len(leaves) - 2)
  )
  assert conv.replicated == []  # no convolution or pooling computed whole on every device
  (body,) = [
    e.params["jaxpr"]
    for e in jax.make_jaxpr(conv.fn)(*leaves).jaxpr.eqns
    if e.primitive.name == "shard_map"
  ]
  text = str(body)
  # The images are never gathered: each device convolves its own.
  assert "f32[2,16,16,3]" in text and "f32[16,16,16,3]" not in text
  if fsdp:  # the kernel gathered at its use, its gradient reduce-scattered
    assert "all_gather" in text and conv.collectives.get("reduce-scatter")
  got = jax.jit(conv.fn)(*leaves)
  want = jax.tree.leaves(step(variables, x, y))
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
