"""Tests for jax_overlap.budget.data: per-example scores and selection."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.budget import data


def _auto_mesh():
  kw = {}
  if hasattr(jax.sharding, "AxisType"):
    kw["axis_types"] = (jax.sharding.AxisType.Auto,)
  return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",), **kw)


class TestScores:
  def test_classification_matches_reference_and_gradient_norm(self):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 5, size=6))
    s = data.per_example_scores(logits, labels)
    logp = np.asarray(jax.nn.log_softmax(logits))
    np.testing.assert_allclose(s["loss"], -logp[np.arange(6), np.asarray(labels)], rtol=1e-5)

    def ce(z, y):
      return -jax.nn.log_softmax(z)[y]

    grads = jax.vmap(jax.grad(ce))(logits, labels)
    np.testing.assert_allclose(s["el2n"], np.linalg.norm(grads, axis=-1), rtol=1e-5)
    assert "excess_loss" not in s

  def test_loss_is_differentiable_and_scores_are_not(self):
    logits = jnp.array([[1.0, -1.0, 0.5]])
    labels = jnp.array([2])
    g = jax.grad(lambda z: jnp.sum(data.per_example_scores(z, labels)["loss"]))(logits)
    np.testing.assert_allclose(g, jax.nn.softmax(logits) - jax.nn.one_hot(labels, 3), rtol=1e-6)
    g2 = jax.grad(lambda z: jnp.sum(data.per_example_scores(z, labels)["el2n"]))(logits)
    np.testing.assert_array_equal(g2, 0.0)

  def test_regression_el2n_is_gradient_norm(self):
    pred = jnp.array([[1.0, 2.0], [0.0, 0.0]])
    y = jnp.array([[1.0, 0.0], [3.0, 4.0]])
    s = data.per_example_scores(pred, y, kind="regression")
    np.testing.assert_allclose(s["loss"], [2.0, 12.5])
    np.testing.assert_allclose(s["el2n"], [2.0, 5.0])

  def test_sequence_with_mask(self):
    logits = jnp.zeros((2, 3, 4))
    labels = jnp.zeros((2, 3), jnp.int32)
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    s = data.per_example_scores(logits, labels, mask=mask)
    np.testing.assert_allclose(s["loss"], [math.log(4)] * 2, rtol=1e-6)

  def test_excess_loss_from_reference_loss_and_logits(self):
    logits = jnp.array([[3.0, 0.0], [0.0, 3.0]])
    labels = jnp.array([0, 0])
    ref = jnp.array([0.5, 0.25])
    s = data.per_example_scores(logits, labels, reference_loss=ref)
    np.testing.assert_allclose(s["excess_loss"], s["loss"] - ref, rtol=1e-6)
    s2 = data.per_example_scores(logits, labels, reference_logits=logits)
    np.testing.assert_allclose(s2["excess_loss"], [0.0, 0.0], atol=1e-6)
    assert data.combine(s) is s["excess_loss"]
    assert data.combine(s, "loss") is s["loss"]

  def test_errors(self):
    with pytest.raises(
      ValueError, match="kind must be 'classification' or 'regression', got 'ranking'"
    ):
      data.per_example_scores(jnp.zeros((2, 3)), jnp.zeros(2, jnp.int32), kind="ranking")
    with pytest.raises(ValueError, match="labels must have the logits' shape"):
      data.per_example_scores(jnp.zeros((2, 3)), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="reference_loss must have shape"):
      data.per_example_scores(
        jnp.zeros((2, 3)), jnp.zeros(2, jnp.int32), reference_loss=jnp.zeros(3)
      )
    with pytest.raises(KeyError, match="score 'excess_loss' is not available"):
      data.combine({"loss": jnp.zeros(2)}, "excess_loss")
    # A mask is over token positions: of their shape, and only where there are some.
    with pytest.raises(
      ValueError, match=r"mask .* shape of the per-token loss, \(4, 6\).*\(4, 5\)"
    ):
      data.per_example_scores(
        jnp.zeros((4, 6, 3)), jnp.zeros((4, 6), jnp.int32), mask=jnp.ones((4, 5))
      )
    with pytest.raises(ValueError, match="these logits have no token axis"):
      data.per_example_scores(jnp.zeros((4, 3)), jnp.zeros(4, jnp.int32), mask=jnp.ones(4))
    # Labels outside the classes would score a zero loss (one_hot of nothing).
    with pytest.raises(ValueError, match=r"labels must be in \[0, 3\).*from 0 to 12"):
      data.per_example_scores(jnp.zeros((2, 3)), jnp.array([0, 12]))
    with pytest.raises(ValueError, match="labels must be integers, got float32"):
      data.per_example_scores(jnp.zeros((2, 3)), jnp.zeros(2))
    # Under jit the values are not known: shapes are still checked, the range is not.
    jitted = jax.jit(data.per_example_scores)
    assert jitted(jnp.zeros((2, 3)), jnp.array([0, 2]))["loss"].shape == (2,)

  def test_scores_cost_little_inside_a_sharded_step(self):
    mesh = _auto_mesh()
    bs = NamedSharding(mesh, P("data"))
    w = jnp.zeros((256, 64))
    x = jax.device_put(jnp.ones((128, 256)), bs)
    y = jax.device_put(jnp.zeros((128,), jnp.int32), bs)

    def step(w, x, y, with_scores):
      def loss_fn(w):
        logits = x @ w
        s = data.per_example_scores(logits, y)
        return jnp.mean(s["loss"]), s

      (loss, s), g = jax.value_and_grad(loss_fn, has_aux=True)(w)
      return (w - g, s["el2n"]) if with_scores else (w - g, loss)

    flops = [
      jax.jit(step, static_argnums=3).lower(w, x, y, flag).compile().cost_analysis()["flops"]
      for flag in (False, True)
    ]
    assert flops[1] <= 1.05 * flops[0]
    _, el2n = jax.jit(step, static_argnums=3)(w, x, y, True)
    assert el2n.shape == (128,)
    assert el2n.sharding.is_equivalent_to(bs, 1)


class TestSelect:
  def test_top_k_matches_numpy(self):
    rng = np.random.default_rng(1)
    scores = jnp.asarray(rng.normal(size=64), jnp.float32)
    batch = {"x": jnp.arange(64.0)[:, None] * jnp.ones((1, 3)), "y": jnp.arange(64)}
    sel = jax.jit(data.select, static_argnums=2)(batch, scores, 0.25)
    expect = np.sort(np.argsort(-np.asarray(scores))[:16])
    np.testing.assert_array_equal(np.sort(np.asarray(sel.index)), expect)
    np.testing.assert_array_equal(np.sort(np.asarray(sel.batch["y"])), expect)
    assert sel.batch["x"].shape == (16, 3)
    assert int(sel.mask.sum()) == 16
    assert float(sel.threshold) == pytest.approx(np.sort(np.asarray(scores))[-16])

  def test_sharded_batch_keeps_its_sharding(self):
    mesh = _auto_mesh()
    bs = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(2)
    scores = jax.device_put(jnp.asarray(rng.normal(size=64), jnp.float32), bs)
    x = jax.device_put(jnp.asarray(rng.normal(size=(64, 4)), jnp.float32), bs)
    f = jax.jit(lambda b, s: data.select(b, s, 0.25, multiple_of=8, sharding=bs))
    sel = f({"x": x}, scores)
    assert sel.batch["x"].shape == (16, 4)
    assert sel.batch["x"].sharding.is_equivalent_to(bs, 2)
    expect = np.sort(np.argsort(-np.asarray(scores))[:16])
    np.testing.assert_array_equal(np.sort(np.asarray(sel.index)), expect)
    np.testing.assert_allclose(np.asarray(sel.batch["x"]), np.asarray(x)[np.asarray(sel.index)])

  def test_concrete_sharded_batch_outside_jit(self):
    bs = NamedSharding(_auto_mesh(), P("data"))
    x = jax.device_put(jnp.arange(64.0), bs)
    sel = data.select(x, x, 0.5)
    assert sel.batch.sharding.is_equivalent_to(bs, 1)
    np.testing.assert_array_equal(np.sort(np.asarray(sel.batch)), np.arange(32.0, 64.0))

  @pytest.mark.skipif(not hasattr(jax.sharding, "reshard"), reason="needs explicit sharding")
  def test_explicit_sharding_mesh(self):
    mesh = jax.sharding.Mesh(
      np.array(jax.devices()[:8]), ("data",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    bs = NamedSharding(mesh, P("data"))
    x = jax.device_put(jnp.arange(64.0), bs)
    sel = jax.jit(lambda b, s: data.select(b, s, 0.25, multiple_of=8))(x, -x)
    np.testing.assert_array_equal(np.sort(np.asarray(sel.batch)), np.arange(16.0))
    assert sel.batch.sharding.spec[0] == "data"

  def test_threshold_mode_keeps_shapes_and_sharding(self):
    bs = NamedSharding(_auto_mesh(), P("data"))
    x = jax.device_put(jnp.arange(64.0), bs)
    scores = jax.device_put(jnp.asarray(np.random.default_rng(3).permutation(64), jnp.float32), bs)
    sel = jax.jit(lambda b, s: data.select(b, s, 0.25, mode="threshold"))(x, scores)
    assert sel.batch.shape == (64,) and sel.index is None
    assert sel.batch.sharding.is_equivalent_to(bs, 1)
    assert int(sel.mask.sum()) == 16
    assert float(sel.threshold) == 48.0

  def test_keep_all(self):
    sel = data.select(jnp.arange(5), jnp.arange(5.0), 1.0)
    np.testing.assert_array_equal(np.sort(np.asarray(sel.batch)), np.arange(5))

  @pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, math.nan])
  def test_keep_fraction_outside_unit_interval(self, bad):
    with pytest.raises(ValueError, match=r"keep_fraction must be in \(0, 1\]"):
      data.select(jnp.arange(4), jnp.arange(4.0), bad)

  def test_traced_keep_fraction(self):
    with pytest.raises(TypeError, match="keep_fraction must be a static Python float"):
      jax.jit(data.select)(jnp.arange(4), jnp.arange(4.0), 0.5)

  def test_mismatched_batch(self):
    with pytest.raises(ValueError, match=r"every batch leaf needs leading axis 4.*\['y'\]: \(3,\)"):
      data.select({"x": jnp.arange(4), "y": jnp.arange(3)}, jnp.arange(4.0), 0.5)
    with pytest.raises(ValueError, match="multiple_of \\(3\\) must divide the batch size \\(4\\)"):
      data.select(jnp.arange(4), jnp.arange(4.0), 0.5, multiple_of=3)

  def test_selected_count(self):
    assert data.selected_count(64, 0.3, multiple_of=8) == 16
    assert data.selected_count(64, 0.01) == 1
    assert data.selected_count(64, 0.01, multiple_of=8) == 8
    assert data.selected_count(10, 1.0) == 10

  @settings(max_examples=25, deadline=None)
  @given(
    st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=40), st.floats(0.01, 1.0)
  )
  def test_kept_scores_dominate(self, values, frac):
    scores = jnp.asarray(values, jnp.float32)
    sel = data.select(jnp.arange(len(values)), scores, frac)
    kept = np.asarray(scores)[np.asarray(sel.mask)]
    dropped = np.asarray(scores)[~np.asarray(sel.mask)]
    assert len(kept) == data.selected_count(len(values), frac)
    if len(dropped):
      assert kept.min() >= dropped.max()
