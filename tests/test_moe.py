"""The mixture-of-experts example under plain jax.jit: @overlap's shard_map form trains as
the jit does, and moves the tokens to their experts by all-to-all where that pays."""

import jax
import numpy as np
import pytest
from jax.extend import core as jax_core
from jax.sharding import Mesh

import jax_overlap
from jax_overlap._src.transform import to_shard_map
from jax_overlap.examples import moe


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "expert"))


def _copy(tree):
  return jax.tree.map(lambda a: jax.device_put(a.copy(), a.sharding), tree)


@pytest.mark.parametrize("scan, top_k", [(True, 1), (False, 2)])
def test_the_converted_step_trains_as_the_jit_does(mesh, scan, top_k):
  # Top-1 (Switch) under lax.scan + jax.checkpoint, top-2 (GShard, Mixtral: lax.top_k
  # over the experts) unrolled.
  cfg = moe.Config(
    layers=2, hidden=64, mlp=128, heads=4, experts=4, seq=32, vocab=256, dtype="float32",
    scan=scan, top_k=top_k,
  )  # fmt: skip
  params, opt_state = moe.init(cfg, mesh, jax.random.key(0))
  tokens = moe.random_tokens(cfg, mesh, jax.random.key(1))
  want = (_copy(params), _copy(opt_state))
  got = (_copy(params), _copy(opt_state))
  step = moe.make_step(cfg, mesh)
  ov = jax_overlap.overlap(moe.make_step(cfg, mesh), target="h100x8", gspmd="convert")
  explained = ov.explain(*got, tokens)
  assert explained.chosen.startswith("shard_map form")
  assert not [n for n in explained.notes if "computed whole on every device" in n]
  for _ in range(2):
    *want, want_loss = step(*want, tokens)
    *got, got_loss = ov(*got, tokens)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(want[0]), jax.tree.leaves(got[0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_tokens_go_to_their_experts_by_all_to_all(mesh):
  # A piece of 5 MiB a device to move over the 4 devices of `expert`: an all-to-all
  # (estimated on h100x8 at under half the gather's time), there and back in the forward
  # loop, in its recomputation and in the backward; the experts' weights stay split by
  # expert (gathered over `data` only); one step's outputs equal the jit's.
  cfg = moe.Config(
    layers=1, hidden=1024, mlp=192, heads=4, experts=4, seq=1024, vocab=128, dtype="float32"
  )
  step, args = moe.build("h100x8", mesh=mesh, **vars(cfg))
  closed = jax.make_jaxpr(step)(*args)
  leaves = jax.tree.leaves(args)
  conv = to_shard_map.convert(closed, leaves, params_leaves=range(len(jax.tree.leaves(args[0]))))
  assert conv.collectives["all-to-all"] == 6, conv.collectives

  def collectives(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name in ("all_gather", "all_to_all"):
        yield e
      for sub in jax_core.jaxprs_in_params(e.params):
        yield from collectives(sub)

  found = list(collectives(jax.make_jaxpr(conv.fn)(*leaves).jaxpr))
  a2a = [e for e in found if e.primitive.name == "all_to_all"]
  assert len(a2a) == 6 and all(e.params["axis_name"] == ("expert",) for e in a2a)
  # Each device's piece of wi [experts, hidden, mlp] and wo_e [experts, mlp, hidden].
  experts_pieces = {(1, 512, 192), (1, 192, 512)}
  gathered = [tuple(e.invars[0].aval.shape[-3:]) for e in found if e.primitive.name == "all_gather"]
  assert {s for s in gathered if s in experts_pieces} == experts_pieces
  for e in found:
    if e.primitive.name == "all_gather" and tuple(e.invars[0].aval.shape[-3:]) in experts_pieces:
      assert e.params["axis_name"] == ("data",), e
  params, opt_state = moe.init(cfg, mesh, jax.random.key(0))
  tokens = moe.random_tokens(cfg, mesh, jax.random.key(1))
  got = jax.jit(conv.fn)(*jax.tree.leaves((_copy(params), _copy(opt_state), tokens)))
  want = jax.tree.leaves(step(_copy(params), _copy(opt_state), tokens))
  for a, b in zip(want, got):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-5)
