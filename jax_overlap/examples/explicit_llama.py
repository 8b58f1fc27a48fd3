"""The Llama-style model of :mod:`.flax_llama` in plain JAX with explicit sharding, on a
2-D mesh whose axes are Explicit (``jax.make_mesh``'s default): FSDP over ``data``,
tensor parallelism over ``model``.

As JAX's explicit-sharding docs write it: the layout is in the arrays' types; each weight
is gathered over ``data`` where a layer uses it (``jax.sharding.reshard``, cast to the
activations' dtype first), and a matmul that contracts a dimension split over ``model``
says where its result goes (``out_sharding=``, Megatron's all-reduce). The parameters are a
dict laid out as :data:`.flax_llama.RULES` lay out the Linen model's (the embedding
dimension over ``data``; heads, MLP and vocabulary over ``model``), the blocks run under
``lax.scan`` over ``jax.checkpoint``, grouped-query attention groups the query heads of a
KV head (no repeated keys), and the step is ``jax.jit`` with optax AdamW and gradient
clipping. XLA's partitioner inserts every collective; ``@jax_overlap.overlap`` converts the
step to ``shard_map`` to rewrite them.

  step, args = explicit_llama.build("h100x8")      # abstract arrays, deviceless
  with jax.set_mesh(explicit_llama.mesh_of(args)):  # bare PartitionSpecs need a mesh
    jax_overlap.overlap(step, target="h100x8").explain(*args)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.examples.flax_llama import (
  Config,
  abstract_opt_state,
  mesh_for,
  optax_step,
  optimizer,
  random_tokens,
  rope,
  step_flops,
  tokens_like,
)

__all__ = [
  "Config",
  "SPECS",
  "build",
  "build_small",
  "explicit_mesh",
  "init",
  "make_step",
  "mesh_of",
  "random_tokens",
  "step_flops",
]

# Each parameter's layout (the layer stack's leading dimension whole).
SPECS = {
  "embed": P("model", "data"),
  "final_norm": P("data"),
  "head": P("data", "model"),
  "layers": {
    "attn_norm": P(None, "data"),
    "mlp_norm": P(None, "data"),
    "q": P(None, "data", "model", None),
    "k": P(None, "data", "model", None),
    "v": P(None, "data", "model", None),
    "o": P(None, "model", None, "data"),
    "gate": P(None, "data", "model"),
    "up": P(None, "data", "model"),
    "down": P(None, "model", "data"),
  },
}
# Activations: sequences split over data.
_ACT = P("data", None, None)


def _shapes(cfg: Config) -> dict:
  h, hd, n = cfg.hidden, cfg.hidden // cfg.heads, cfg.layers
  return {
    "embed": (cfg.vocab, h),
    "final_norm": (h,),
    "head": (h, cfg.vocab),
    "layers": {
      "attn_norm": (n, h),
      "mlp_norm": (n, h),
      "q": (n, h, cfg.heads, hd),
      "k": (n, h, cfg.kv_heads, hd),
      "v": (n, h, cfg.kv_heads, hd),
      "o": (n, cfg.heads, hd, h),
      "gate": (n, h, cfg.mlp),
      "up": (n, h, cfg.mlp),
      "down": (n, cfg.mlp, h),
    },
  }


def explicit_mesh(mesh: Mesh) -> Mesh:
  """``mesh`` with every axis Explicit."""
  explicit = (jax.sharding.AxisType.Explicit,) * len(mesh.axis_names)
  return Mesh(mesh.devices, mesh.axis_names, axis_types=explicit)


def mesh_of(args) -> Mesh:
  """The mesh the arguments lie on (to run the step under, ``jax.set_mesh``)."""
  from jax_overlap._src.compile import retarget

  meshes = retarget.meshes_in(args)
  if not meshes:
    raise ValueError("no argument is laid out on a mesh (NamedSharding)")
  return meshes[0]


def _norm(x, scale, dtype):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * jax.sharding.reshard(scale, P())).astype(dtype)


def _block(cfg: Config, x, w):
  dtype = jnp.dtype(cfg.dtype)
  hd, group = cfg.hidden // cfg.heads, cfg.heads // cfg.kv_heads
  b, s = x.shape[:2]

  def gathered(name, spec):  # FSDP: the layer's weight whole over data, where it is used
    return jax.sharding.reshard(w[name].astype(dtype), spec)

  y = _norm(x, w["attn_norm"], dtype)
  heads = P(None, "model", None)
  q = rope(jnp.einsum("bsd,dhk->bshk", y, gathered("q", heads)))
  k = rope(jnp.einsum("bsd,dhk->bshk", y, gathered("k", heads)))
  v = jnp.einsum("bsd,dhk->bshk", y, gathered("v", heads))
  q = q.reshape(b, s, cfg.kv_heads, group, hd)
  logits = jnp.einsum("bqngd,bknd->bngqk", q, k).astype(jnp.float32) / np.sqrt(hd)
  mask = jnp.tril(jnp.ones((s, s), bool))
  probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1).astype(dtype)
  o = jnp.einsum("bngqk,bknd->bqngd", probs, v).reshape(b, s, cfg.heads, hd)
  x = x + jnp.einsum("bshk,hkd->bsd", o, gathered("o", P("model", None, None)), out_sharding=_ACT)
  y = _norm(x, w["mlp_norm"], dtype)
  gate = jnp.einsum("bsd,df->bsf", y, gathered("gate", P(None, "model")))
  up = jnp.einsum("bsd,df->bsf", y, gathered("up", P(None, "model")))
  down = gathered("down", P("model", None))
  return x + jnp.einsum("bsf,fd->bsd", jax.nn.silu(gate) * up, down, out_sharding=_ACT), None


def make_step(cfg: Config):
  """The jitted train step ``(params, opt_state, tokens) -> (params, opt_state, loss)``
  (parameters and optimizer state donated). Bare PartitionSpecs: run it under
  ``jax.set_mesh(mesh)``."""
  from jax_overlap.examples.flax_optax import require

  _, optax = require()
  dtype = jnp.dtype(cfg.dtype)
  block = jax.checkpoint(functools.partial(_block, cfg), prevent_cse=False)

  def loss_fn(params, tokens):
    table = jax.sharding.reshard(params["embed"].astype(dtype), P())
    x = table.at[tokens].get(out_sharding=_ACT)
    x, _ = jax.lax.scan(block, x, params["layers"])
    x = _norm(x, params["final_norm"], dtype)
    head = jax.sharding.reshard(params["head"].astype(dtype), P(None, "model"))
    logits = jnp.einsum("bsd,dv->bsv", x, head).astype(jnp.float32)
    # One-hot labels: the logits stay split over the vocabulary (an integer label's lookup
    # along a split dimension has no unambiguous layout).
    labels = jax.nn.one_hot(tokens[:, 1:], cfg.vocab, dtype=jnp.float32)
    return optax.softmax_cross_entropy(logits[:, :-1], labels).mean()

  return optax_step(loss_fn)


def _abstract(cfg: Config, mesh: Mesh):
  """(params, opt_state, tokens) as ShapeDtypeStructs laid out by :data:`SPECS`."""
  params = jax.tree.map(
    lambda shape, spec: jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=NamedSharding(mesh, spec)
    ),
    _shapes(cfg),
    SPECS,
    is_leaf=lambda x: isinstance(x, tuple),
  )
  return params, abstract_opt_state(params, mesh), tokens_like(cfg, mesh)


def build(target: str = "h100x8", mesh: Mesh | None = None, **overrides):
  """Builder for ``jax-overlap analyze``: (jitted train step, (params, opt_state, tokens))
  as abstract arrays on ``target``'s (data, model) mesh, its axes Explicit."""
  cfg = Config(**overrides)
  mesh = explicit_mesh(mesh if mesh is not None else mesh_for(target, cfg))
  return make_step(cfg), _abstract(cfg, mesh)


