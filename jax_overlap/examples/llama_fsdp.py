"""A whole Llama-style model trained with FSDP in ``shard_map``: token embedding, decoder layers
with grouped-query attention, output projection and next-token cross-entropy.

Every parameter, norm scales included, is sharded along ``fsdp`` on its first dimension (the
embedding table by rows, the output projection by its hidden rows) and all-gathered inside the
step; autodiff turns each gather into a gradient reduce-scatter. How the gathers are written:

* ``gather="per_use"``: each weight is gathered right where it is used (the gather sits beside
  its matmul, as a model written weight by weight does);
* ``gather="per_layer"``: a layer gathers all its weights at its start.

and how the layers are looped:

* ``form="unrolled"``: a Python loop over layers;
* ``form="scan_remat"``: stacked layers under ``lax.scan`` and ``jax.checkpoint`` (nothing
  saved: the backward loop gathers every layer again), as scanned models are written.

``build()`` is a ``jax-overlap analyze`` builder::

    jax-overlap analyze jax_overlap.examples.llama_fsdp:build --target h100x8
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["Config", "abstract_params", "init_params", "make_loss", "make_step", "build"]

FORMS = ("unrolled", "scan_remat")
GATHERS = ("per_use", "per_layer")


@dataclasses.dataclass(frozen=True)
class Config:
  """Model and run configuration (defaults: Llama-2-7B's layer, 8 layers, 8 KV heads)."""

  layers: int = 8
  hidden: int = 4096
  mlp: int = 11008
  heads: int = 32
  kv_heads: int = 8
  vocab: int = 32000
  seq: int = 2048
  batch_per_device: int = 1
  dtype: str = "bfloat16"
  form: str = "unrolled"
  gather: str = "per_use"
  learning_rate: float = 1e-3
  fsdp_axis: str = "fsdp"

  def __post_init__(self):
    if self.form not in FORMS:
      raise ValueError(f"Config: form must be one of {', '.join(FORMS)}, got {self.form!r}")
    if self.gather not in GATHERS:
      raise ValueError(f"Config: gather must be one of {', '.join(GATHERS)}, got {self.gather!r}")
    for f in ("layers", "hidden", "mlp", "heads", "kv_heads", "vocab", "seq", "batch_per_device"):
      if getattr(self, f) < 1:
        raise ValueError(f"Config: {f} must be >= 1, got {getattr(self, f)}")
    if self.hidden % self.heads or self.heads % self.kv_heads:
      raise ValueError(
        f"Config: heads ({self.heads}) must divide hidden ({self.hidden}) and be a multiple "
        f"of kv_heads ({self.kv_heads})"
      )


def layer_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
  """One layer's parameter shapes, in the order the layer uses them."""
  h, f = cfg.hidden, cfg.mlp
  kv = cfg.kv_heads * (h // cfg.heads)
  return {
    "ln1": (h,),
    "wq": (h, h),
    "wk": (h, kv),
    "wv": (h, kv),
    "wo": (h, h),
    "ln2": (h,),
    "w1": (h, f),
    "w3": (h, f),
    "w2": (f, h),
  }


def _stacked(cfg: Config) -> bool:
  return cfg.form != "unrolled"


def param_specs(cfg: Config) -> dict[str, Any]:
  fs = cfg.fsdp_axis
  lead = (None,) if _stacked(cfg) else ()
  layer = {k: P(*lead, fs, *([None] * (len(s) - 1))) for k, s in layer_shapes(cfg).items()}
  return {
    "embed": P(fs, None),
    "layers": layer if _stacked(cfg) else [dict(layer) for _ in range(cfg.layers)],
    "ln_f": P(fs),
    "head": P(fs, None),
  }


def _shapes(cfg: Config) -> dict[str, Any]:
  layer = layer_shapes(cfg)
  return {
    "embed": (cfg.vocab, cfg.hidden),
    "layers": (
      {k: (cfg.layers, *s) for k, s in layer.items()}
      if _stacked(cfg)
      else [dict(layer) for _ in range(cfg.layers)]
    ),
    "ln_f": (cfg.hidden,),
    "head": (cfg.hidden, cfg.vocab),
  }


def _is_shape(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def abstract_params(cfg: Config, mesh: Mesh) -> Any:
  dtype = jnp.dtype(cfg.dtype)
  return jax.tree.map(
    lambda shape, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)),
    _shapes(cfg),
    param_specs(cfg),
    is_leaf=_is_shape,
  )


def init_params(cfg: Config, mesh: Mesh, key: jax.Array) -> Any:
  """Real parameters on ``mesh``: norm scales one, matrices scaled normal."""
  abstract = abstract_params(cfg, mesh)
  flat, tree = jax.tree_util.tree_flatten_with_path(abstract)
  keys = jax.random.split(key, len(flat))

  def make(k, path, a):
    name = str(getattr(path[-1], "key", ""))
    if name.startswith("ln"):
      x = jnp.ones(a.shape, a.dtype)
    else:
      x = jax.random.normal(k, a.shape, jnp.float32) / math.sqrt(a.shape[-2])
    return jax.device_put(x.astype(a.dtype), a.sharding)

  return jax.tree.unflatten(tree, [make(k, path, a) for k, (path, a) in zip(keys, flat)])


def _rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _layer(cfg: Config, w, x):
  """One decoder layer; ``w(name)`` gives a weight, gathered."""
  b, s, h = x.shape
  nh, hd = cfg.heads, h // cfg.heads
  y = _rms_norm(x, w("ln1"))
  q = (y @ w("wq")).reshape(b, s, nh, hd)
  k = (y @ w("wk")).reshape(b, s, cfg.kv_heads, hd)
  v = (y @ w("wv")).reshape(b, s, cfg.kv_heads, hd)
  rep = nh // cfg.kv_heads
  k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(hd)
  logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e30)
  attn = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
  o = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, s, h)
  x = x + o @ w("wo")
  y = _rms_norm(x, w("ln2"))
  return x + (jax.nn.silu(y @ w("w1")) * (y @ w("w3"))) @ w("w2")


