"""A Llama-style decoder trained with FSDP (and optionally tensor parallelism).

Parameters are sharded along the ``fsdp`` mesh axis (ZeRO-3 style); each layer
gathers its weights right before use through sharding constraints and XLA
(GSPMD) inserts the all-gathers and gradient reduce-scatters. Layers are either
unrolled (a Python loop) or stacked and scanned with ``lax.scan`` (MaxText's
layout), optionally rematerialized (``remat=True``: ``jax.checkpoint`` around the
scanned layer). The same module gives real arrays for CPU training and abstract
``ShapeDtypeStruct`` arguments for deviceless analysis.

``build()`` is a ``jax-overlap analyze`` builder::

    jax-overlap analyze jax_overlap.examples.fsdp_transformer:build --target h100x8
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
  "Config",
  "check_sizes",
  "layer_shapes",
  "param_specs",
  "abstract_params",
  "init_params",
  "loss_fn",
  "make_step",
  "build",
]


@dataclasses.dataclass(frozen=True)
class LayerDims:
  """The layer stack's sizes (this example's and :mod:`.shard_map_fsdp`'s)."""

  layers: int = 8
  hidden: int = 4096
  mlp: int = 11008
  heads: int = 32
  seq: int = 2048
  batch_per_device: int = 1


@dataclasses.dataclass(frozen=True)
class Config(LayerDims):
  """Model and run configuration."""

  vocab: int = 0  # 0: no embedding (inputs are activations), as in layer-stack benchmarks
  dtype: str = "bfloat16"
  scan: bool = False
  remat: bool = False  # with scan: jax.checkpoint around the scanned layer (save nothing)
  learning_rate: float = 1e-3
  fsdp_axis: str = "fsdp"
  tensor_axis: str | None = None  # e.g. "tensor" for a 2-D mesh

  def __post_init__(self):
    check_sizes(self)


def check_sizes(cfg: Any) -> None:
  """Raises ValueError unless a layer config's sizes are positive and heads divide hidden."""
  for f in ("layers", "hidden", "mlp", "heads", "seq", "batch_per_device"):
    if getattr(cfg, f) < 1:
      raise ValueError(f"Config: {f} must be >= 1, got {getattr(cfg, f)}")
  if cfg.hidden % cfg.heads:
    raise ValueError(f"Config: hidden ({cfg.hidden}) must be divisible by heads ({cfg.heads})")


def layer_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
  """One layer's parameter shapes (attention without biases, SwiGLU MLP) for ``cfg.hidden``
  and ``cfg.mlp``."""
  h, f = cfg.hidden, cfg.mlp
  return {
    "ln1": (h,),
    "wq": (h, h),
    "wk": (h, h),
    "wv": (h, h),
    "wo": (h, h),
    "ln2": (h,),
    "w1": (h, f),
    "w3": (h, f),
    "w2": (f, h),
  }


def param_specs(cfg: Config) -> dict[str, Any]:
  """PartitionSpecs: every matrix sharded on its first dim along fsdp (and tensor on the other)."""
  t = cfg.tensor_axis
  fs = cfg.fsdp_axis
  col = {"wq", "wk", "wv", "w1", "w3"}  # column-parallel under tensor parallelism
  layer = {}
  for name, shape in layer_shapes(cfg).items():
    if len(shape) == 1:
      spec = (None,)
    elif t is None:
      spec = (fs, None)
    elif name in col:
      spec = (fs, t)
    else:
      spec = (t, fs)
    layer[name] = P(None, *spec) if cfg.scan else P(*spec)
  specs: dict[str, Any] = {
    "layers": layer if cfg.scan else [dict(layer) for _ in range(cfg.layers)]
  }
  if cfg.vocab:
    specs["embed"] = P(None, fs)
    specs["head"] = P(fs, None)
  return specs


def _shapes(cfg: Config) -> dict[str, Any]:
  layer = layer_shapes(cfg)
  if cfg.scan:
    layers = {k: (cfg.layers, *v) for k, v in layer.items()}
  else:
    layers = [dict(layer) for _ in range(cfg.layers)]
  out: dict[str, Any] = {"layers": layers}
  if cfg.vocab:
    out["embed"] = (cfg.vocab, cfg.hidden)
    out["head"] = (cfg.hidden, cfg.vocab)
  return out


def _is_shape(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def abstract_params(cfg: Config, mesh: Mesh) -> Any:
  """ShapeDtypeStructs of the parameters with their shardings on ``mesh``."""
  dtype = jnp.dtype(cfg.dtype)
  return jax.tree.map(
    lambda shape, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)),
    _shapes(cfg),
    param_specs(cfg),
    is_leaf=_is_shape,
  )


