"""GSPMD steps converted to their shard_map form: the same values, FSDP collectives."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap._src.transform import to_shard_map
from jax_overlap.examples import fsdp_transformer as G


def _mesh(shape, names):
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _convert(fn, args, params_argnums=(0,)):
  traced = fn.trace(*args)
  leaves = jax.tree.leaves(args)
  starts = np.cumsum([0, *[len(jax.tree.leaves(a)) for a in args]])
  params = [j for i in params_argnums for j in range(starts[i], starts[i + 1])]
  conv = to_shard_map.convert(
    traced.jaxpr, leaves, traced._params["out_shardings"], params_leaves=params
  )
  return conv, leaves


def _collectives(fn, leaves) -> dict[str, int]:
  text = str(jax.make_jaxpr(fn)(*leaves))
  return {k: text.count(k + "[") for k in ("all_gather", "reduce_scatter", "psum")}


def _assert_same(got, want, rtol=2e-5, atol=2e-6):
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def _transformer(mesh, **cfg):
  cfg = dict(hidden=32, mlp=64, heads=4, seq=8, dtype="float32", **cfg)
  fn, args = G.build(mesh=mesh, **cfg)
  c = G.Config(**cfg)
  params = G.init_params(c, mesh, jax.random.key(0))
  batch = {}
  for k, a in args[1].items():
    if a.dtype == jnp.int32:
      x = jax.random.randint(jax.random.key(1), a.shape, 0, c.vocab)
    else:
      x = jax.random.normal(jax.random.key(1), a.shape, a.dtype)
    batch[k] = jax.device_put(x, a.sharding)
  # The step donates its parameters: a fresh copy per call.
  fresh = lambda: jax.tree.map(lambda x: jax.device_put(jnp.array(x), x.sharding), params)  # noqa: E731
  return fn, fresh, batch


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(
  layers=st.integers(1, 3),
  form=st.sampled_from(["unrolled", "scan", "scan_remat", "vocab"]),
  devices=st.sampled_from([2, 4, 8]),
  batch_per_device=st.integers(1, 2),
)
def test_transformer_forms_compute_the_original(layers, form, devices, batch_per_device):
  mesh = _mesh((devices,), ("fsdp",))
  extra = {
    "unrolled": {},
    "scan": {"scan": True},
    "scan_remat": {"scan": True, "remat": True},
    "vocab": {"vocab": 64},
  }[form]
  fn, fresh, batch = _transformer(mesh, layers=layers, batch_per_device=batch_per_device, **extra)
  conv, leaves = _convert(fn, (fresh(), batch))
  got = jax.jit(conv.fn)(*leaves)
  want = jax.tree.leaves(fn(fresh(), batch))
  _assert_same(got, want)
  # FSDP: every split matrix is gathered at use and its gradient reduce-scattered; only
  # replicated parameters (norm scales) and the loss are all-reduced.
  n = _collectives(conv.fn, leaves)
  assert n["all_gather"] >= 7 * (1 if extra.get("scan") else layers)
  assert n["reduce_scatter"] >= 7 * (1 if extra.get("scan") else layers)
  assert not conv.replicated


def test_scanned_gradients_are_reduce_scattered_inside_the_loop():
  mesh = _mesh((8,), ("fsdp",))
  fn, fresh, batch = _transformer(mesh, layers=3, scan=True, remat=True)
  conv, leaves = _convert(fn, (fresh(), batch))
  smap = jax.make_jaxpr(conv.fn)(*leaves)
  (body,) = [e for e in smap.jaxpr.eqns if e.primitive.name == "shard_map"]
  scans = [e for e in body.params["jaxpr"].eqns if e.primitive.name == "scan"]
  assert len(scans) == 2
  forward, backward = sorted(scans, key=lambda e: e.params["reverse"])
  # The backward loop reduce-scatters each layer's gradients into its stacked outputs
  # (one per split matrix), so the scan pipeliner can issue them one iteration late.
  assert str(backward.params["jaxpr"]).count("reduce_scatter[") == 7
  assert str(forward.params["jaxpr"]).count("all_gather[") == 7
  assert conv.collectives["reduce-scatter"] == 7


def _adamw_step(mesh, batch_spec, dtype=jnp.float32):
  """A hand-written GSPMD step: embedding, two MLP blocks, optax.adamw, no constraints."""
  h, f, v = 32, 64, 48
  keys = jax.random.split(jax.random.key(0), 6)
  shapes = {
    "embed": ((v, h), P(None, "fsdp")),
    "w_in": ((2, h, f), P(None, "fsdp", None)),
    "w_out": ((2, f, h), P(None, None, "fsdp")),
    "scale": ((h,), P()),
    "head": ((h, v), P("fsdp", None)),
  }
  params = {
    k: jax.device_put(
      jax.random.normal(key, shape, dtype) / np.sqrt(shape[-2] if len(shape) > 1 else 1),
      NamedSharding(mesh, spec),
    )
    for key, (k, (shape, spec)) in zip(keys, shapes.items())
  }
  opt = optax.adamw(1e-2)
  # AdamW's moments laid out like their parameters (the step counter replicated).
  like = {x.shape: x.sharding for x in jax.tree.leaves(params)}
  state = jax.tree.map(
    lambda x: jax.device_put(x, like.get(x.shape, NamedSharding(mesh, P()))),
    jax.jit(opt.init)(params),
  )
  tokens = jax.random.randint(keys[5], (16, 4), 0, v)
  tokens = jax.device_put(tokens, NamedSharding(mesh, batch_spec))

  def loss_fn(p, tokens):
    x = p["embed"][tokens]
    for i in range(2):
      y = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["scale"]
      x = x + jax.nn.gelu(y @ p["w_in"][i]) @ p["w_out"][i]
    logits = x @ p["head"]
    logp = jax.nn.log_softmax(logits)
    labels = jnp.roll(tokens, 1, axis=1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

  def step(p, s, tokens):
    loss, g = jax.value_and_grad(loss_fn)(p, tokens)
    updates, s = opt.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss

  shardings = jax.tree.map(lambda x: x.sharding, (params, state))
  fn = jax.jit(step, out_shardings=(*shardings, NamedSharding(mesh, P())))
  return fn, (params, state, tokens)


@pytest.mark.parametrize(
  "shape,names,batch_spec",
  [((8,), ("fsdp",), P("fsdp")), ((2, 4), ("data", "fsdp"), P(("data", "fsdp")))],
)
def test_optax_step_without_constraints(shape, names, batch_spec):
  # Parameters split along dims 0, 1 or 2, no sharding constraints in the model, the
  # batch over the same or two mesh axes, AdamW's state laid out like the parameters.
  mesh = _mesh(shape, names)
  fn, args = _adamw_step(mesh, batch_spec)
  conv, leaves = _convert(fn, args, params_argnums=(0, 1))
  got = jax.jit(conv.fn)(*leaves)
  _assert_same(got, fn(*args), rtol=1e-4, atol=1e-5)
  n = _collectives(conv.fn, leaves)
  # Every split matrix's gradient is reduce-scattered (embed, head, and w_in and w_out of
  # both layers), over "fsdp" where the batch is also split over "data": then summed over
  # "data" on the scattered piece, not all-reduced whole (as a data x FSDP mesh wants).
  assert n["reduce_scatter"] == 6
  assert n["all_gather"] >= 4
  if len(shape) == 2:
    text = str(jax.make_jaxpr(conv.fn)(*leaves))
    assert re.search(r"reduce_scatter\[[^\]]*axis_name=\(?'?fsdp", text)
    assert re.search(r"psum\[[^\]]*axes=\('data',\)", text)


def _walk(jaxpr, in_loop=False):
  """(primitive, inside a loop, operand elements) of every equation of ``jaxpr``."""
  from jax_overlap._src.transform.jaxprs import subjaxprs

  for e in jaxpr.eqns:
    size = max(
      (int(np.prod(v.aval.shape)) for v in e.invars if hasattr(v.aval, "shape")), default=0
    )
    yield e.primitive.name, in_loop, size
    for sub in subjaxprs(e):
      yield from _walk(sub, in_loop or e.primitive.name in ("scan", "while"))


def test_scanned_step_written_as_maxtext_writes_it():
  # MaxText's patterns: layer weights stacked along dimension 1 and moved to the front for
  # the scan, activations named for the remat policy (checkpoint_name), an RMSNorm scale
  # multiplied in by an einsum, gradients clipped by their global norm, then AdamW (whose
  # first moment is g ** 1). Converted, the step gathers no activation, reduce-scatters
  # each layer's gradients inside the backward loop, and all-reduces nothing weight-sized.
  from jax.ad_checkpoint import checkpoint_name

  mesh = _mesh((8,), ("fsdp",))
  layers, d, f = 2, 32, 64
  shapes = {
    "wi": ((d, layers, f), P("fsdp", None, None)),
    "wo": ((f, layers, d), P(None, None, "fsdp")),
    "scale": ((d, layers), P("fsdp", None)),
  }
  keys = jax.random.split(jax.random.key(0), 4)
  params = {
    k: jax.device_put(jax.random.normal(key, shape) / np.sqrt(shape[0]), NamedSharding(mesh, spec))
    for key, (k, (shape, spec)) in zip(keys, shapes.items())
  }
  batch_sharding = NamedSharding(mesh, P("fsdp", None, None))
  x = jax.device_put(jax.random.normal(keys[3], (16, 4, d)), batch_sharding)

  def layer(h, w):
    wi, wo, scale = w
    n = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
    n = jax.lax.with_sharding_constraint(jnp.einsum("bsd,d->bsd", n, scale), batch_sharding)
    u = checkpoint_name(jnp.einsum("bsd,df->bsf", n, wi), "mlp")
    return h + jnp.einsum("bsf,fd->bsd", jax.nn.relu(u), wo), None

  policy = jax.checkpoint_policies.save_only_these_names("mlp")

  def loss_fn(p, x):
    stacked = tuple(jnp.moveaxis(p[k], 1, 0) for k in ("wi", "wo", "scale"))
    h, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, stacked)
    return jnp.mean(h**2)

  tx = optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(1e-2))
  like = {a.shape: a.sharding for a in jax.tree.leaves(params)}
  state = jax.tree.map(
    lambda a: jax.device_put(a, like.get(a.shape, NamedSharding(mesh, P()))),
    jax.jit(tx.init)(params),
  )

  def step(p, s, x):
    g = jax.grad(loss_fn)(p, x)
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  fn = jax.jit(step, out_shardings=jax.tree.map(lambda a: a.sharding, (params, state)))
  conv, leaves = _convert(fn, (params, state, x), params_argnums=(0, 1))
  _assert_same(jax.jit(conv.fn)(*leaves), fn(params, state, x))
  assert not conv.replicated
  found = list(_walk(jax.make_jaxpr(conv.fn)(*leaves).jaxpr))
  weight = d * f
  # Each layer's two matrix gradients, reduce-scattered in the backward loop.
  assert sum(1 for n, loop, size in found if n == "reduce_scatter" and loop and size >= weight) == 2
  assert not [(n, size) for n, _, size in found if n == "psum" and size >= weight // 8]
  # Gathers: the two matrices (forward and rematerialised backward) and the scale; the
  # activations stay split by batch.
  gathered = sorted(size for n, _, size in found if n == "all_gather")
  assert gathered == sorted([d // 8] * 2 + [weight // 8] * 4), gathered


def test_flax_nn_scan_remat_step():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      y = nn.LayerNorm()(x)
      y = nn.Dense(64)(y)
      return x + nn.Dense(32)(nn.relu(y)), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      stack = nn.scan(
        nn.remat(Block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=3,
      )
      x, _ = stack()(x, None)
      return jnp.mean(x**2)

  mesh = _mesh((8,), ("fsdp",))
  model = Model()
  x = jax.device_put(jax.random.normal(jax.random.key(1), (16, 32)), NamedSharding(mesh, P("fsdp")))
  params = model.init(jax.random.key(0), x)

  def spec(a):  # the largest dim divisible by the mesh, MaxText's FSDP rule
    dims = [d for d in np.argsort(a.shape)[::-1] if a.shape[d] % 8 == 0 and a.shape[d] > 8]
    s = [None] * a.ndim
    if dims:
      s[dims[0]] = "fsdp"
    return NamedSharding(mesh, P(*s))

  params = jax.tree.map(lambda a: jax.device_put(a, spec(a)), params)

  def step(p, x):
    loss, g = jax.value_and_grad(lambda p: model.apply(p, x))(p)
    return jax.tree.map(lambda w, g: w - 0.1 * g, p, g), loss

  fn = jax.jit(step, out_shardings=(jax.tree.map(lambda a: a.sharding, params), None))
  conv, leaves = _convert(fn, (params, x))
  _assert_same(jax.jit(conv.fn)(*leaves), fn(params, x))
  assert _collectives(conv.fn, leaves)["reduce_scatter"] >= 2


def test_refusals_name_the_reason():
  mesh = _mesh((2, 4), ("data", "fsdp"))
  fn = jax.jit(lambda w: w * 2)
  plain = jnp.ones((8, 8))
  with pytest.raises(to_shard_map.Refused, match="no argument is laid out over a mesh"):
    _convert(fn, (plain,))
  v = jax.device_put(jnp.ones((8,)), NamedSharding(mesh, P("fsdp")))

  def printed(v):
    jax.debug.print("{}", v.sum())
    return v * 2

  with pytest.raises(to_shard_map.Refused, match="side effects"):
    _convert(jax.jit(printed), (v,))
  # A constraint on another mesh than the arguments': named as the user wrote it.
  other = _mesh((8,), ("fsdp",))
  constrained = jax.jit(
    lambda v: jax.lax.with_sharding_constraint(v * 2, NamedSharding(other, P("fsdp")))
  )
  with pytest.raises(
    to_shard_map.Refused,
    match=r"a with_sharding_constraint is laid out on mesh \{'fsdp': 8\}, not the arguments' "
    r"mesh \{'data': 2, 'fsdp': 4\}: build the step with the arguments' mesh",
  ):
    _convert(constrained, (v,))
  # @overlap says why and runs the step as written.
  ov = jax_overlap.overlap(printed, gspmd="convert", cache=False)
  (note,) = [n for n in ov.explain(v).notes if n.startswith("not converted to shard_map")]
  assert "side effects" in note
  np.testing.assert_array_equal(np.asarray(ov(v)), np.asarray(v) * 2)


def test_layout_conversions_are_exact():
  # Every conversion the rules use, on a value split, summed or whole, against its
  # global meaning.
  mesh = _mesh((2, 4), ("data", "fsdp"))
  x = jax.random.normal(jax.random.key(0), (8, 12))
  it = to_shard_map.Interpreter(dict(mesh.shape), set(), {}, abstract=False)
  L = to_shard_map.Layout
  cases = [
    (L(((), ())), L((("fsdp",), ()))),
    (L((("fsdp",), ())), L(((), ()))),
    (L((("data", "fsdp"), ())), L(((), ("data",)))),
    (L(((), ()), frozenset({"fsdp"})), L((("fsdp",), ()))),
    (L(((), ()), frozenset({"fsdp", "data"})), L(((), ()))),
    (L(((), ())), L(((), ()), frozenset({"data"}))),
    # A split moved to another dimension over the same axes (each way round: the whole
    # value is gathered before a device keeps its piece along the new dimension).
    (L((("fsdp",), ())), L(((), ("fsdp",)))),
    (L(((), ("fsdp",))), L((("fsdp",), ()))),
    (L(((), ("fsdp",))), L((("data", "fsdp"), ()))),
  ]
  for src, dst in cases:
    # Per-device input laid out `src` (a sum: device 0 of each group holds x, the rest 0).
    def f(x, src=src, dst=dst):
      local = it.convert(None, x, L(((), ())), src) if not src.partial else x
      if src.partial:
        local = it.convert(None, x, L(((), ())), L(((), ()), src.partial))
        local = it.convert(None, local, L(((), ()), src.partial), src)
      out = it.convert(None, local, src, dst)
      if dst.partial:
        out = jax.lax.psum(out, tuple(sorted(dst.partial)))
        dst = L(dst.dims)
      return jax.lax.all_gather(
        it.convert(None, out, dst, L(((), ()))), ("data", "fsdp"), tiled=False
      )

    got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))(x)
    for g in np.asarray(got).reshape(-1, *x.shape):
      np.testing.assert_allclose(g, np.asarray(x), rtol=1e-6, atol=1e-6)


def test_a_transposed_value_constrained_as_before_the_transpose():
  # MaxText's RMSNorm: a dot_general of the fsdp-split scale with the batch-split
  # activations, transposed, then constrained to the batch split: the split moves from one
  # dimension to another over the same axis.
  mesh = _mesh((8,), ("fsdp",))
  scale = jax.device_put(
    jax.random.normal(jax.random.key(0), (16,)), NamedSharding(mesh, P("fsdp"))
  )
  x = jax.device_put(
    jax.random.normal(jax.random.key(1), (8, 4, 16)), NamedSharding(mesh, P("fsdp"))
  )

  def f(scale, x):
    y = jax.lax.dot_general(scale, x, (((), ()), ((0,), (2,))))
    y = jnp.transpose(y, (1, 2, 0))
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P("fsdp")))

  conv, leaves = _convert(jax.jit(f), (scale, x))
  (got,) = jax.jit(conv.fn)(*leaves)
  np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(f)(scale, x)), rtol=1e-6)


@pytest.mark.slow
def test_overlap_chooses_among_both_forms(tmp_path):
  # A scanned, rematerialized GSPMD step on h100x8: the selection compiles the step as
  # written under compiler options and its shard_map form rewritten, deviceless.
  fn, args = G.build("h100x8", layers=2, hidden=256, mlp=512, heads=4, seq=128, scan=True,
                     remat=True)  # fmt: skip
  ov = jax_overlap.overlap(fn, target="h100x8", cache=False, schedule_from_estimates=False)
  e = ov.explain(*args)
  names = [n for n, _ in e.candidates]
  assert any(n.startswith("shard_map form, rewritten") for n in names)
  assert "as written, recommended flags" in names
  assert any(n.startswith("converted to shard_map") for n in e.notes)
  est = dict(e.candidates)
  assert est[e.chosen] == min(est.values())
  if e.chosen.startswith("shard_map form"):
    (conv,) = e.of_kind("convert")
    assert "reduce-scatter" in conv.detail
  if e.chosen.startswith("shard_map form, rewritten"):
    assert e.of_kind("prefetch")


def test_while_and_cond_bodies_are_converted():
  # A loop applying a split weight repeatedly, a cond on the batch's mean, a while loop
  # in the update: loop carries keep their split, the branches agree on their outputs.
  mesh = _mesh((4,), ("fsdp",))
  w = jax.device_put(
    jax.random.normal(jax.random.key(0), (16, 16)) / 4, NamedSharding(mesh, P("fsdp"))
  )
  x = jax.device_put(jax.random.normal(jax.random.key(1), (8, 16)), NamedSharding(mesh, P("fsdp")))

  def loss(w, x):
    y = jax.lax.fori_loop(0, 3, lambda i, y: jnp.tanh(y @ w) + i, x)
    y = jax.lax.cond(jnp.mean(y) > 0, lambda y: y * 2.0, lambda y: y - 1.0, y)
    return jnp.mean(y**2)

  def step(w, x):
    value, g = jax.value_and_grad(loss)(w, x)
    # A while loop outside autodiff (a differentiated fori_loop becomes a scan).
    _, new = jax.lax.while_loop(
      lambda c: c[0] < 2, lambda c: (c[0] + 1, 0.5 * (c[1] + w)), (0, w - 0.1 * g)
    )
    return new, value

  fn = jax.jit(step, out_shardings=(w.sharding, NamedSharding(mesh, P())))
  conv, leaves = _convert(fn, (w, x))
  _assert_same(jax.jit(conv.fn)(*leaves), fn(w, x))
  text = str(jax.make_jaxpr(conv.fn)(*leaves))
  assert "while[" in text and "cond[" in text


@pytest.mark.parametrize("devices,heads", [(2, 4), (8, 8), (8, 4)])
def test_tensor_parallel_step_gathers_activations_not_weights(devices, heads):
  """Sequence-split activations, column/row-split weights and constraints on the results
  (tp_sp.build_gspmd): each matmul gathers the activation the constraint asks for, as the
  partitioner does, in the backward too; no weight is gathered. With fewer heads than
  devices (a constraint the partitioner pads) the values are still the original's."""
  from jax_overlap.examples import tp_sp

  mesh = _mesh((devices,), ("tensor",))
  layers, cfg = 2, dict(hidden=32, mlp=64, heads=heads, seq=16, dtype="float32")
  fn, (shapes, xs) = tp_sp.build_gspmd(mesh=mesh, layers=layers, **cfg)
  keys = iter(jax.random.split(jax.random.key(0), 64))
  params = jax.tree.map(
    lambda s: jax.device_put(0.2 * jax.random.normal(next(keys), s.shape, s.dtype), s.sharding),
    shapes,
  )
  x = jax.device_put(jax.random.normal(next(keys), xs.shape, xs.dtype), xs.sharding)
  conv, leaves = _convert(fn, (params, x))
  _assert_same(jax.jit(conv.fn)(*leaves), jax.tree.leaves(fn(params, x)))
  assert not conv.replicated
  if heads % devices:
    return
  text = str(jax.make_jaxpr(conv.fn)(*leaves))
  gathered = [
    line.split("=")[0].split(":")[-1].strip() for line in text.splitlines() if "all_gather[" in line
  ]
  # Per block: the sequence before attention and before the MLP, and the two incoming
  # cotangents in the backward (whose gathered values the weight gradients reuse).
  assert len(gathered) == 4 * layers, gathered
  seq_whole = f"[1,{cfg['seq']},{cfg['hidden']}]"
  assert all(g.endswith(seq_whole) for g in gathered), gathered
  # Per block: after the output projection and the down projection, forward and
  # backward (the cotangents of the Q/K/V and up projections' inputs summed first).
  assert conv.collectives["reduce-scatter"] >= 3 * layers
  assert conv.collectives["all-reduce"] <= 1  # the loss