def make_loss(cfg: Config, mesh: Mesh):
  """loss(params, tokens, labels): mean next-token cross-entropy, under shard_map."""
  axes = tuple(mesh.axis_names)
  n_batch = math.prod(mesh.shape[a] for a in axes)

  def gather(x):
    return jax.lax.all_gather(x, cfg.fsdp_axis, axis=0, tiled=True)

  def run_layer(p, x):
    if cfg.gather == "per_layer":
      full = {k: gather(v) for k, v in p.items()}
      return _layer(cfg, full.__getitem__, x)
    return _layer(cfg, lambda name: gather(p[name]), x)

  def body(params, tokens, labels):
    x = jnp.take(gather(params["embed"]), tokens, axis=0)
    if _stacked(cfg):
      step = jax.checkpoint(
        lambda x, p: (run_layer(p, x), None), policy=jax.checkpoint_policies.nothing_saveable
      )
      x, _ = jax.lax.scan(step, x, params["layers"])
    else:
      for p in params["layers"]:
        x = run_layer(p, x)
    x = _rms_norm(x, gather(params["ln_f"]))
    logits = (x @ gather(params["head"])).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    local = -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))
    return jax.lax.psum(local, axes) / n_batch

  return jax.shard_map(
    body, mesh=mesh, in_specs=(param_specs(cfg), P(axes), P(axes)), out_specs=P()
  )


def make_step(cfg: Config, mesh: Mesh):
  """A plain SGD step: (params, tokens, labels) -> (params, loss)."""
  loss = make_loss(cfg, mesh)

  def step(params, tokens, labels):
    value, grads = jax.value_and_grad(loss)(params, tokens, labels)
    params = jax.tree.map(
      lambda w, g: (w.astype(jnp.float32) - cfg.learning_rate * g.astype(jnp.float32)).astype(
        w.dtype
      ),
      params,
      grads,
    )
    return params, value

  return step


def abstract_batch(cfg: Config, mesh: Mesh):
  n = mesh.devices.size
  sh = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  t = jax.ShapeDtypeStruct((cfg.batch_per_device * n, cfg.seq), jnp.int32, sharding=sh)
  return t, t


def build(target: str = "h100x8", mesh: Mesh | None = None, **overrides) -> tuple[Any, tuple]:
  """Builder for ``jax-overlap analyze``: (jitted step, (params, tokens, labels)), abstract."""
  from jax_overlap._src import targets as targets_lib

  cfg = Config(**overrides)
  if mesh is None:
    mesh = targets_lib.compile_only_mesh(target, (cfg.fsdp_axis,))
  params = abstract_params(cfg, mesh)
  shardings = jax.tree.map(lambda a: a.sharding, params)
  step = jax.jit(make_step(cfg, mesh), out_shardings=(shardings, NamedSharding(mesh, P())))
  return step, (params, *abstract_batch(cfg, mesh))
