"""A tensor- and sequence-parallel transformer in Flax (Linen), written the MaxText way.

Kernels carry logical axis names (``nn.with_logical_partitioning``), activations are
constrained with ``nn.with_logical_constraint`` (the sequence split between blocks, the
heads and the MLP inside), each block is a pre-LayerNorm attention + MLP under
``nn.remat``, and the blocks run under ``nn.scan``. The step is plain ``jax.jit`` of
``jax.value_and_grad`` of the loss over sharded arrays: no collectives are written; XLA's
partitioner inserts them, and ``@jax_overlap.overlap`` converts the step to ``shard_map``
to rewrite them.

  fn, args = flax_tp.build("h100x8", hidden=8192, mlp=28672, heads=64, seq=8192)
  jax_overlap.overlap(fn, target="h100x8").explain(*args)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.examples.tp_sp import Sizes

__all__ = ["Config", "RULES", "build", "make_model"]

# Logical axis -> mesh axis.
RULES = (("seq", "tensor"), ("mlp", "tensor"), ("heads", "tensor"))


Config = Sizes  # the model's sizes: layers, hidden, mlp, heads, seq, batch, dtype


def make_model(cfg: Config, mesh: Mesh):
  """The Linen model: ``nn.scan`` over ``nn.remat`` blocks."""
  from jax_overlap.examples.flax_optax import require

  nn, _ = require()
  dtype = jnp.dtype(cfg.dtype)
  hd = cfg.hidden // cfg.heads
  c = functools.partial(nn.with_logical_constraint, mesh=mesh)
  init = nn.initializers.lecun_normal()

  def dense(features, names, **kw):
    return nn.DenseGeneral(
      features,
      use_bias=False,
      dtype=dtype,
      param_dtype=dtype,
      kernel_init=nn.with_logical_partitioning(init, names),
      **kw,
    )

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      x = c(x, (None, "seq", None))
      y = nn.LayerNorm(dtype=dtype, param_dtype=dtype)(x)
      q, k, v = (
        c(dense((cfg.heads, hd), (None, "heads", None), name=n)(y), (None, None, "heads", None))
        for n in ("query", "key", "value")
      )
      att = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / hd**0.5
      att = jax.nn.softmax(att, -1).astype(dtype)
      o = c(jnp.einsum("bhqk,bkhd->bqhd", att, v), (None, None, "heads", None))
      o = dense(cfg.hidden, ("heads", None, None), axis=(-2, -1), name="out")(o)
      x = x + c(o, (None, "seq", None))
      y = nn.LayerNorm(dtype=dtype, param_dtype=dtype)(x)
      m = c(dense(cfg.mlp, (None, "mlp"), name="up")(y), (None, None, "mlp"))
      m = dense(cfg.hidden, ("mlp", None), name="down")(nn.gelu(m))
      return x + c(m, (None, "seq", None)), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      stack = nn.scan(
        nn.remat(Block),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=cfg.layers,
        metadata_params={nn.PARTITION_NAME: None},
      )
      return stack(name="blocks")(x, None)[0]

  return Model()


def build(target: str = "h100x8", mesh: Mesh | None = None, **overrides):
  """(jitted ``value_and_grad`` step, (params, x)) as abstract arrays for ``target`` (a
  ``tensor`` axis over all its devices); ``tp_sp.random_inputs`` makes real ones."""
  from jax_overlap._src import targets as targets_lib
  from jax_overlap.examples.flax_optax import require

  nn, _ = require()
  cfg = Config(**overrides)
  if mesh is None:
    mesh = targets_lib.compile_only_mesh(target, ("tensor",))
  model = make_model(cfg, mesh)
  dtype = jnp.dtype(cfg.dtype)
  x_sharding = NamedSharding(mesh, P(None, "tensor"))
  x = jax.ShapeDtypeStruct((cfg.batch, cfg.seq, cfg.hidden), dtype, sharding=x_sharding)
  with nn.logical_axis_rules(RULES):
    boxed = jax.eval_shape(model.init, jax.random.key(0), x)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
  params = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    nn.meta.unbox(boxed),
    shardings,
  )

  def loss(p, x):
    with nn.logical_axis_rules(RULES):
      y = model.apply(p, x)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  return jax.jit(jax.value_and_grad(loss)), (params, x)
