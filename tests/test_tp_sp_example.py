"""The tensor + sequence parallel example's attention in pieces of query rows."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_overlap
from jax_overlap.examples import tp_sp

CFG = dict(layers=2, hidden=64, mlp=128, heads=8, seq=64, dtype="float32")


def test_attention_in_query_pieces_computes_the_same_step():
  # Piece c holds rows c of every device's block; its reduce-scatter returns this device's
  # rows c, so the pieces put back in order are the whole attention's output.
  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(AxisType.Auto,))
  whole, args = tp_sp.build(mesh=mesh, **CFG)
  params, x = tp_sp.random_inputs(args, seed=0)
  loss, grads = whole(params, x)
  for c in (2, 4):
    split, _ = tp_sp.build(mesh=mesh, attention_pieces=c, **CFG)
    jaxpr = split.trace(params, x).jaxpr
    scatters = str(jaxpr).count("reduce_scatter")
    assert scatters == str(whole.trace(params, x).jaxpr).count("reduce_scatter") + 2 * (c - 1)
    for fn in (split, jax_overlap.overlap(split, target="h100x8", select="rewrite", cache=False)):
      loss_c, grads_c = fn(params, x)
      np.testing.assert_allclose(float(loss_c), float(loss), rtol=1e-5)
      for g, gc in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_c)):
        np.testing.assert_allclose(np.asarray(gc), np.asarray(g), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("bad", [0, 3, 2.0, True])
def test_attention_pieces_must_divide_the_rows_of_a_block(bad):
  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(AxisType.Auto,))
  with pytest.raises(ValueError, match="attention_pieces must be a positive int dividing"):
    tp_sp.build(mesh=mesh, attention_pieces=bad, **CFG)
  with pytest.raises(ValueError, match="attention_pieces is for the shard_map form"):
    tp_sp.build_gspmd(mesh=mesh, attention_pieces=2, **CFG)
