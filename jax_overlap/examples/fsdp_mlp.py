"""An FSDP MLP training step: the smallest program whose gathers can overlap.

``build()`` is a ``jax-overlap analyze`` builder::

    jax-overlap analyze jax_overlap.examples.fsdp_mlp:build --target h100x8
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["make_step", "build"]


def make_step(mesh: Mesh, learning_rate: float = 1e-3):
  """SGD step of a residual GELU MLP whose weights are sharded along ``fsdp``."""
  replicated = NamedSharding(mesh, P())

  def loss(ws, x):
    for w1, w2 in ws:
      w1 = jax.lax.with_sharding_constraint(w1, replicated)
      w2 = jax.lax.with_sharding_constraint(w2, replicated)
      x = x + jax.nn.gelu(x @ w1) @ w2
    return jnp.mean(jnp.square(x.astype(jnp.float32)))

  def step(ws, x):
    value, grads = jax.value_and_grad(loss)(ws, x)
    ws = jax.tree.map(
      lambda w, g: (w - learning_rate * g.astype(jnp.float32)).astype(w.dtype), ws, grads
    )
    return ws, value

  return step


def build(
  target: str = "h100x8",
  mesh: Mesh | None = None,
  layers: int = 4,
  hidden: int = 4096,
  mlp: int = 16384,
  tokens_per_device: int = 4096,
  dtype=jnp.bfloat16,
):
  """Returns (jitted step, (weights, activations)) as abstract arrays for ``target``."""
  from jax_overlap._src import targets as targets_lib

  if mesh is None:
    mesh = targets_lib.compile_only_mesh(target, ("fsdp",))
  n = mesh.shape["fsdp"]
  ps = NamedSharding(mesh, P("fsdp", None))
  ws = [
    (
      jax.ShapeDtypeStruct((hidden, mlp), dtype, sharding=ps),
      jax.ShapeDtypeStruct((mlp, hidden), dtype, sharding=ps),
    )
    for _ in range(layers)
  ]
  x = jax.ShapeDtypeStruct((tokens_per_device * n, hidden), dtype, sharding=ps)
  out = (jax.tree.map(lambda a: a.sharding, ws), NamedSharding(mesh, P()))
  return jax.jit(make_step(mesh), out_shardings=out), (ws, x)
