"""A Megatron-style tensor- and sequence-parallel transformer step in ``shard_map``.

Between blocks the activations are ``[batch, seq / N, hidden]`` (sequence parallel over the
``tensor`` axis of size N). Each block all-gathers the sequence before a fused QKV
(column-parallel) matmul, runs attention on its local heads, and reduce-scatters the
sequence after the row-parallel output projection; the MLP does the same around its up
(column-parallel) and down (row-parallel) matmuls. ``jax.value_and_grad`` of the loss runs
inside the ``shard_map``; gradients are returned, one per (local) weight.

  fn, args = tp_sp.build("h100x8", layers=2, hidden=8192, mlp=28672, heads=64, seq=8192)
  jax_overlap.analyze(fn, *args, target="h100x8")

``build_gspmd`` is the same block stack written as users write it for ``jax.jit`` over
sharded arrays: no collectives in the program, only ``with_sharding_constraint`` on the
activations (sequence-sharded between blocks, head- or MLP-sharded inside), separate Q, K
and V projections; XLA's partitioner inserts the gathers and reduce-scatters.

``attention_pieces`` (``build`` only) computes attention in that many pieces of query rows,
each piece's output projection reduce-scattered on its own (piece ``c`` holds rows ``c`` of
every device's block, so its reduce-scatter returns this device's rows ``c``): the
reduce-scatter of one piece can travel while the next piece's attention computes.
``scan_layers`` stacks the blocks' weights and runs the blocks under ``lax.scan`` (params
is then one dict of ``[layers, ...]`` arrays), and ``remat`` wraps each block in
``jax.checkpoint`` (both forms): the forms MaxText-style training code takes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Sizes:
  """A transformer's sizes (this example's and :mod:`.flax_tp`'s)."""

  layers: int = 2
  hidden: int = 1024
  mlp: int = 4096
  heads: int = 16
  seq: int = 1024
  batch: int = 1
  dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True)
class Config(Sizes):
  axis: str = "tensor"
  attention_pieces: int = 1  # query-row pieces of attention (see the module docstring)
  scan_layers: bool = False  # blocks under lax.scan over stacked weights
  remat: bool = False  # each block under jax.checkpoint


