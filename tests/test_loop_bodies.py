"""Collective matmuls and deferred weight gradients inside loops over layers (lax.scan)."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_overlap
from jax_overlap._src.transform import variants
from jax_overlap._src.transform.evaluate import VariantConfig
from jax_overlap._src.transform.settings import Settings
from jax_overlap._src.transform.stats import RewriteStats
from jax_overlap.examples import tp_sp

CFG = dict(layers=3, hidden=64, mlp=128, heads=8, seq=64, dtype="float32", scan_layers=True)


@pytest.mark.parametrize("remat", [False, True], ids=["saved", "remat"])
def test_scanned_tensor_parallel_layers_decompose_inside_the_loop(remat):
  # Tensor + sequence parallel blocks under lax.scan (and jax.checkpoint), as MaxText-style
  # code writes them: each iteration's sequence gathers and reduce-scatters become
  # collective matmuls inside the loop (the forward's and the backward's), and the step
  # computes what it computed.
  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(AxisType.Auto,))
  fn, args = tp_sp.build(mesh=mesh, remat=remat, **CFG)
  params, x = tp_sp.random_inputs(args, seed=1)
  loss, grads = fn(params, x)
  ov = jax_overlap.overlap(
    fn, target="h100x8", select="rewrite", collective_matmul="pieces", cache=False
  )
  e = ov.explain(params, x)
  in_loops = [a for a in e.of_kind("collective_matmul") if "lax.scan" in a.where]
  loops = {a.where for a in in_loops}
  assert len(loops) == 2, loops  # the forward scan and the transposed (backward) one
  assert len(in_loops) >= 6, [a.detail for a in in_loops]
  assert not any("keep their collectives as written" in a.detail for a in e.of_kind("left_alone"))
  loss_o, grads_o = ov(params, x)
  np.testing.assert_allclose(float(loss_o), float(loss), rtol=1e-5)
  for g, go in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_o)):
    np.testing.assert_allclose(np.asarray(go), np.asarray(g), rtol=1e-4, atol=1e-6)


def test_loop_bodies_compile_with_their_collectives_in_pieces_on_h100():
  # Deviceless for h100x8: XLA's while body holds the pieces (more, smaller all-gathers and
  # reduce-scatters than the step as written has), and the loop is still one loop.
  fn, args = tp_sp.build(
    "h100x8", layers=2, hidden=2048, mlp=8192, heads=16, seq=2048, scan_layers=True
  )
  written = jax_overlap.analyze(fn, *args, target="h100x8")
  ov = jax_overlap.overlap(
    fn, target="h100x8", select="rewrite", collective_matmul="pieces", cache=False
  )
  rewritten = jax_overlap.analyze(ov, *args, target="h100x8")
  in_loop = [c for c in rewritten.collectives if "while/body" in c.op_name]
  before = [c for c in written.collectives if "while/body" in c.op_name]
  assert len(in_loop) > len(before) > 0
  assert max(c.bytes for c in in_loop) < max(c.bytes for c in before)
  assert rewritten.hlo_text.count(" while(") == written.hlo_text.count(" while(")


def test_variants_offer_the_loop_bodies_as_written_and_forward_only():
  settings = Settings(target="h100x8")
  cfg = VariantConfig(
    prefetch=1, reduce_scatter="per_layer", annotate=True, collective_matmul="auto"
  )
  stats = RewriteStats(loops=2, loop_bodies=2, reversed_loop_bodies=1, max_scatter_out_bytes=1)
  by_name = {c.name: c.config for c in variants.candidates(settings, cfg, stats)}
  assert by_name["rewritten, one layer per collective"].loops == "all"
  assert by_name["rewritten, one layer per collective, loop bodies as written"].loops == "none"
  forward = "rewritten, one layer per collective, only forward loop bodies rewritten"
  assert by_name[forward].loops == "forward"
  assert by_name["as written, recommended flags"].loops == "none"
  # Only backward bodies planned: no forward-only variant to offer.
  stats = RewriteStats(loops=2, loop_bodies=1, reversed_loop_bodies=1, max_scatter_out_bytes=1)
  assert forward not in {c.name for c in variants.candidates(settings, cfg, stats)}


def test_scanned_gspmd_layers_are_converted_and_decomposed_inside_the_loop():
  # The same layers written for plain jax.jit over sharded arrays (sharding constraints, no
  # collectives) under lax.scan and jax.checkpoint: converted to shard_map, whose loop
  # bodies then get their collective matmuls; same values.
  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(AxisType.Auto,))
  fn, args = tp_sp.build_gspmd(mesh=mesh, remat=True, **CFG)
  params, x = tp_sp.random_inputs(args, seed=1)
  loss, grads = fn(params, x)
  ov = jax_overlap.overlap(
    fn,
    target="h100x8",
    select="rewrite",
    gspmd="convert",
    collective_matmul="pieces",
    cache=False,
  )
  e = ov.explain(params, x)
  assert {a.where for a in e.of_kind("collective_matmul") if "lax.scan" in a.where}
  loss_o, grads_o = ov(params, x)
  np.testing.assert_allclose(float(loss_o), float(loss), rtol=1e-5)
  for g, go in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_o)):
    np.testing.assert_allclose(np.asarray(go), np.asarray(g), rtol=1e-4, atol=1e-5)


def test_flax_tensor_parallel_layers_under_nn_scan_and_nn_remat():
  # jax_overlap.examples.flax_tp: Flax linen written for tensor + sequence parallelism with
  # logical axis names (LayerNorm, Q/K/V and MLP kernels split, the sequence split between
  # blocks), nn.scan over nn.remat, plain jax.jit over sharded arrays: @overlap converts it
  # to shard_map and decomposes collectives inside both loops; the step computes what it
  # computed.
  from jax_overlap.examples import flax_tp

  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(AxisType.Auto,))
  fn, args = flax_tp.build(
    mesh=mesh, layers=2, hidden=64, mlp=128, heads=8, seq=64, dtype="float32"
  )
  params, x = tp_sp.random_inputs(args, seed=2)
  value, grads = fn(params, x)
  ov = jax_overlap.overlap(
    fn, target="h100x8", select="rewrite", gspmd="convert", collective_matmul="pieces", cache=False
  )
  e = ov.explain(params, x)
  loops = {a.where for a in e.of_kind("collective_matmul") if "lax.scan" in a.where}
  assert len(loops) == 2, [a.detail for a in e.actions]
  value_o, grads_o = ov(params, x)
  np.testing.assert_allclose(float(value_o), float(value), rtol=1e-5)
  for g, go in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_o)):
    np.testing.assert_allclose(np.asarray(go), np.asarray(g), rtol=1e-4, atol=1e-5)
