"""A Llama-style decoder written with ``shard_map`` and explicit FSDP collectives.

Every weight is sharded along ``fsdp`` (dimension 0, or 1 when layers are
stacked) and all-gathered inside the layer that uses it; autodiff turns each
gather into a gradient reduce-scatter. Four forms of the layer loop:

* ``form="unrolled"``: a Python loop over layers;
* ``form="scan"``: stacked layers under ``lax.scan`` with the gathers inside the body;
* ``form="scan_remat"``: the same under ``jax.checkpoint`` (nothing saved: the backward
  loop gathers every layer again), as scanned and rematerialized models are written;
* ``form="scan_layers"``: stacked layers through ``jax_overlap.fsdp.scan_layers``
  (gather of layer i+1 carried into iteration i, reduce-scatter of layer i's
  gradient one iteration late).

On a 2-D mesh (``fsdp`` x another axis) the batch is split over both axes and
the weights over ``fsdp`` only. The layer is :mod:`.fsdp_transformer`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.examples.fsdp_transformer import LayerDims, check_sizes, layer_shapes

__all__ = ["Config", "init_params", "abstract_params", "make_loss", "make_step", "build"]

FORMS = ("unrolled", "scan", "scan_remat", "scan_layers")


@dataclasses.dataclass(frozen=True)
class Config(LayerDims):
  """Model and run configuration: :mod:`.fsdp_transformer`'s sizes, and the loop's form."""

  dtype: str = "bfloat16"
  form: str = "unrolled"
  learning_rate: float = 1e-3
  fsdp_axis: str = "fsdp"
  prefetch: int = 1  # for form="scan_layers"

  def __post_init__(self):
    if self.form not in FORMS:
      raise ValueError(f"Config: form must be one of {', '.join(FORMS)}, got {self.form!r}")
    check_sizes(self)


_MATS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")


def _stacked(cfg: Config) -> bool:
  return cfg.form != "unrolled"


def _layer_spec(cfg: Config, name: str) -> P:
  fs = cfg.fsdp_axis
  if name.startswith("ln"):
    return P(None, None) if _stacked(cfg) else P(None)
  return P(None, fs, None) if _stacked(cfg) else P(fs, None)


def param_specs(cfg: Config):
  layer = {k: _layer_spec(cfg, k) for k in layer_shapes(cfg)}
  return layer if _stacked(cfg) else [dict(layer) for _ in range(cfg.layers)]


def abstract_params(cfg: Config, mesh: Mesh):
  dtype = jnp.dtype(cfg.dtype)

  def one(name, shape):
    shape = (cfg.layers, *shape) if _stacked(cfg) else shape
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, _layer_spec(cfg, name)))

  layer = {k: one(k, s) for k, s in layer_shapes(cfg).items()}
  if _stacked(cfg):
    return layer
  return [{k: one(k, s) for k, s in layer_shapes(cfg).items()} for _ in range(cfg.layers)]


def init_params(cfg: Config, mesh: Mesh, key: jax.Array):
  abstract = abstract_params(cfg, mesh)
  flat, tree = jax.tree_util.tree_flatten_with_path(abstract)
  keys = jax.random.split(key, len(flat))
  out = []
  for k, (path, a) in zip(keys, flat):
    name = str(getattr(path[-1], "key", ""))
    if name.startswith("ln"):
      x = jnp.ones(a.shape, a.dtype)
    else:
      x = (jax.random.normal(k, a.shape, jnp.float32) / math.sqrt(a.shape[-2])).astype(a.dtype)
    out.append(jax.device_put(x, a.sharding))
  return jax.tree.unflatten(tree, out)


def _rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def layer_compute(cfg: Config, p: dict, x: jax.Array) -> jax.Array:
  """One decoder layer on gathered (full) weights."""
  b, s, h = x.shape
  nh, hd = cfg.heads, h // cfg.heads
  y = _rms_norm(x, p["ln1"])
  q = (y @ p["wq"]).reshape(b, s, nh, hd)
  k = (y @ p["wk"]).reshape(b, s, nh, hd)
  v = (y @ p["wv"]).reshape(b, s, nh, hd)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(hd)
  logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e30)
  attn = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
  o = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, s, h)
  x = x + o @ p["wo"]
  y = _rms_norm(x, p["ln2"])
  return x + (jax.nn.silu(y @ p["w1"]) * (y @ p["w3"])) @ p["w2"]


def _gather_layer(cfg: Config, p: dict) -> dict:
  out = {}
  for k, w in p.items():
    out[k] = w if k.startswith("ln") else jax.lax.all_gather(w, cfg.fsdp_axis, axis=0, tiled=True)
  return out


def make_loss(cfg: Config, mesh: Mesh):
  """loss(params, x): mean squared output, computed under shard_map."""
  batch_axes = tuple(a for a in mesh.axis_names)
  n_batch = math.prod(mesh.shape[a] for a in batch_axes)

  def body(params, x):
    if cfg.form == "unrolled":
      for p in params:
        x = layer_compute(cfg, _gather_layer(cfg, p), x)
    elif cfg.form in ("scan", "scan_remat"):

      def step(x, p):
        return layer_compute(cfg, _gather_layer(cfg, p), x), None

      if cfg.form == "scan_remat":  # as MaxText and Flax's nn.scan users write it
        step = jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable)
      x, _ = jax.lax.scan(step, x, params)
    else:
      from jax_overlap import fsdp

      mats = {k: v for k, v in params.items() if not k.startswith("ln")}
      norms = {k: v for k, v in params.items() if k.startswith("ln")}

      def layer_fn(p, x):
        return layer_compute(cfg, p, x)

      # Norm scales are replicated; gather only the sharded matrices.
      x, _ = fsdp.scan_layers(
        lambda full, x: (layer_fn({**full["mats"], **full["norms"]}, x), None),
        {"mats": mats, "norms": norms},
        x,
        axis=cfg.fsdp_axis,
        prefetch=cfg.prefetch,
        gather_dim={"mats": {k: 0 for k in mats}, "norms": {k: None for k in norms}},
      )
    local = jnp.mean(jnp.square(x.astype(jnp.float32)))
    return jax.lax.psum(local, batch_axes) / n_batch

  in_specs = (param_specs(cfg), P(batch_axes))
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P())


def make_step(cfg: Config, mesh: Mesh):
  loss = make_loss(cfg, mesh)

  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
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
  return jax.ShapeDtypeStruct(
    (cfg.batch_per_device * n, cfg.seq, cfg.hidden),
    jnp.dtype(cfg.dtype),
    sharding=NamedSharding(mesh, P(tuple(mesh.axis_names))),
  )


def build(target: str = "h100x8", mesh: Mesh | None = None, **overrides) -> tuple[Any, tuple]:
  """Builder for ``jax-overlap analyze``: (jitted step, (params, x)) as abstract arrays."""
  from jax_overlap._src import targets as targets_lib

  cfg = Config(**overrides)
  if mesh is None:
    mesh = targets_lib.compile_only_mesh(target, (cfg.fsdp_axis,))
  params = abstract_params(cfg, mesh)
  shardings = jax.tree.map(lambda a: a.sharding, params)
  step = jax.jit(make_step(cfg, mesh), out_shardings=(shardings, NamedSharding(mesh, P())))
  return step, (params, abstract_batch(cfg, mesh))