def init_params(cfg: Config, mesh: Mesh, key: jax.Array) -> Any:
  """Real parameters, sharded on ``mesh`` (norm scales one, matrices scaled normal)."""
  abstract = abstract_params(cfg, mesh)
  flat, tree = jax.tree_util.tree_flatten_with_path(abstract)
  keys = jax.random.split(key, len(flat))

  def make(k, path, a):
    name = str(getattr(path[-1], "key", ""))
    if name.startswith("ln"):
      x = jnp.ones(a.shape, a.dtype)
    else:
      x = (jax.random.normal(k, a.shape, jnp.float32) / math.sqrt(a.shape[-2])).astype(a.dtype)
    return jax.device_put(x, a.sharding)

  return jax.tree.unflatten(tree, [make(k, path, a) for k, (path, a) in zip(keys, flat)])


def _rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def layer_fn(cfg: Config, mesh: Mesh | None, p: dict, x: jax.Array) -> jax.Array:
  """One decoder layer: pre-norm attention and a SwiGLU MLP."""
  t = cfg.tensor_axis

  def g(name):
    w = p[name]
    if mesh is None or w.ndim == 1:
      return w
    if t is None:
      spec = P(None, None)
    elif name in ("wq", "wk", "wv", "w1", "w3"):
      spec = P(None, t)
    else:
      spec = P(t, None)
    return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec))

  b, s, h = x.shape
  nh = cfg.heads
  hd = h // nh
  y = _rms_norm(x, p["ln1"])
  q = (y @ g("wq")).reshape(b, s, nh, hd)
  k = (y @ g("wk")).reshape(b, s, nh, hd)
  v = (y @ g("wv")).reshape(b, s, nh, hd)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(hd)
  mask = jnp.tril(jnp.ones((s, s), bool))
  logits = jnp.where(mask, logits, -1e30)
  attn = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
  o = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, s, h)
  x = x + o @ g("wo")
  y = _rms_norm(x, p["ln2"])
  x = x + (jax.nn.silu(y @ g("w1")) * (y @ g("w3"))) @ g("w2")
  return x


def loss_fn(cfg: Config, mesh: Mesh | None, params: Any, batch: dict) -> jax.Array:
  """Mean squared activation (no vocab) or next-token cross-entropy (with vocab)."""
  if cfg.vocab:
    x = jnp.take(params["embed"], batch["tokens"], axis=0)
  else:
    x = batch["x"]
  if cfg.scan:

    def body(x, p):
      return layer_fn(cfg, mesh, p, x), None

    if cfg.remat:
      body = jax.checkpoint(body)
    x, _ = jax.lax.scan(body, x, params["layers"])
  else:
    for p in params["layers"]:
      x = layer_fn(cfg, mesh, p, x)
  if cfg.vocab:
    logits = (x @ params["head"]).astype(jnp.float32)
    labels = batch["labels"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))
  return jnp.mean(jnp.square(x.astype(jnp.float32)))


def make_step(cfg: Config, mesh: Mesh | None):
  """A plain SGD training step: (params, batch) -> (params, loss)."""

  def step(params, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, mesh, p, batch))(params)
    params = jax.tree.map(
      lambda w, g: (w - cfg.learning_rate * g.astype(jnp.float32)).astype(w.dtype), params, grads
    )
    return params, loss

  return step


def abstract_batch(cfg: Config, mesh: Mesh) -> dict:
  n = mesh.shape[cfg.fsdp_axis]
  b = cfg.batch_per_device * n  # the batch is split over fsdp only
  sh = NamedSharding(mesh, P(cfg.fsdp_axis))
  if cfg.vocab:
    return {
      "tokens": jax.ShapeDtypeStruct((b, cfg.seq), jnp.int32, sharding=sh),
      "labels": jax.ShapeDtypeStruct((b, cfg.seq), jnp.int32, sharding=sh),
    }
  return {"x": jax.ShapeDtypeStruct((b, cfg.seq, cfg.hidden), jnp.dtype(cfg.dtype), sharding=sh)}


def build(target: str = "h100x8", mesh: Mesh | None = None, **overrides):
  """Builder for ``jax-overlap analyze``: returns (jitted step, (params, batch)) abstractly."""
  from jax_overlap._src import targets as targets_lib

  cfg = Config(**overrides)
  if mesh is None:
    axes = {cfg.fsdp_axis: targets_lib.get(target).num_devices}
    if cfg.tensor_axis is not None:
      axes = {cfg.fsdp_axis: targets_lib.get(target).num_devices // 2, cfg.tensor_axis: 2}
    mesh = targets_lib.compile_only_mesh(target, axes)
  params = abstract_params(cfg, mesh)
  batch = abstract_batch(cfg, mesh)
  shardings = jax.tree.map(lambda a: a.sharding, params)
  step = jax.jit(
    make_step(cfg, mesh),
    out_shardings=(shardings, NamedSharding(mesh, P())),
    donate_argnums=(0,),
  )
  return step, (params, batch)


def build_scan(target: str = "h100x8", **overrides):
  """The scanned (lax.scan over stacked layers) form of :func:`build`."""
  return build(target, scan=True, **overrides)


def build_small(target: str = "h100x8", **overrides):
  """A small configuration that compiles in about a second, for quick looks."""
  defaults = dict(layers=4, hidden=1024, mlp=2816, heads=8, seq=512)
  defaults.update(overrides)
  return build(target, **defaults)
