"""A Llama-style model in Flax (Linen) on a 2-D mesh: FSDP over ``data``, tensor
parallelism over ``model``, laid out by logical axis rules.

Grouped-query attention with rotary embeddings, a SwiGLU MLP and RMSNorm, the blocks under
``nn.scan(nn.remat(Block))``; every kernel carries logical axis names
(``nn.with_logical_partitioning``) that :data:`RULES` map onto the mesh: the embedding
dimension over ``data`` (each weight's FSDP shard) and the heads, the MLP and the
vocabulary over ``model`` (Megatron's column and row splits), so most weights are split
along two dimensions. The step is plain ``jax.jit`` over sharded arrays (optax AdamW with
gradient clipping, next-token cross-entropy): XLA's partitioner inserts every collective,
and ``@jax_overlap.overlap`` converts the step to ``shard_map`` to rewrite them.

  fn, args = flax_llama.build("h100x8")          # abstract arguments, deviceless
  jax_overlap.overlap(fn, target="h100x8").explain(*args)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
  "Config",
  "RULES",
  "abstract_opt_state",
  "build",
  "init",
  "make_model",
  "make_step",
  "optax_step",
  "optimizer",
  "random_tokens",
  "rope",
  "step_flops",
  "tokens_like",
]

# Logical axis -> mesh axis.
RULES = (
  ("batch", "data"),
  ("embed", "data"),
  ("heads", "model"),
  ("kv_heads", "model"),
  ("mlp", "model"),
  ("vocab", "model"),
  ("head_dim", None),
  ("seq", None),
  ("layers", None),
)


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int = 4
  hidden: int = 2048
  mlp: int = 5632
  heads: int = 16
  kv_heads: int = 4
  seq: int = 2048
  vocab: int = 32000
  batch_per_device: int = 1  # sequences per device of the ``data`` axis
  model_axis: int = 2  # devices of the ``model`` axis (the rest go to ``data``)
  dtype: str = "bfloat16"  # activations; parameters are float32, as Flax creates them

  def __post_init__(self):
    if self.hidden % self.heads or self.heads % self.kv_heads:
      raise ValueError(
        f"hidden ({self.hidden}) must divide by heads ({self.heads}) and heads by kv_heads "
        f"({self.kv_heads})"
      )
    if (self.hidden // self.heads) % 2:
      raise ValueError(f"the head dimension ({self.hidden // self.heads}) must be even (RoPE)")


def rope(x):
  """Rotary position embedding over the head dimension (pairs of even and odd features)."""
  s, hd = x.shape[1], x.shape[-1]
  freq = 1.0 / (10000.0 ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  t = jnp.arange(s, dtype=jnp.float32)[:, None] * freq[None]
  cos, sin = jnp.cos(t)[None, :, None], jnp.sin(t)[None, :, None]
  x1, x2 = x[..., ::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def make_model(cfg: Config):
  """The Linen model: token ids -> float32 logits."""
  from jax_overlap.examples.flax_optax import require

  nn, _ = require()
  dtype = jnp.dtype(cfg.dtype)
  hd = cfg.hidden // cfg.heads

  def kernel(names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)

  def dense(features, names, name, axis=-1):
    return nn.DenseGeneral(
      features, axis=axis, use_bias=False, dtype=dtype, kernel_init=kernel(names), name=name
    )

  class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
      init = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
      scale = self.param("scale", init, (x.shape[-1],))
      x32 = x.astype(jnp.float32)
      y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
      return (y * scale).astype(dtype)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      x = nn.with_logical_constraint(x, ("batch", "seq", "embed"))
      y = RMSNorm(name="attn_norm")(x)
      q = dense((cfg.heads, hd), ("embed", "heads", "head_dim"), "q")(y)
      k = dense((cfg.kv_heads, hd), ("embed", "kv_heads", "head_dim"), "k")(y)
      v = dense((cfg.kv_heads, hd), ("embed", "kv_heads", "head_dim"), "v")(y)
      q, k = rope(q), rope(k)
      group = cfg.heads // cfg.kv_heads
      k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
      logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(hd)
      mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
      probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1).astype(dtype)
      o = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
      x = x + dense(cfg.hidden, ("heads", "head_dim", "embed"), "o", axis=(-2, -1))(o)
      y = RMSNorm(name="mlp_norm")(x)
      gate = dense(cfg.mlp, ("embed", "mlp"), "gate")(y)
      up = dense(cfg.mlp, ("embed", "mlp"), "up")(y)
      return x + dense(cfg.hidden, ("mlp", "embed"), "down")(nn.silu(gate) * up), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      embed = nn.Embed(
        cfg.vocab,
        cfg.hidden,
        dtype=dtype,
        embedding_init=nn.with_logical_partitioning(
          nn.initializers.normal(0.02), ("vocab", "embed")
        ),
      )
      x = embed(tokens)
      stack = nn.scan(
        nn.remat(Block, prevent_cse=False),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=cfg.layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
      )
      x, _ = stack(name="blocks")(x, None)
      x = RMSNorm(name="final_norm")(x)
      return dense(cfg.vocab, ("embed", "vocab"), "head")(x).astype(jnp.float32)

  return Model()


def mesh_for(target: str, cfg: Config) -> Mesh:
  """The target's compile-only devices as a (data, model) mesh."""
  from jax_overlap._src import targets as targets_lib

  n = targets_lib.get(target).num_devices
  if n % cfg.model_axis:
    raise ValueError(f"{target} has {n} devices, not a multiple of model_axis={cfg.model_axis}")
  return targets_lib.compile_only_mesh(
    target, {"data": n // cfg.model_axis, "model": cfg.model_axis}
  )


def optimizer():
  """optax AdamW with gradient clipping (the step's optimizer)."""
  from jax_overlap.examples.flax_optax import require

  _, optax = require()
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))


