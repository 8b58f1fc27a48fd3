"""The Llama-style model of :mod:`.flax_llama` written in Flax NNX, on a 2-D mesh: FSDP over
``data``, tensor parallelism over ``model``.

As NNX code writes it: Modules whose kernels carry their mesh axes
(``nnx.with_partitioning``), the blocks made by ``nnx.vmap`` and run by ``nnx.scan`` over
``nnx.remat``, an ``nnx.Optimizer`` (optax AdamW with gradient clipping), and a train step
under ``nnx.jit`` that updates the model and the optimizer in place. The layout is
:data:`.flax_llama.RULES`' (the embedding dimension over ``data``, heads, MLP and
vocabulary over ``model``), written as mesh axis names. XLA's partitioner inserts every
collective; ``@jax_overlap.overlap`` rewrites the ``jax.jit`` inside ``nnx.jit`` (its
shard_map form) and NNX updates the Modules as without it.

  step, args = nnx_llama.build("h100x8")          # abstract Modules, deviceless
  jax_overlap.overlap(step, target="h100x8").explain(*args)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.examples.flax_llama import Config, mesh_for, rope, step_flops

__all__ = ["Config", "build", "init", "make_model", "make_step", "random_tokens", "step_flops"]


def _nnx():
  try:
    import optax
    from flax import nnx
  except ImportError as e:
    raise ImportError(
      f"this example needs flax and optax ({e.name} is missing): pip install 'jax_overlap[train]'"
    ) from None
  return nnx, optax


def make_model(cfg: Config, rngs):
  """The NNX model (token ids -> float32 logits), its variables made where called (under
  ``jax.set_mesh``: laid out on that mesh)."""
  nnx, _ = _nnx()
  dtype = jnp.dtype(cfg.dtype)
  hd = cfg.hidden // cfg.heads

  def kernel(*axes):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)

  def dense(in_features, out_features, axes, rngs, axis=-1):
    return nnx.LinearGeneral(
      in_features, out_features, axis=axis, use_bias=False, dtype=dtype,
      kernel_init=kernel(*axes), rngs=rngs,
    )  # fmt: skip

  def norm(rngs):
    init = nnx.with_partitioning(nnx.initializers.ones, ("data",))
    return nnx.RMSNorm(cfg.hidden, epsilon=1e-6, dtype=dtype, scale_init=init, rngs=rngs)

  class Block(nnx.Module):
    def __init__(self, rngs):
      h = cfg.hidden
      self.attn_norm, self.mlp_norm = norm(rngs), norm(rngs)
      self.q = dense(h, (cfg.heads, hd), ("data", "model", None), rngs)
      self.k = dense(h, (cfg.kv_heads, hd), ("data", "model", None), rngs)
      self.v = dense(h, (cfg.kv_heads, hd), ("data", "model", None), rngs)
      self.o = dense((cfg.heads, hd), h, ("model", None, "data"), rngs, axis=(-2, -1))
      self.gate = dense(h, cfg.mlp, ("data", "model"), rngs)
      self.up = dense(h, cfg.mlp, ("data", "model"), rngs)
      self.down = dense(cfg.mlp, h, ("model", "data"), rngs)

    def __call__(self, x):
      y = self.attn_norm(x)
      q, k, v = rope(self.q(y)), rope(self.k(y)), self.v(y)
      group = cfg.heads // cfg.kv_heads
      k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
      logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(hd)
      mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
      probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1).astype(dtype)
      x = x + self.o(jnp.einsum("bhqk,bkhd->bqhd", probs, v))
      y = self.mlp_norm(x)
      return x + self.down(nnx.silu(self.gate(y)) * self.up(y))

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(
        cfg.vocab, cfg.hidden, dtype=dtype, rngs=rngs,
        embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), ("model", "data")),
      )  # fmt: skip

      @nnx.split_rngs(splits=cfg.layers)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
      def blocks(rngs):
        return Block(rngs)

      self.blocks = blocks(rngs)
      self.final_norm = norm(rngs)
      self.head = dense(cfg.hidden, cfg.vocab, ("data", "model"), rngs)

    def __call__(self, tokens):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry,
                transform_metadata={nnx.PARTITION_NAME: None})  # fmt: skip
      @nnx.remat
      def run(x, block):
        return block(x)

      x = run(self.embed(tokens), self.blocks)
      return self.head(self.final_norm(x)).astype(jnp.float32)

  return Model(rngs)


def make_step(cfg: Config):
  """The ``nnx.jit`` train step ``(model, optimizer, tokens) -> loss``, updating the model
  and the optimizer in place (both donated)."""
  nnx, optax = _nnx()

  @nnx.jit(donate_argnames=("model", "optimizer"))
  def train_step(model, optimizer, tokens):
    def loss_fn(model):
      logits = model(tokens)
      return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  return train_step


def _optimizer():
  _, optax = _nnx()
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))


def _tokens(cfg: Config, mesh: Mesh) -> jax.ShapeDtypeStruct:
  batch = cfg.batch_per_device * mesh.shape["data"]
  return jax.ShapeDtypeStruct(
    (batch, cfg.seq), jnp.int32, sharding=NamedSharding(mesh, P("data", None))
  )


def _made(cfg: Config, seed: int):
  nnx, _ = _nnx()
  model = make_model(cfg, nnx.Rngs(seed))
  return model, nnx.Optimizer(model, _optimizer(), wrt=nnx.Param)


def _laid_out(tree, mesh: Mesh, place):
  """``tree``'s Modules with each array placed (``place(array, sharding)``) by its
  partition metadata: Flax lays variables out as it makes them only while its
  ``flax_always_shard_variable`` is on, which a library may turn off (MaxText does)."""
  nnx, _ = _nnx()
  state = nnx.state(tree)
  specs = nnx.get_partition_spec(state)
  nnx.update(tree, jax.tree.map(lambda a, s: place(a, NamedSharding(mesh, s)), state, specs))
  return tree


def init(cfg: Config, mesh: Mesh, seed: int = 0):
  """Real (model, optimizer) laid out on ``mesh`` (made under ``jax.set_mesh``)."""
  with jax.set_mesh(mesh):
    return _laid_out(_made(cfg, seed), mesh, jax.device_put)


def build(target: str = "h100x8", mesh: Mesh | None = None, **overrides):
  """Builder for ``jax-overlap analyze``: (``nnx.jit`` train step, (model, optimizer,
  tokens)), the Modules' arrays abstract (``nnx.eval_shape``) on ``target``'s (data,
  model) mesh."""
  nnx, _ = _nnx()
  cfg = Config(**overrides)
  mesh = mesh if mesh is not None else mesh_for(target, cfg)
  with jax.set_mesh(mesh):
    made = nnx.eval_shape(lambda: _made(cfg, 0))
  model, optimizer = _laid_out(
    made, mesh, lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
  )
  return make_step(cfg), (model, optimizer, _tokens(cfg, mesh))


def random_tokens(cfg: Config, mesh: Mesh, key) -> jax.Array:
  """Token ids laid out as :func:`build`'s."""
  like = _tokens(cfg, mesh)
  return jax.device_put(jax.random.randint(key, like.shape, 0, cfg.vocab, jnp.int32), like.sharding)
