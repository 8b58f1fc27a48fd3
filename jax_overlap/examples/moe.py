"""A mixture-of-experts decoder under plain ``jax.jit``: expert parallelism over an
``expert`` mesh axis, FSDP over every device for the other weights.

Written as GShard and the Switch Transformer write it, with sharding constraints and no
``shard_map``: each block is causal attention followed by an MoE MLP whose router sends
every token to its top-1 expert, within a capacity per sequence
(``top_k * capacity_factor * seq / experts`` tokens; the rest pass through the residual;
``top_k=2``: each token to its two most likely experts, as GShard and Mixtral route). Tokens
are dispatched by one-hot einsums, and the experts' inputs are constrained to the
``expert`` axis, so XLA's partitioner moves the tokens from their sequence's device to
their expert's (an all-to-all) and back. The experts' weights are split over ``expert``
(and along their model dimension over ``data``, gathered at use); every other weight is
split along its model dimension over ``(data, expert)`` and gathered at use, as MaxText's
rules shard ``embed`` over its fsdp and expert axes. The blocks run under ``lax.scan`` over
``jax.checkpoint`` (``scan=False``: a Python loop); the loss is next-token cross-entropy
plus the Switch load-balancing loss; the step is optax AdamW with gradient clipping.

``@jax_overlap.overlap`` converts the step to ``shard_map``; where a split moves between
dimensions (tokens split by sequence going to experts split by expert) the conversion
inserts an all-to-all, as the partitioner does, when the cost model says it beats the
gather::

  step, args = moe.build("h100x8")            # abstract arrays, deviceless
  jax_overlap.overlap(step, target="h100x8").explain(*args)

``build()`` is a ``jax-overlap analyze`` builder.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.examples.flax_llama import abstract_opt_state, optax_step, optimizer

__all__ = [
  "Config",
  "FSDP",
  "mesh_for",
  "param_specs",
  "loss_fn",
  "make_step",
  "build",
  "build_small",
  "init",
  "random_tokens",
]

# The axes the non-expert weights and the batch are split over (every device).
FSDP = ("data", "expert")


@dataclasses.dataclass(frozen=True)
class Config:
  """Model and run configuration (``mlp``: each expert's hidden size)."""

  layers: int = 4
  hidden: int = 2048
  mlp: int = 8192
  heads: int = 16
  experts: int = 8
  capacity_factor: float = 1.25
  top_k: int = 1  # experts per token (Switch: 1; GShard, Mixtral: 2)
  seq: int = 2048
  batch_per_device: int = 1
  vocab: int = 32000
  dtype: str = "bfloat16"
  scan: bool = True  # lax.scan over jax.checkpoint; False: a Python loop over the blocks
  aux_weight: float = 0.01  # the load-balancing loss's weight

  def __post_init__(self):
    for f in ("layers", "hidden", "mlp", "heads", "experts", "seq", "batch_per_device", "vocab"):
      if getattr(self, f) <= 0:
        raise ValueError(f"moe.Config: {f} must be positive, got {getattr(self, f)}")
    if self.hidden % self.heads:
      raise ValueError(
        f"moe.Config: hidden ({self.hidden}) must be divisible by heads ({self.heads})"
      )
    if not 1 <= self.top_k <= self.experts:
      raise ValueError(
        f"moe.Config: top_k must be between 1 and experts ({self.experts}), got {self.top_k}"
      )
    if self.capacity_factor <= 0:
      raise ValueError(f"moe.Config: capacity_factor must be positive, got {self.capacity_factor}")

  @property
  def capacity(self) -> int:
    """Tokens of one sequence each expert takes."""
    return max(1, math.ceil(self.top_k * self.seq * self.capacity_factor / self.experts))


def mesh_for(target: str, cfg: Config) -> Mesh:
  """``target``'s compile-only (data, expert) mesh: as many devices on ``expert`` as there
  are experts (or devices, if fewer), the rest on ``data``."""
  from jax_overlap._src import targets as targets_lib

  n = targets_lib.get(target).num_devices
  expert = math.gcd(n, cfg.experts)
  return targets_lib.compile_only_mesh(target, {"data": n // expert, "expert": expert})


def _layer_specs() -> dict:
  return {
    "ln1": P(None),
    "ln2": P(None),
    "wq": P(FSDP, None),
    "wk": P(FSDP, None),
    "wv": P(FSDP, None),
    "wo": P(None, FSDP),
    "router": P(FSDP, None),
    "wi": P("expert", "data", None),  # [experts, hidden, mlp]
    "wo_e": P("expert", None, "data"),  # [experts, mlp, hidden]
  }


def _layer_shapes(cfg: Config) -> dict:
  d, f, e = cfg.hidden, cfg.mlp, cfg.experts
  return {
    "ln1": (d,),
    "ln2": (d,),
    "wq": (d, d),
    "wk": (d, d),
    "wv": (d, d),
    "wo": (d, d),
    "router": (d, e),
    "wi": (e, d, f),
    "wo_e": (e, f, d),
  }


def param_specs(cfg: Config) -> dict:
  """Each parameter's PartitionSpec (stacked blocks: a leading unsplit layer dimension)."""
  layer = _layer_specs()
  if cfg.scan:
    blocks = {k: P(None, *s) for k, s in layer.items()}
  else:
    blocks = [dict(layer) for _ in range(cfg.layers)]
  return {"embed": P(None, FSDP), "blocks": blocks, "norm": P(None), "head": P(FSDP, None)}


def _shapes(cfg: Config) -> dict:
  layer = _layer_shapes(cfg)
  if cfg.scan:
    blocks = {k: (cfg.layers, *s) for k, s in layer.items()}
  else:
    blocks = [dict(layer) for _ in range(cfg.layers)]
  d, v = cfg.hidden, cfg.vocab
  return {"embed": (v, d), "blocks": blocks, "norm": (d,), "head": (d, v)}


def _constrain(mesh: Mesh, x, *spec):
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


def _norm(x, scale):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * scale).astype(x.dtype)


def _moe(cfg: Config, mesh: Mesh, w: dict, x):
  """Top-k routing within a capacity per sequence (first choices placed before second
  ones): (the experts' outputs, combined per token and weighted by its gates, the
  load-balancing loss)."""
  b, s, _ = x.shape
  e, c, k = cfg.experts, cfg.capacity, cfg.top_k
  router = _constrain(mesh, w["router"], None, None).astype(x.dtype)
  probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)  # [b, s, e]
  gates, choice = jax.lax.top_k(probs, k)  # [b, s, k]
  if k > 1:  # the chosen experts' weights, normalized (GShard, Mixtral)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  routed = jax.nn.one_hot(choice, e, dtype=jnp.float32)  # [b, s, k, e]
  # Each choice's place in its expert's buffer: all first choices in sequence order, then
  # the second ones; past the capacity, none.
  ranked = jnp.swapaxes(routed, 1, 2).reshape(b, k * s, e)
  place = jnp.sum((jnp.cumsum(ranked, axis=1) - 1.0) * ranked, axis=-1)
  place = jnp.swapaxes(place.reshape(b, k, s), 1, 2).astype(jnp.int32)  # [b, s, k]
  kept = routed * (place < c)[..., None]
  slots = jax.nn.one_hot(place, c, dtype=jnp.float32)[..., None, :]  # [b, s, k, 1, c]
  dispatch = jnp.sum(kept[..., None] * slots, axis=2)  # [b, s, e, c]
  combine = jnp.sum((kept * gates[..., None])[..., None] * slots, axis=2)
  # The tokens of each expert, from every sequence: on the expert's devices.
  xin = jnp.einsum("bsd,bsec->ebcd", x, dispatch.astype(x.dtype))
  xin = _constrain(mesh, xin, "expert", "data", None, None)
  wi = _constrain(mesh, w["wi"], "expert", None, None).astype(x.dtype)
  wo = _constrain(mesh, w["wo_e"], "expert", None, None).astype(x.dtype)
  h = jax.nn.gelu(jnp.einsum("ebcd,edf->ebcf", xin, wi))
  out = _constrain(mesh, jnp.einsum("ebcf,efd->ebcd", h, wo), "expert", "data", None, None)
  y = jnp.einsum("ebcd,bsec->bsd", out, combine.astype(x.dtype))
  y = _constrain(mesh, y, FSDP, None, None)
  # Switch Transformer's loss: experts times the sum of (share routed first x mean
  # probability).
  balance = e * jnp.sum(jnp.mean(routed[:, :, 0], axis=(0, 1)) * jnp.mean(probs, axis=(0, 1)))
  return y, balance


def _block(cfg: Config, mesh: Mesh, x, w: dict):
  b, s, d = x.shape
  nh, hd = cfg.heads, cfg.hidden // cfg.heads

  def gathered(name):
    return _constrain(mesh, w[name], None, None).astype(x.dtype)

  y = _norm(x, w["ln1"])
  q = (y @ gathered("wq")).reshape(b, s, nh, hd)
  k = (y @ gathered("wk")).reshape(b, s, nh, hd)
  v = (y @ gathered("wv")).reshape(b, s, nh, hd)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(hd)
  logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e30)
  attn = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
  x = x + jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, s, d) @ gathered("wo")
  y, balance = _moe(cfg, mesh, w, _norm(x, w["ln2"]))
  return x + y, balance