def test_a_reshaped_matmul_output_follows_the_constraint_after_the_reshape():
  """``(x @ w).reshape(b, s, heads, d)`` constrained to split heads after the reshape (as
  code that projects with a 2-D weight writes it): the constraint's layout is taken back
  through the reshape to the matmul, which gathers the sequence-split activation, not the
  column-split weight, as the partitioner does."""
  mesh = _mesh((8,), ("t",))
  h, s, heads = 64, 32, 8

  def c(t, *spec):
    return jax.lax.with_sharding_constraint(t, NamedSharding(mesh, P(*spec)))

  def loss(ws, x):
    wq, wo = ws
    q = c((x @ wq).reshape(1, s, heads, h // heads), None, None, "t", None)
    y = c(jnp.sin(q).reshape(1, s, h) @ wo, None, "t", None)
    return jnp.sum(jnp.square(y))

  fn = jax.jit(jax.value_and_grad(loss))
  keys = jax.random.split(jax.random.key(3), 3)
  ws = (
    jax.device_put(jax.random.normal(keys[0], (h, h)) / 8, NamedSharding(mesh, P(None, "t"))),
    jax.device_put(jax.random.normal(keys[1], (h, h)) / 8, NamedSharding(mesh, P("t", None))),
  )
  x = jax.device_put(jax.random.normal(keys[2], (1, s, h)), NamedSharding(mesh, P(None, "t")))
  conv, leaves = _convert(fn, (ws, x))
  _assert_same(jax.jit(conv.fn)(*leaves), jax.tree.leaves(fn(ws, x)))
  text = str(jax.make_jaxpr(conv.fn)(*leaves))
  gathered = [
    line.split("=")[0].split(":")[-1].strip() for line in text.splitlines() if "all_gather[" in line
  ]
  assert gathered and all(g.endswith(f"[1,{s},{h}]") for g in gathered), gathered


def test_a_norm_before_a_tensor_parallel_matmul_runs_on_the_shards():
  """A Flax block (jax_overlap.examples.flax_tp: nn.scan over nn.remat) whose LayerNorm of
  sequence-split activations feeds head- and MLP-split projections: the norm runs on this
  device's rows and its result is gathered next to the matmul, as the partitioner does,
  rather than the activations gathered first and normalized whole on every device (which
  also hides the gather -> matmul pair from the collective matmuls)."""
  from jax_overlap.examples import flax_tp, tp_sp

  mesh = _mesh((8,), ("tensor",))
  s = 64
  fn, args = flax_tp.build(mesh=mesh, layers=2, hidden=64, mlp=128, heads=8, seq=s, dtype="float32")
  params, x = tp_sp.random_inputs(args, seed=2)
  conv, leaves = _convert(fn, (params, x))
  _assert_same(jax.jit(conv.fn)(*leaves), jax.tree.leaves(fn(params, x)), rtol=1e-4, atol=1e-5)
  text = str(jax.make_jaxpr(conv.fn)(*leaves))
  norms = [
    line.split("=")[0].split(":")[-1].strip() for line in text.splitlines() if "rsqrt" in line
  ]
  assert norms and all(n.endswith(f"[1,{s // 8},1]") for n in norms), norms


@pytest.mark.parametrize("how", ["jitted", "overlap_kwargs"])
def test_overlap_shard_map_form_keeps_requested_out_shardings(how):
  # The step's requested output layouts, including ones that differ from the inputs'
  # (updated parameters returned replicated), hold for the shard_map form @overlap runs,
  # whether the user's jax.jit or @overlap's own jit keywords request them.
  mesh = _mesh((8,), ("fsdp",))
  fn, args = _adamw_step(mesh, P("fsdp"))
  replicated = NamedSharding(mesh, P())
  state_sh = jax.tree.map(lambda x: x.sharding, args[1])
  outs = (jax.tree.map(lambda _: replicated, args[0]), state_sh, replicated)
  want = jax.jit(fn.__wrapped__, out_shardings=outs)(*args)
  if how == "jitted":
    ov = jax_overlap.overlap(
      jax.jit(fn.__wrapped__, out_shardings=outs),
      gspmd="convert",
      params_argnums=(0, 1),
      cache=False,
    )
  else:
    ov = jax_overlap.overlap(
      fn.__wrapped__, gspmd="convert", params_argnums=(0, 1), cache=False, out_shardings=outs
    )
  notes = ov.explain(*args).notes
  assert any(n.startswith("converted to shard_map") for n in notes), notes
  got = ov(*args)
  _assert_same(got, want, rtol=1e-4, atol=1e-5)
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(got[0]))


@pytest.mark.parametrize("gspmd", ["convert", "as_written"])
@pytest.mark.parametrize("jitted", [False, True], ids=["plain", "jitted_out_shardings"])
def test_overlap_outputs_are_laid_out_as_jax_jit_lays_them_out(gspmd, jitted):
  # A plain step leaves its output layouts to the partitioner (which splits AdamW's update
  # of the replicated scale vector, and its moments, over fsdp); a jitted one asks for its
  # inputs' layouts (the scale replicated). Either form @overlap runs returns what
  # jax.jit(step) returns, laid out the same way.
  mesh = _mesh((8,), ("fsdp",))
  fn, args = _adamw_step(mesh, P("fsdp"))
  step = fn if jitted else fn.__wrapped__
  want = jax.jit(step)(*args) if not jitted else step(*args)
  ov = jax_overlap.overlap(step, gspmd=gspmd, params_argnums=(0, 1), cache=False)
  notes = ov.explain(*args).notes
  assert any(n.startswith("converted to shard_map") for n in notes) == (gspmd == "convert")
  got = ov(*args)
  _assert_same(got, want, rtol=1e-4, atol=1e-5)
  scale = got[0]["scale"].sharding
  assert scale.is_fully_replicated == jitted, scale


def test_host_arrays_and_scalars_are_laid_out_as_the_jits_in_shardings_say():
  # jax.jit(step, in_shardings=...) called with host (numpy) arrays and a Python float:
  # the layouts come from the jit, so the step is converted (a scalar argument crashed
  # the conversion), and computes what it computes as written.
  mesh = _mesh((8,), ("fsdp",))
  w_s, x_s = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P("fsdp"))

  def step(w, x, lr):
    g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    return w - lr * g

  fn = jax.jit(step, in_shardings=(w_s, x_s, None), out_shardings=w_s)
  w = np.asarray(jax.random.normal(jax.random.key(0), (64, 64))) / 8
  x = np.asarray(jax.random.normal(jax.random.key(1), (16, 64)))
  ov = jax_overlap.overlap(fn, gspmd="convert", cache=False)
  notes = ov.explain(w, x, 0.1).notes
  assert any(n.startswith("converted to shard_map") for n in notes), notes
  np.testing.assert_allclose(
    np.asarray(ov(w, x, 0.1)), np.asarray(fn(w, x, 0.1)), rtol=2e-6, atol=2e-7
  )