def abstract_opt_state(params, mesh: Mesh):
  """:func:`optimizer`'s state for the abstract ``params``, laid out as the parameters it
  mirrors (what ``jax.jit(tx.init)`` gives real arrays), its step counts replicated."""
  from jax_overlap.examples.flax_optax import require

  _, optax = require()
  tx = optimizer()
  shardings = jax.tree.map(lambda a: a.sharding, params)
  replicated = NamedSharding(mesh, P())
  return optax.tree_map_params(
    tx,
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    jax.eval_shape(tx.init, params),
    shardings,
    transform_non_params=lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
  )


def make_step(cfg: Config):
  """The jitted train step ``(params, opt_state, tokens) -> (params, opt_state, loss)``
  (parameters and optimizer state donated); the layouts come from the arguments and the
  logical constraints."""
  from jax_overlap.examples.flax_optax import require

  nn, optax = require()
  model = make_model(cfg)

  def loss_fn(params, tokens):
    with nn.logical_axis_rules(RULES):
      logits = model.apply({"params": params}, tokens)
    labels = tokens[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels).mean()

  return optax_step(loss_fn)


def optax_step(loss_fn):
  """The jitted train step ``(params, opt_state, tokens) -> (params, opt_state, loss)`` of
  ``loss_fn(params, tokens)`` with :func:`optimizer` (parameters and optimizer state
  donated)."""
  from jax_overlap.examples.flax_optax import require

  _, optax = require()
  tx = optimizer()

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step


def tokens_like(cfg: Config, mesh: Mesh) -> jax.ShapeDtypeStruct:
  """The batch of token ids: ``cfg.batch_per_device`` sequences per device of ``data``."""
  batch = cfg.batch_per_device * mesh.shape["data"]
  return jax.ShapeDtypeStruct(
    (batch, cfg.seq), jnp.int32, sharding=NamedSharding(mesh, P("data", None))
  )


def _abstract(cfg: Config, mesh: Mesh):
  """(params, opt_state, tokens) as ShapeDtypeStructs laid out by :data:`RULES`."""
  from jax_overlap.examples.flax_optax import require

  nn, _ = require()
  model = make_model(cfg)
  tokens = tokens_like(cfg, mesh)
  with nn.logical_axis_rules(RULES):
    boxed = jax.eval_shape(model.init, jax.random.key(0), tokens)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
  params = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    nn.meta.unbox(boxed)["params"],
    shardings["params"],
  )
  return params, abstract_opt_state(params, mesh), tokens


def build(target: str = "h100x8", mesh: Mesh | None = None, **overrides):
  """Builder for ``jax-overlap analyze``: (jitted train step, (params, opt_state, tokens))
  as abstract arrays on ``target``'s (data, model) mesh."""
  cfg = Config(**overrides)
  mesh = mesh if mesh is not None else mesh_for(target, cfg)
  return make_step(cfg), _abstract(cfg, mesh)


def init(cfg: Config, mesh: Mesh, key):
  """Real (params, opt_state) on ``mesh``, laid out as :func:`build`'s arguments."""
  from jax_overlap.examples.flax_optax import require

  nn, _ = require()
  params_a, opt_a, tokens = _abstract(cfg, mesh)
  shardings = jax.tree.map(lambda a: a.sharding, params_a)
  model = make_model(cfg)
  with nn.logical_axis_rules(RULES):
    init_fn = jax.jit(
      lambda k: nn.meta.unbox(model.init(k, jnp.zeros(tokens.shape, jnp.int32)))["params"],
      out_shardings=shardings,
    )
    params = init_fn(key)
  # Laid out like the parameters it mirrors: jax.jit(tx.init) alone leaves the zeros it
  # makes on one device under newer JAX.
  opt_shardings = jax.tree.map(lambda a: a.sharding, opt_a)
  opt_state = jax.jit(optimizer().init, out_shardings=opt_shardings)(params)
  return params, opt_state


def random_tokens(cfg: Config, mesh: Mesh, key) -> jax.Array:
  """Token ids laid out as :func:`build`'s."""
  like = tokens_like(cfg, mesh)
  tokens = jax.random.randint(key, like.shape, 0, cfg.vocab, jnp.int32)
  return jax.device_put(tokens, like.sharding)


def step_flops(cfg: Config, data: int) -> float:
  """Matmul FLOPs of one training step over the whole batch (``data`` devices of the data
  axis, ``cfg.batch_per_device`` sequences each), counted from the model's shapes: each
  block's projections and attention (scores and values, causal mask not skipped) four
  times (forward, the forward again under ``nn.remat``, and the backward's two products),
  the output projection three times; the embedding lookup does no matmul. A count
  independent of XLA's, to check what a compiled step computes."""
  tokens = cfg.batch_per_device * data * cfg.seq
  hd = cfg.hidden // cfg.heads
  proj = cfg.hidden * hd * (2 * cfg.heads + 2 * cfg.kv_heads) + 3 * cfg.hidden * cfg.mlp
  attention = 4 * cfg.batch_per_device * data * cfg.seq**2 * cfg.heads * hd
  block = 2 * tokens * proj + attention
  return float(4 * cfg.layers * block + 3 * 2 * tokens * cfg.hidden * cfg.vocab)
