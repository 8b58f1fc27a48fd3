"""GSPMD steps on meshes with Explicit axes (sharding in types, jax.make_mesh's default):
their shard_map form computes the step's values in its types' layouts, inserts the FSDP
collectives, compiles for a GPU target and is chosen among @overlap's variants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, reshard
from jax.sharding import PartitionSpec as P
from test_to_shard_map import _assert_same, _convert

import jax_overlap
from jax_overlap._src.transform import to_shard_map
from jax_overlap.examples import explicit_llama as E


def _explicit_mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


def _fsdp_step():
  """FSDP as JAX's explicit-sharding docs write it: each layer's weights gathered by
  reshard where the scanned, rematerialized layer uses them."""

  def block(x, w):
    h = jax.nn.gelu(x @ reshard(w["w1"], P()))
    return x + h @ reshard(w["w2"], P()), None

  def loss(params, x, y):
    x, _ = jax.lax.scan(jax.checkpoint(block), x, params)
    return jnp.mean((x - y) ** 2)

  @jax.jit
  def step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

  return step


def _fsdp_args(mesh, layers=4, d=64, f=128, batch=32):
  k = jax.random.split(jax.random.key(0), 4)
  params = {
    "w1": jax.device_put(jax.random.normal(k[0], (layers, d, f)) / 8, P(None, "data", None)),
    "w2": jax.device_put(jax.random.normal(k[1], (layers, f, d)) / 11, P(None, "data", None)),
  }
  x = jax.device_put(jax.random.normal(k[2], (batch, d)), P("data", None))
  y = jax.device_put(jax.random.normal(k[3], (batch, d)), P("data", None))
  return params, x, y


def test_an_explicit_fsdp_step_gathers_weights_and_reduce_scatters_gradients():
  mesh = _explicit_mesh((8,), ("data",))
  with jax.set_mesh(mesh):
    step, args = _fsdp_step(), _fsdp_args(mesh)
    conv, leaves = _convert(step, args)
    got = jax.jit(conv.fn)(*leaves)
    want = step(*args)
  # The values and the types' layouts: the parameters split as given, the loss whole.
  _assert_same(got, want)
  assert [tuple(g.sharding.spec) for g in got][:2] == [(None, "data", None)] * 2
  # Each weight gathered in the forward and again in the rematerialized backward, each
  # gradient reduce-scattered (never all-reduced whole), the loss summed once.
  assert conv.collectives == {"all-gather": 4, "all-reduce": 1, "reduce-scatter": 2}
  assert not conv.replicated


def _small_llama(mesh):
  cfg = E.Config(
    layers=2, hidden=64, mlp=128, heads=8, kv_heads=4, seq=16, vocab=96, dtype="float32"
  )
  params, opt_state = E.init(cfg, mesh, jax.random.key(0))
  return cfg, E.make_step(cfg), params, opt_state, E.random_tokens(cfg, mesh, jax.random.key(1))


def test_the_explicit_llama_in_its_shard_map_form_trains_like_the_jit():
  """Two AdamW steps of explicit_llama (reshard gathers, out_sharding matmuls, a one-hot
  loss over a split vocabulary) through @overlap's rewritten shard_map form against the
  step as written: the same losses, parameters and layouts."""
  mesh = E.explicit_mesh(jax.make_mesh((4, 2), ("data", "model")))
  with jax.set_mesh(mesh):
    cfg, step, params, opt_state, tokens = _small_llama(mesh)
    ov = jax_overlap.overlap(step, gspmd="convert", cache=False)
    e = ov.explain(params, opt_state, tokens)
    assert e.chosen.startswith("shard_map form"), e.chosen
    assert any(n.startswith("converted to shard_map") for n in e.notes), e.notes
    mine = jax.tree.map(jnp.copy, (params, opt_state))
    theirs = (params, opt_state)
    for _ in range(2):
      *theirs, want = step(*theirs, tokens)
      *mine, got = ov(*mine, tokens)
      np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  _assert_same(mine, theirs, rtol=1e-4, atol=1e-5)


def test_an_explicit_step_with_scatters_compiles_for_the_target():
  """An embedding's gradient and an integer-label loss's are scatter-adds whose update
  function JAX traced on the Explicit mesh; in the shard_map body it carried sharding
  constraints that XLA's GPU compiler could not fold ("unhandled HLO ops for
  HloEvaluator: custom-call")."""
  import optax

  mesh = _explicit_mesh((4, 2), ("data", "model"))

  def loss(params, tokens):
    x = params["embed"].at[tokens].get(out_sharding=P("data", None, None))
    logits = jnp.einsum("bsd,dv->bsv", x, reshard(params["head"], P()))
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

  @jax.jit
  def step(params, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

  with jax.set_mesh(mesh):
    k = jax.random.split(jax.random.key(0), 3)
    params = {
      "embed": jax.device_put(jax.random.normal(k[0], (96, 32)), P("data", None)),
      "head": jax.device_put(jax.random.normal(k[1], (32, 96)), P("data", "model")),
    }
    tokens = jax.device_put(jax.random.randint(k[2], (8, 16), 0, 96), P("data", None))
    assert str(jax.make_jaxpr(step)(params, tokens)).count("scatter-add") >= 2
    conv, leaves = _convert(step, (params, tokens))
    _assert_same(jax.jit(conv.fn)(*leaves), step(params, tokens))
    report = jax_overlap.analyze(jax.jit(conv.fn), *leaves, target="h100x8")
  assert report.step_time_s > 0 and report.collectives


@pytest.mark.slow
def test_overlap_chooses_among_the_shard_map_forms_of_an_explicit_step():
  mesh = _explicit_mesh((8,), ("data",))
  with jax.set_mesh(mesh):
    step, args = _fsdp_step(), _fsdp_args(mesh, d=256, f=512, batch=64)
    ov = jax_overlap.overlap(step, target="h100x8", cache=False)
    e = ov.explain(*args)
    (ranked,) = [n for n in e.notes if n.startswith("chosen by the cost model")]
    timed = [
      part for part in ranked.split(": ", 1)[1].split("; ") if part.startswith("shard_map form")
    ]
    assert timed and not any(" inf ms" in p for p in timed), ranked
    assert not [n for n in e.notes if "could not compile" in n]
    got, want = ov(*args), step(*args)
  _assert_same(got, want)


def test_a_layout_on_another_mesh_is_still_refused():
  mesh = _explicit_mesh((8,), ("data",))
  other = _explicit_mesh((4, 2), ("data", "model"))
  w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
  v = jax.device_put(jnp.ones((8, 4)), NamedSharding(other, P("data")))
  with pytest.raises(to_shard_map.Refused, match="two meshes"):
    to_shard_map.input_layouts([w, v])