def loss_fn(cfg: Config, mesh: Mesh, params: dict, tokens) -> jax.Array:
  """Next-token cross-entropy plus ``aux_weight`` times the mean load-balancing loss."""
  dtype = jnp.dtype(cfg.dtype)
  embed = _constrain(mesh, params["embed"], None, None).astype(dtype)
  x = _constrain(mesh, jnp.take(embed, tokens, axis=0), FSDP, None, None)
  if cfg.scan:

    @jax.checkpoint
    def body(x, w):
      return _block(cfg, mesh, x, w)

    x, balance = jax.lax.scan(body, x, params["blocks"])
    balance = jnp.mean(balance)
  else:
    terms = []
    for w in params["blocks"]:
      x, term = _block(cfg, mesh, x, w)
      terms.append(term)
    balance = sum(terms) / len(terms)
  x = _norm(x, params["norm"])
  logits = (x @ _constrain(mesh, params["head"], None, None).astype(dtype)).astype(jnp.float32)
  labels = jnp.roll(tokens, -1, axis=1)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.mean(jnp.sum(logp * jax.nn.one_hot(labels, cfg.vocab, dtype=logp.dtype), axis=-1))
  return nll + cfg.aux_weight * balance


def make_step(cfg: Config, mesh: Mesh):
  """The jitted train step ``(params, opt_state, tokens) -> (params, opt_state, loss)``
  (optax AdamW with clipping; parameters and optimizer state donated)."""
  return optax_step(functools.partial(loss_fn, cfg, mesh))


