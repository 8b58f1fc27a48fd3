"""A small GPT-style decoder trained with FSDP x tensor parallelism under shard_map.

Mesh axes ``(fsdp, tensor)``. Every weight is sharded over ``fsdp`` (ZeRO-3)
and all-gathered in the layer that uses it; attention heads and the MLP are
split over ``tensor`` (Megatron: column-parallel QKV and up-projections,
row-parallel output projections followed by a ``psum`` over ``tensor``). The
embedding table is tied to the output head. Token data comes from a seeded
order-2 Markov source (no downloads), so the loss has something to learn.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
  "Config",
  "init_params",
  "make_loss",
  "make_train_step",
  "init_opt_state",
  "token_batches",
  "build",
]


@dataclasses.dataclass(frozen=True)
class Config:
  """Model configuration."""

  vocab: int = 256
  layers: int = 2
  hidden: int = 128
  heads: int = 4
  mlp: int = 512
  seq: int = 64
  batch: int = 32  # global batch (split over fsdp)
  dtype: str = "float32"
  learning_rate: float = 1e-2

  def __post_init__(self):
    for f in ("vocab", "layers", "hidden", "heads", "mlp", "seq", "batch"):
      if getattr(self, f) < 1:
        raise ValueError(f"gpt.Config: {f} must be >= 1, got {getattr(self, f)}")
    if self.hidden % self.heads:
      raise ValueError(
        f"gpt.Config: hidden ({self.hidden}) must be divisible by heads ({self.heads})"
      )


# name -> (shape, PartitionSpec, dimension gathered over fsdp or None)
def _layer_params(cfg: Config) -> dict[str, tuple[tuple[int, ...], P, int | None]]:
  h, f = cfg.hidden, cfg.mlp
  col, row = P("fsdp", "tensor"), P("tensor", "fsdp")
  return {
    "ln1_scale": ((h,), P(), None),
    "ln1_bias": ((h,), P(), None),
    "wq": ((h, h), col, 0),
    "wk": ((h, h), col, 0),
    "wv": ((h, h), col, 0),
    "wo": ((h, h), row, 1),
    "ln2_scale": ((h,), P(), None),
    "ln2_bias": ((h,), P(), None),
    "w1": ((h, f), col, 0),
    "w2": ((f, h), row, 1),
  }


def _top_params(cfg: Config):
  return {
    "embed": ((cfg.vocab, cfg.hidden), P(None, "fsdp"), 1),
    "lnf_scale": ((cfg.hidden,), P(), None),
    "lnf_bias": ((cfg.hidden,), P(), None),
  }


def param_specs(cfg: Config):
  return {
    **{k: v[1] for k, v in _top_params(cfg).items()},
    "layers": [{k: v[1] for k, v in _layer_params(cfg).items()} for _ in range(cfg.layers)],
  }


def _gather_dims(cfg: Config):
  return {
    **{k: v[2] for k, v in _top_params(cfg).items()},
    "layers": [{k: v[2] for k, v in _layer_params(cfg).items()} for _ in range(cfg.layers)],
  }


def init_params(cfg: Config, mesh: Mesh, key: jax.Array):
  """Parameters, sharded on ``mesh``."""
  dtype = jnp.dtype(cfg.dtype)
  keys = iter(jax.random.split(key, 4 + 16 * cfg.layers))

  def make(name, shape, spec):
    if name.endswith("scale"):
      x = jnp.ones(shape, dtype)
    elif name.endswith("bias"):
      x = jnp.zeros(shape, dtype)
    else:
      x = (
        jax.random.normal(next(keys), shape, jnp.float32)
        * (0.02 if name == "embed" else 1 / math.sqrt(shape[0]))
      ).astype(dtype)
    return jax.device_put(x, NamedSharding(mesh, spec))

  top = {k: make(k, s, p) for k, (s, p, _) in _top_params(cfg).items()}
  layers = [
    {k: make(k, s, p) for k, (s, p, _) in _layer_params(cfg).items()} for _ in range(cfg.layers)
  ]
  return {**top, "layers": layers}


def _layer_norm(x, scale, bias):
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, -1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
  return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias).astype(x.dtype)


def _gather(w, dim):
  return w if dim is None else jax.lax.all_gather(w, "fsdp", axis=dim, tiled=True)


def make_loss(cfg: Config, mesh: Mesh):
  """loss(params, tokens) -> mean next-token cross-entropy, under shard_map."""
  t = mesh.shape["tensor"]
  if cfg.heads % t:
    raise ValueError(f"gpt: heads ({cfg.heads}) must be divisible by the tensor axis ({t})")
  hd = cfg.hidden // cfg.heads
  local_heads = cfg.heads // t
  dims = _gather_dims(cfg)
  n_fsdp = mesh.shape["fsdp"]

  def body(params, tokens):
    b, s = tokens.shape
    emb = _gather(params["embed"], dims["embed"])
    x = jnp.take(emb, tokens[:, :-1], axis=0)
    mask = jnp.tril(jnp.ones((s - 1, s - 1), bool))
    for p, d in zip(params["layers"], dims["layers"]):
      g = {k: _gather(v, d[k]) for k, v in p.items()}
      y = _layer_norm(x, g["ln1_scale"], g["ln1_bias"])
      q = (y @ g["wq"]).reshape(b, s - 1, local_heads, hd)
      k = (y @ g["wk"]).reshape(b, s - 1, local_heads, hd)
      v = (y @ g["wv"]).reshape(b, s - 1, local_heads, hd)
      logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(hd)
      attn = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1).astype(x.dtype)
      o = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, s - 1, local_heads * hd)
      x = x + jax.lax.psum(o @ g["wo"], "tensor")
      y = _layer_norm(x, g["ln2_scale"], g["ln2_bias"])
      x = x + jax.lax.psum(jax.nn.gelu(y @ g["w1"]) @ g["w2"], "tensor")
    x = _layer_norm(x, params["lnf_scale"], params["lnf_bias"])
    logits = (x @ emb.T).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
    return jax.lax.psum(jnp.mean(nll), "fsdp") / n_fsdp

  return jax.shard_map(body, mesh=mesh, in_specs=(param_specs(cfg), P("fsdp")), out_specs=P())


def init_opt_state(params):
  """Adam moments (zeros, sharded like the parameters) and the step count."""
  zeros = jax.tree.map(jnp.zeros_like, params)
  return {"m": zeros, "v": jax.tree.map(jnp.zeros_like, params), "count": jnp.zeros((), jnp.int32)}


def make_train_step(cfg: Config, mesh: Mesh, b1: float = 0.9, b2: float = 0.99, eps: float = 1e-8):
  """(params, opt_state, tokens) -> (params, opt_state, loss), with Adam."""
  loss_fn = make_loss(cfg, mesh)

  def step(params, opt, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    count = opt["count"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)
    c1 = 1 - b1 ** count.astype(jnp.float32)
    c2 = 1 - b2 ** count.astype(jnp.float32)
    params = jax.tree.map(
      lambda p, m, v: p - cfg.learning_rate * (m / c1) / (jnp.sqrt(v / c2) + eps), params, m, v
    )
    return params, {"m": m, "v": v, "count": count}, loss

  return step


def token_batches(cfg: Config, seed: int = 0):
  """An endless stream of token batches from a seeded Markov source.

  Each token has four likely successors (and 10% noise), so the best possible
  loss is about ln 4 + noise, well below the ln(vocab) of a uniform guess.
  """
  rng = np.random.default_rng(seed)
  table = rng.integers(0, cfg.vocab, size=(cfg.vocab, 4))
  while True:
    toks = np.empty((cfg.batch, cfg.seq), np.int32)
    toks[:, 0] = rng.integers(0, cfg.vocab, cfg.batch)
    for i in range(1, cfg.seq):
      ctx = toks[:, i - 1]
      choice = rng.integers(0, 4, cfg.batch)
      noise = rng.random(cfg.batch) < 0.1
      toks[:, i] = np.where(noise, rng.integers(0, cfg.vocab, cfg.batch), table[ctx, choice])
    yield toks


def build(target: str = "h100x8", **overrides) -> tuple[Any, tuple]:
  """Builder for ``jax-overlap analyze``: the train step and abstract arguments on a 4x2 mesh."""
  from jax_overlap._src import targets as targets_lib

  cfg = Config(**overrides)
  n = targets_lib.get(target).num_devices
  mesh = targets_lib.compile_only_mesh(target, {"fsdp": n // 2, "tensor": 2})
  dtype = jnp.dtype(cfg.dtype)
  top = {
    k: jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, p))
    for k, (s, p, _) in _top_params(cfg).items()
  }
  layers = [
    {
      k: jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, p))
      for k, (s, p, _) in _layer_params(cfg).items()
    }
    for _ in range(cfg.layers)
  ]
  params = {**top, "layers": layers}
  opt = {
    "m": params,
    "v": params,
    "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
  }
  tokens = jax.ShapeDtypeStruct(
    (cfg.batch, cfg.seq), jnp.int32, sharding=NamedSharding(mesh, P("fsdp"))
  )
  return jax.jit(make_train_step(cfg, mesh)), (params, opt, tokens)