def test_a_primitive_without_a_rule_is_named_even_where_its_input_is_gathered_early():
  # fft has no rule: it runs on whole values. The pass that settles the layouts gathers
  # its input where that is made (the exp), so only an earlier pass sees fft gather it.
  mesh = _mesh((8,), ("fsdp",))
  x = jax.device_put(jnp.arange(64.0).reshape(16, 4) / 64, NamedSharding(mesh, P("fsdp")))
  fn = jax.jit(lambda x: jnp.abs(jnp.fft.fft(jnp.exp(x).T)).sum())
  conv, leaves = _convert(fn, (x,))
  assert conv.replicated == ["fft"]
  assert "computed whole on every device: fft" in conv.summary()
  np.testing.assert_allclose(jax.jit(conv.fn)(*leaves)[0], fn(x), rtol=1e-6)


def _gathered_shapes(fn, leaves, prim="all_gather") -> list[str]:
  text = str(jax.make_jaxpr(fn)(*leaves))
  return [
    line.split("=")[0].split(":")[-1].strip() for line in text.splitlines() if f"{prim}[" in line
  ]


def test_an_unreduced_sum_is_reduced_before_it_is_broadcast():
  """An RMSNorm of feature-split activations, differentiated: its backward sums over the
  split features and broadcasts the sum back over them. The sum is all-reduced while it is
  small (one number per row), as the partitioner does, not broadcast unreduced and then
  reduce-scattered at the features' size; the values are the jitted step's."""
  mesh = _mesh((8,), ("t",))
  s, h = 16, 64

  def loss(scale, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-6)
    return jnp.sum(jnp.sin(y * scale))

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  keys = jax.random.split(jax.random.key(5), 2)
  scale = jax.device_put(1 + jax.random.normal(keys[0], (h,)) / 4, NamedSharding(mesh, P("t")))
  x = jax.device_put(jax.random.normal(keys[1], (2, s, h)), NamedSharding(mesh, P(None, None, "t")))
  conv, leaves = _convert(fn, (scale, x))
  _assert_same(jax.jit(conv.fn)(*leaves), jax.tree.leaves(fn(scale, x)))
  assert not _gathered_shapes(conv.fn, leaves, "reduce_scatter")
  summed = _gathered_shapes(conv.fn, leaves, "psum")
  assert summed and all(not g.endswith(f",{h}]") for g in summed), summed


