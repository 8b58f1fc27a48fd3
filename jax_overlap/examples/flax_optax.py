"""Flax (Linen) + Optax with @jax_overlap.overlap: an FSDP MLP language model.

The Linen modules are applied layer by layer inside ``shard_map`` on gathered
parameters (each layer's weights all-gathered over ``fsdp`` right before use);
the Optax optimizer state is created by ``jax.jit(tx.init)`` and so is
sharded exactly like the parameters. The decorated step gives the same
numbers as the undecorated one.

  python -m jax_overlap.examples.flax_optax
"""

from __future__ import annotations

__all__ = ["require", "make_model", "init", "init_opt_state", "make_train_step", "build"]


def require():
  """Imports flax and optax, or says which extra installs them."""
  try:
    import flax.linen as nn
    import optax
  except ImportError as e:
    raise ImportError(
      f"this example needs flax and optax ({e.name} is missing): pip install 'jax_overlap[train]'"
    ) from None
  return nn, optax


def make_model(hidden: int = 64, layers: int = 3, vocab: int = 128):
  nn, _ = require()

  class Block(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
      y = nn.LayerNorm()(x)
      y = nn.Dense(4 * self.hidden)(y)
      y = nn.gelu(y)
      return x + nn.Dense(self.hidden)(y)

  blocks = [Block(hidden) for _ in range(layers)]
  embed = nn.Embed(vocab, hidden)
  head = nn.Dense(vocab)
  return embed, blocks, head


def init(key, mesh, hidden=64, layers=3, vocab=128):
  """Parameters per module, each leaf sharded over fsdp on its first dimension when it divides."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  embed, blocks, head = make_model(hidden, layers, vocab)
  keys = jax.random.split(key, layers + 2)
  x = jnp.zeros((1, hidden))
  params = {
    "embed": embed.init(keys[0], jnp.zeros((1,), jnp.int32))["params"],
    "blocks": [b.init(k, x)["params"] for b, k in zip(blocks, keys[1:-1])],
    "head": head.init(keys[-1], x)["params"],
  }
  n = mesh.shape["fsdp"]

  def spec(leaf):
    return P("fsdp") if leaf.ndim >= 1 and leaf.shape[0] % n == 0 else P()

  specs = jax.tree.map(spec, params)
  params = jax.tree.map(lambda p, s: jax.device_put(p, NamedSharding(mesh, s)), params, specs)
  return params, specs


def make_train_step(mesh, specs, hidden=64, layers=3, vocab=128, learning_rate=3e-3):
  """(params, opt_state, tokens) -> (params, opt_state, loss) with optax.adamw."""
  import jax
  from jax.sharding import PartitionSpec as P

  _, optax = require()
  embed, blocks, head = make_model(hidden, layers, vocab)
  tx = optax.adamw(learning_rate)
  n = mesh.shape["fsdp"]

  def gather(tree, spec_tree):
    return jax.tree.map(
      lambda p, s: jax.lax.all_gather(p, "fsdp", axis=0, tiled=True) if s == P("fsdp") else p,
      tree,
      spec_tree,
    )

  def body(params, tokens):
    x = embed.apply({"params": gather(params["embed"], specs["embed"])}, tokens[:, :-1])
    for block, p, s in zip(blocks, params["blocks"], specs["blocks"]):
      x = block.apply({"params": gather(p, s)}, x)
    logits = head.apply({"params": gather(params["head"], specs["head"])}, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return jax.lax.psum(loss, "fsdp") / n

  loss_fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P("fsdp")), out_specs=P())

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, tx


def init_opt_state(tx, params, mesh):
  """Optax state with every parameter-shaped subtree sharded like the parameters."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  pstruct = jax.tree.structure(params)
  is_params = lambda x: jax.tree.structure(x) == pstruct  # noqa: E731

  def shardings(sub):
    if is_params(sub):
      return jax.tree.map(lambda _, p: p.sharding, sub, params)
    return NamedSharding(mesh, P())

  out = jax.tree.map(shardings, jax.eval_shape(tx.init, params), is_leaf=is_params)
  return jax.jit(tx.init, out_shardings=out)(params)


def main():
  from jax_overlap.examples.cpu_devices import use_cpu_devices

  use_cpu_devices(8)
  import jax
  import numpy as np
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_overlap

  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  params, specs = init(jax.random.key(0), mesh)
  step, tx = make_train_step(mesh, specs)
  opt_state = init_opt_state(tx, params, mesh)
  rng = np.random.default_rng(0)
  plain, fast = jax.jit(step), jax_overlap.overlap(step)
  a = b = (params, opt_state)
  for i in range(5):
    tokens = jax.device_put(
      rng.integers(0, 128, (16, 33)).astype(np.int32), NamedSharding(mesh, P("fsdp"))
    )
    *a, la = plain(*a, tokens)
    *b, lb = fast(*b, tokens)
    print(f"step {i}: jit {float(la):.6f}  @overlap {float(lb):.6f}")


if __name__ == "__main__":
  main()


def build(
  target: str = "h100x8",
  hidden: int = 4096,
  layers: int = 8,
  vocab: int = 32000,
  seq: int = 2048,
  batch_per_device: int = 1,
):
  """Builder for ``jax-overlap analyze``: the jitted train step and abstract (params,
  opt_state, tokens) on ``target``'s compile-only mesh, at a training size."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_overlap._src import targets as targets_lib

  mesh = targets_lib.compile_only_mesh(target, ("fsdp",))
  n = mesh.shape["fsdp"]
  embed, blocks, head = make_model(hidden, layers, vocab)
  x = jnp.zeros((1, hidden))

  def shapes(key):
    keys = jax.random.split(key, layers + 2)
    return {
      "embed": embed.init(keys[0], jnp.zeros((1,), jnp.int32))["params"],
      "blocks": [b.init(k, x)["params"] for b, k in zip(blocks, keys[1:-1])],
      "head": head.init(keys[-1], x)["params"],
    }

  abstract = jax.eval_shape(shapes, jax.random.key(0))
  specs = jax.tree.map(
    lambda a: P("fsdp") if a.ndim >= 1 and a.shape[0] % n == 0 else P(), abstract
  )
  params = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
    abstract,
    specs,
  )
  step, tx = make_train_step(mesh, specs, hidden, layers, vocab)
  pstruct = jax.tree.structure(params)

  def like_params(sub):
    if jax.tree.structure(sub) == pstruct:
      return jax.tree.map(
        lambda a, p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=p.sharding), sub, params
      )
    return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), sub
    )

  opt_state = jax.tree.map(
    like_params,
    jax.eval_shape(tx.init, params),
    is_leaf=lambda s: jax.tree.structure(s) == pstruct,
  )
  tokens = jax.ShapeDtypeStruct(
    (batch_per_device * n, seq + 1), jnp.int32, sharding=NamedSharding(mesh, P("fsdp"))
  )
  return jax.jit(step), (params, opt_state, tokens)