def _abstract(cfg: Config, mesh: Mesh):
  """(params, opt_state, tokens) as ShapeDtypeStructs laid out by :func:`param_specs`
  (parameters in float32, as optax keeps them)."""
  params = jax.tree.map(
    lambda shape, spec: jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=NamedSharding(mesh, spec)
    ),
    _shapes(cfg),
    param_specs(cfg),
    is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x),
  )
  batch = cfg.batch_per_device * mesh.devices.size
  tokens = jax.ShapeDtypeStruct(
    (batch, cfg.seq), jnp.int32, sharding=NamedSharding(mesh, P(FSDP, None))
  )
  return params, abstract_opt_state(params, mesh), tokens


def build(target: str = "h100x8", mesh: Mesh | None = None, **overrides):
  """Builder for ``jax-overlap analyze``: (jitted train step, (params, opt_state, tokens))
  as abstract arrays on ``target``'s (data, expert) mesh."""
  cfg = Config(**overrides)
  mesh = mesh if mesh is not None else mesh_for(target, cfg)
  for axis in FSDP:
    if axis not in mesh.shape:
      raise ValueError(f"moe.build: the mesh needs axes {FSDP}, got {tuple(mesh.shape)}")
  if cfg.experts % mesh.shape["expert"]:
    raise ValueError(
      f"moe.build: experts ({cfg.experts}) must be divisible by the expert axis's size "
      f"({mesh.shape['expert']})"
    )
  return make_step(cfg, mesh), _abstract(cfg, mesh)


def build_small(target: str = "h100x8", **overrides):
  """A small configuration that compiles in seconds, for quick looks."""
  sizes = dict(layers=2, hidden=512, mlp=1024, heads=8, seq=256, vocab=4096)
  return build(target, **{**sizes, **overrides})


def init(cfg: Config, mesh: Mesh, key):
  """Real (params, opt_state) on ``mesh``, laid out as :func:`build`'s arguments: weights
  normal with variance one over their input features, the embedding normal(0.02), norms
  one."""
  params_a, opt_a, _ = _abstract(cfg, mesh)
  paths, tree = jax.tree_util.tree_flatten_with_path(params_a)
  keys = jax.random.split(key, len(paths))

  def make(k, like, name):
    if name in ("ln1", "ln2", "norm"):
      return jnp.ones(like.shape, like.dtype)
    fan_in = {"embed": 1 / 0.02**2, "wo_e": cfg.mlp}.get(name, cfg.hidden)
    return jax.random.normal(k, like.shape, like.dtype) / np.sqrt(fan_in)

  def name_of(path):
    return next(p.key for p in reversed(path) if hasattr(p, "key"))

  params = jax.tree.unflatten(
    tree,
    [
      jax.jit(functools.partial(make, like=a, name=name_of(path)), out_shardings=a.sharding)(k)
      for k, (path, a) in zip(keys, paths)
    ],
  )
  opt_state = jax.jit(optimizer().init, out_shardings=jax.tree.map(lambda a: a.sharding, opt_a))(
    params
  )
  return params, opt_state


def random_tokens(cfg: Config, mesh: Mesh, key):
  """A batch of random token ids laid out as :func:`build`'s ``tokens``."""
  _, _, like = _abstract(cfg, mesh)
  ids = jax.random.randint(key, like.shape, 0, cfg.vocab, jnp.int32)
  return jax.device_put(ids, like.sharding)