def test_a_weight_gradient_reuses_the_gathered_cotangent():
  """Scanned layers whose output projection is written as MaxText writes it: head-split
  activations times a head-split weight, the result constrained feature-split. In the
  backward the cotangent is gathered for the activations' gradient; the weight's gradient
  contracts that gathered cotangent with the head-split activations, so it comes out split
  as the weight is (the partitioner's choice): no gather of the activations, nor of the
  stacked gradient at the update."""
  mesh = _mesh((8,), ("t",))
  s, heads, d, h, layers = 16, 8, 4, 32, 2

  def c(t, *spec):
    return jax.lax.with_sharding_constraint(t, NamedSharding(mesh, P(*spec)))

  def loss(ws, x):
    def layer(x, w):
      wi, wo = w
      a = c(jnp.sin(jnp.einsum("bse,ehd->bshd", x, wi)), None, None, "t", None)
      return x + c(jnp.einsum("bshd,hde->bse", a, wo), None, None, "t"), None

    return jnp.sum(jnp.square(jax.lax.scan(layer, x, ws)[0]))

  @jax.jit
  def fn(ws, x):
    value, g = jax.value_and_grad(loss)(ws, x)
    return value, jax.tree.map(lambda w, g: w - 0.1 * g, ws, g)

  keys = iter(jax.random.split(jax.random.key(6), 3))
  specs = [P(None, None, "t", None), P(None, "t", None, None)]
  ws = tuple(
    jax.device_put(jax.random.normal(next(keys), shape) / 8, NamedSharding(mesh, spec))
    for shape, spec in zip([(layers, h, heads, d), (layers, heads, d, h)], specs)
  )
  x = jax.device_put(
    jax.random.normal(next(keys), (2, s, h)), NamedSharding(mesh, P(None, None, "t"))
  )
  conv, leaves = _convert(fn, (ws, x))
  _assert_same(jax.jit(conv.fn)(*leaves), jax.tree.leaves(fn(ws, x)))
  gathered = _gathered_shapes(conv.fn, leaves)
  # The layer's input forward, the cotangent and the input recomputed in the backward.
  assert len(gathered) == 3 and all(g.endswith(f"[2,{s},{h}]") for g in gathered), gathered