def _block(cfg: Config, x, w):
  n = jax.lax.axis_size(cfg.axis)
  heads = cfg.heads // n
  hd = cfg.hidden // cfg.heads
  xg = jax.lax.all_gather(x, cfg.axis, axis=1, tiled=True)  # [b, s, h]
  qkv = jnp.einsum("bsh,hk->bsk", xg, w["wqkv"])  # [b, s, 3 * heads * hd]
  b, s, _ = qkv.shape
  q, k, v = jnp.split(qkv.reshape(b, s, 3, heads, hd), 3, axis=2)
  q, k, v = (t[:, :, 0] for t in (q, k, v))
  blk, c = s // n, cfg.attention_pieces
  rows = q.reshape(b, n, blk, heads, hd)  # [b, device, row of its block, ...]
  outs = []
  for j in range(c):  # one piece: rows j of every device's block
    qj = rows[:, :, j * blk // c : (j + 1) * blk // c].reshape(b, n * blk // c, heads, hd)
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", qj, k).astype(jnp.float32) / hd**0.5, -1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att.astype(x.dtype), v).reshape(b, -1, heads * hd)
    o = jnp.einsum("bsk,kh->bsh", o, w["wo"])
    outs.append(jax.lax.psum_scatter(o, cfg.axis, scatter_dimension=1, tiled=True))
  x = x + (outs[0] if c == 1 else jnp.concatenate(outs, axis=1))
  xg = jax.lax.all_gather(x, cfg.axis, axis=1, tiled=True)
  h = jax.nn.gelu(jnp.einsum("bsh,hf->bsf", xg, w["w1"]))
  o = jnp.einsum("bsf,fh->bsh", h, w["w2"])
  return x + jax.lax.psum_scatter(o, cfg.axis, scatter_dimension=1, tiled=True)


def _stack(cfg: Config, block):
  """``(params, x) -> x`` through the blocks: under ``lax.scan`` over weights stacked along
  a leading dimension (``scan_layers``) or one after the other, each block under
  ``jax.checkpoint`` with ``remat``."""
  if cfg.remat:
    block = jax.checkpoint(block)

  def blocks(params, x):
    if cfg.scan_layers:
      return jax.lax.scan(lambda x, w: (block(x, w), None), x, params)[0]
    for w in params:
      x = block(x, w)
    return x

  return blocks


def _params_like(cfg: Config, block):
  """The parameters' structure from ``block(stacked)``, one block's dict: one dict with
  every leaf stacked over the blocks (``scan_layers``), else a list of one per block."""
  if cfg.scan_layers:
    return block(True)
  return [block(False) for _ in range(cfg.layers)]


def _spec(spec: P, stacked: bool) -> P:
  return P(None, *spec) if stacked else spec


def _param_specs(cfg: Config, specs: dict):
  """The parameters' PartitionSpecs from one block's ``specs``."""
  return _params_like(cfg, lambda stacked: {k: _spec(v, stacked) for k, v in specs.items()})


def _abstract_params(cfg: Config, mesh: Mesh, shapes: dict, specs: dict):
  dtype = jnp.dtype(cfg.dtype)
  return _params_like(
    cfg,
    lambda stacked: {
      k: jax.ShapeDtypeStruct(
        (cfg.layers, *shape) if stacked else shape,
        dtype,
        sharding=NamedSharding(mesh, _spec(specs[k], stacked)),
      )
      for k, shape in shapes.items()
    },
  )


def make_step(cfg: Config, mesh: Mesh):
  blocks = _stack(cfg, functools.partial(_block, cfg))

  def loss(params, x):
    x = blocks(params, x)
    return jax.lax.pmean(jnp.mean(jnp.square(x.astype(jnp.float32))), cfg.axis)

  def step(params, x):
    return jax.value_and_grad(loss)(params, x)

  specs = _param_specs(cfg, _specs(cfg))
  return jax.shard_map(
    step,
    mesh=mesh,
    in_specs=(specs, P(None, cfg.axis)),
    out_specs=(P(), specs),
  )


def _specs(cfg: Config) -> dict:
  col, row = P(None, cfg.axis), P(cfg.axis, None)
  return {"wqkv": col, "wo": row, "w1": col, "w2": row}


def _shapes(cfg: Config) -> dict:
  return {
    "wqkv": (cfg.hidden, 3 * cfg.hidden),
    "wo": (cfg.hidden, cfg.hidden),
    "w1": (cfg.hidden, cfg.mlp),
    "w2": (cfg.mlp, cfg.hidden),
  }


def build(target: str = "h100x8", mesh: Mesh | None = None, **overrides):
  """(jitted step, (params, x)) as abstract arrays for ``target`` (a ``tensor`` axis over
  all its devices)."""
  from jax_overlap._src import targets as targets_lib

  cfg = Config(**overrides)
  if mesh is None:
    mesh = targets_lib.compile_only_mesh(target, (cfg.axis,))
  n = mesh.shape[cfg.axis]
  c = cfg.attention_pieces
  if isinstance(c, bool) or not isinstance(c, int) or c < 1 or (cfg.seq // n) % c:
    raise ValueError(
      f"tp_sp.build: attention_pieces must be a positive int dividing each device's "
      f"{cfg.seq // n} sequence rows (seq {cfg.seq} over {n} devices), got {c!r}"
    )
  params = _abstract_params(cfg, mesh, _shapes(cfg), _specs(cfg))
  x = jax.ShapeDtypeStruct(
    (cfg.batch, cfg.seq, cfg.hidden),
    jnp.dtype(cfg.dtype),
    sharding=NamedSharding(mesh, P(None, cfg.axis)),
  )
  return jax.jit(make_step(cfg, mesh)), (params, x)


def random_inputs(args, seed: int = 0):
  """Random arrays laid out like ``args`` (``build``'s or ``build_gspmd``'s abstract
  arguments, on a mesh of real devices), scaled by each array's last dimension: what
  running the example needs."""
  leaves, tree = jax.tree.flatten(args)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(
    tree,
    [
      jax.device_put(jax.random.normal(k, a.shape, a.dtype) / a.shape[-1] ** 0.5, a.sharding)
      for k, a in zip(keys, leaves)
    ],
  )


def _gspmd_block(cfg: Config, mesh: Mesh, x, w):
  def c(t, *spec):
    return jax.lax.with_sharding_constraint(t, NamedSharding(mesh, P(*spec)))

  a = cfg.axis
  hd = cfg.hidden // cfg.heads
  b, s, _ = x.shape
  q, k, v = (
    c(
      c(jnp.einsum("bsh,hk->bsk", x, w[n]), None, None, a).reshape(b, s, cfg.heads, hd),
      None,
      None,
      a,
      None,
    )
    for n in ("wq", "wk", "wv")
  )
  att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / hd**0.5, -1)
  o = c(jnp.einsum("bhqk,bkhd->bqhd", att.astype(x.dtype), v), None, None, a, None)
  o = c(o.reshape(b, s, cfg.hidden), None, None, a)
  x = x + c(jnp.einsum("bsk,kh->bsh", o, w["wo"]), None, a, None)
  h = jax.nn.gelu(c(jnp.einsum("bsh,hf->bsf", x, w["w1"]), None, None, a))
  return x + c(jnp.einsum("bsf,fh->bsh", h, w["w2"]), None, a, None)


def _gspmd_specs(cfg: Config) -> dict:
  col, row = P(None, cfg.axis), P(cfg.axis, None)
  return {"wq": col, "wk": col, "wv": col, "wo": row, "w1": col, "w2": row}


def make_gspmd_step(cfg: Config, mesh: Mesh):
  """``value_and_grad`` of the loss of the block stack, for ``jax.jit`` (no shard_map)."""

  blocks = _stack(cfg, functools.partial(_gspmd_block, cfg, mesh))

  def loss(params, x):
    return jnp.mean(jnp.square(blocks(params, x).astype(jnp.float32)))

  return jax.value_and_grad(loss)


def build_gspmd(target: str = "h100x8", mesh: Mesh | None = None, **overrides):
  """(jitted GSPMD step, (params, x)) as abstract arrays for ``target``."""
  from jax_overlap._src import targets as targets_lib

  cfg = Config(**overrides)
  if mesh is None:
    mesh = targets_lib.compile_only_mesh(target, (cfg.axis,))
  if cfg.attention_pieces != 1:
    raise ValueError(
      "tp_sp.build_gspmd: attention_pieces is for the shard_map form (tp_sp.build); the "
      f"GSPMD form computes attention whole, got attention_pieces={cfg.attention_pieces!r}"
    )
  h = cfg.hidden
  shapes = {
    "wq": (h, h),
    "wk": (h, h),
    "wv": (h, h),
    "wo": (h, h),
    "w1": (h, cfg.mlp),
    "w2": (cfg.mlp, h),
  }
  params = _abstract_params(cfg, mesh, shapes, _gspmd_specs(cfg))
  x = jax.ShapeDtypeStruct(
    (cfg.batch, cfg.seq, h), jnp.dtype(cfg.dtype), sharding=NamedSharding(mesh, P(None, cfg.axis))
  )
  grads = jax.tree.map(
    lambda spec: NamedSharding(mesh, spec),
    _param_specs(cfg, _gspmd_specs(cfg)),
    is_leaf=lambda v: isinstance(v, P),
  )
  out = (NamedSharding(mesh, P()), grads)
  return jax.jit(make_gspmd_step(cfg, mesh), out_shardings=out), (params, x)