def build_small(target: str = "h100x8", **overrides):
  """A small configuration that compiles in seconds, for quick looks."""
  sizes = dict(layers=2, hidden=512, mlp=1408, heads=8, kv_heads=4, seq=256, vocab=4096)
  return build(target, **{**sizes, **overrides})


def init(cfg: Config, mesh: Mesh, key):
  """Real (params, opt_state) on ``mesh`` (its axes Explicit), laid out as :func:`build`'s
  arguments: kernels normal with variance one over their input features, the embedding
  normal(0.02), norms one."""
  params_a, opt_a, _ = _abstract(cfg, mesh)
  paths, tree = jax.tree_util.tree_flatten_with_path(params_a)
  keys = jax.random.split(key, len(paths))

  def make(k, like, name):
    if name.endswith("norm"):
      return jnp.ones(like.shape, like.dtype)
    scale = 0.02 if name == "embed" else 1.0 / np.sqrt(cfg.mlp if name == "down" else cfg.hidden)
    return scale * jax.random.normal(k, like.shape, like.dtype)

  params = jax.tree.unflatten(
    tree,
    [
      jax.jit(functools.partial(make, like=a, name=path[-1].key), out_shardings=a.sharding)(k)
      for k, (path, a) in zip(keys, paths)
    ],
  )
  opt_shardings = jax.tree.map(lambda a: a.sharding, opt_a)
  opt_state = jax.jit(optimizer().init, out_shardings=opt_shardings)(params)
  return params, opt_state