@pytest.mark.parametrize("alias", ["checkpoint_name", "constraint", "jit"])
def test_a_value_under_two_names_is_gathered_once(alias):
  """MaxText passes one activation to the query and the key/value projections under two
  names (checkpoint names, constraints it already meets, a jitted call's arguments): the
  split value is gathered once for the three matmuls (as the partitioner's CSE would),
  not once per name, and the collective matmul planner then sees one gather feeding them."""
  from jax.ad_checkpoint import checkpoint_name

  mesh = _mesh((4,), ("tensor",))
  row = NamedSharding(mesh, P(None, "tensor"))

  def same(x, tag):
    if alias == "checkpoint_name":
      return checkpoint_name(x, tag)
    if alias == "constraint":
      return jax.lax.with_sharding_constraint(x, row)
    return jax.jit(lambda y: y)(x)

  @jax.jit
  def step(w, x):
    q = same(x, "q_in") @ w["q"]
    kv = same(x, "kv_in")
    return jnp.sum(jnp.tanh(q) * (kv @ w["k"]) * (kv @ w["v"]))

  keys = iter(jax.random.split(jax.random.key(0), 8))
  col = NamedSharding(mesh, P(None, "tensor"))
  w = {n: jax.device_put(jax.random.normal(next(keys), (16, 8)), col) for n in "qkv"}
  x = jax.device_put(jax.random.normal(next(keys), (4, 16)), row)
  conv, leaves = _convert(step, (w, x))
  _assert_same(jax.jit(conv.fn)(*leaves), jax.tree.leaves(step(w, x)), rtol=1e-5, atol=1e-5)
  text = str(jax.make_jaxpr(conv.fn)(*leaves))
  gathered_x = [ln for ln in text.splitlines() if "all_gather[" in ln and "f32[4,16]" in ln]
  assert len(gathered_x) == 1, gathered_x
  assert conv.collectives["all-gather"] == text.count("all_gather[")


@pytest.mark.parametrize("mode", ["clip", "promise_in_bounds"])
def test_a_vocabulary_split_table_is_looked_up_where_its_rows_are(mode):
  # An embedding table split along its vocabulary, every device holding all the token ids
  # (tensor parallelism): each device looks up the rows it holds and the devices' sum is
  # reduce-scattered into the activations' layout, as the partitioner does, instead of the
  # table gathered whole. The loss and the table's gradient as before (out-of-range ids
  # clipped where the lookup clips them).
  mesh = _mesh((4,), ("tensor",))
  vocab, hidden, batch, seq = 64, 16, 2, 8
  table_s = NamedSharding(mesh, P("tensor", None))
  act = NamedSharding(mesh, P(None, None, "tensor"))
  whole = NamedSharding(mesh, P())

  @functools.partial(jax.jit, out_shardings=(whole, (table_s, whole)))
  def step(table, w, ids):
    def loss(table, w):
      x = table.at[ids].get(mode=mode)
      x = jax.lax.with_sharding_constraint(x, act)
      return jnp.sum(jnp.tanh(x @ w) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1))(table, w)

  kt, kw, ki = jax.random.split(jax.random.key(0), 3)
  table = jax.device_put(jax.random.normal(kt, (vocab, hidden)), table_s)
  w = jax.device_put(jax.random.normal(kw, (hidden, hidden)) / 4, whole)
  high = vocab + 5 if mode == "clip" else vocab
  ids = jax.device_put(jax.random.randint(ki, (batch, seq), 0, high), whole)
  conv, leaves = _convert(step, (table, w, ids), params_argnums=(0, 1))
  _assert_same(jax.jit(conv.fn)(*leaves), jax.tree.leaves(step(table, w, ids)))
  assert not conv.replicated
  lines = str(jax.make_jaxpr(conv.fn)(*leaves)).splitlines()
  # No collective gathers the table; the rows looked up are reduce-scattered along the
  # hidden dimension, as the constraint lays them out.
  table_whole = f"[{vocab},{hidden}] = all_gather["
  assert not [line for line in lines if table_whole in line], lines
  scattered = f"[{batch},{seq},{hidden // 4}] = reduce_scatter["
  assert [line for line in lines if scattered in line], lines
  assert conv.collectives.get("reduce-scatter", 0) >= 1, conv.collectives  # as explain() says


def test_output_layouts_known_without_a_compile_where_only_scalars_are_unspecified():
  # A train step that asks for its state's layouts and returns a scalar loss unspecified:
  # the scalar has one layout, so the conversion needs no compile of the step to know
  # what the partitioner would choose; an unspecified array output does need one.
  from jax_overlap._src.transform import out_layouts

  mesh = _mesh((8,), ("fsdp",))
  w_s = NamedSharding(mesh, P("fsdp"))
  w = jax.device_put(jnp.ones((64, 8)), w_s)

  def step(w):
    return w * 2, jnp.sum(w)

  asked = jax.jit(step, out_shardings=(w_s, None)).trace(w)
  assert out_layouts.known(asked) == (w_s, None)
  assert out_layouts.partitioner_choice(asked) == (w_s, None)
  assert out_layouts.known(jax.jit(step).trace(w)) is None
  scalars = jax.jit(lambda w: (jnp.sum(w), jnp.max(w))).trace(w)
  assert out_layouts.known(scalars) == (None, None)
  # Converted with the scalar left as None, the step computes what it computes as written.
  fn = jax.jit(step, out_shardings=(w_s, None))
  conv = to_shard_map.convert(asked.jaxpr, [w], out_layouts.known(asked), params_leaves=[0])
  got = jax.jit(conv.fn)(w)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(fn(w)[1]), rtol=1e-6)
  assert got[0].sharding.spec == w_s.spec
  assert got[1].sharding.is_fully_replicated


def test_a_transposed_gradient_is_converted_in_its_own_dimensions():
  """Gradient accumulation (optax.MultiSteps: the update under a cond) over scanned layers
  on a 2-D mesh, a row-split weight among column-split ones: a layer's weight gradient is
  the transpose of the sum autodiff makes, and where the loop's output asks for the
  parameter's layout it was converted in the sum's dimension order (its values split along
  the other dimension, a shape error at the first use)."""
  mesh = _mesh((4, 2), ("data", "model"))
  batch, seq, dim, heads = 8, 16, 64, 4

  def attention(x, w):
    def proj(name):
      return (x @ w[name]).reshape(batch, seq, heads, -1)

    o = jax.nn.dot_product_attention(proj("q"), proj("k"), proj("v"), is_causal=True)
    return x + o.reshape(batch, seq, dim) @ w["o"]

  def loss(params, x):
    x, _ = jax.lax.scan(lambda x, w: (jax.checkpoint(attention)(x, w), None), x, params)
    return jnp.mean(x**2)

  opt = optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=2)

  @jax.jit
  def step(params, state, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  keys = iter(jax.random.split(jax.random.key(0), 5))
  spec = {"q": P(None, "data", "model"), "k": P(None, "data", "model"),
          "v": P(None, "data", "model"), "o": P(None, "model", "data")}  # fmt: skip
  params = {
    n: jax.device_put(jax.random.normal(next(keys), (4, dim, dim)) / 8, NamedSharding(mesh, s))
    for n, s in spec.items()
  }
  state = jax.jit(opt.init)(params)
  x = jax.device_put(
    jax.random.normal(next(keys), (batch, seq, dim)), NamedSharding(mesh, P("data"))
  )
  conv, _ = _convert(step, (params, state, x))
  converted = jax.jit(conv.fn)
  mine, theirs = (params, state), (params, state)
  for _ in range(3):  # both branches: accumulate, then apply
    mine = jax.tree.unflatten(
      jax.tree.structure((params, state, 0.0)), converted(*jax.tree.leaves((*mine, x)))
    )[:2]
    *theirs, _ = step(*theirs, x)
  # (Values only: without out_shardings the converted step returns the layouts it arrives at.)
  for got, want in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
