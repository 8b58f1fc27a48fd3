"""Flax + Optax with the transform, and the messages for missing optional packages."""

import sys

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap.examples import flax_optax


@pytest.mark.xla_default_cpu_emitters  # bit for bit under XLA's own code generation
@pytest.mark.slow
def test_flax_optax_step_is_unchanged_by_the_transform():
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  params, specs = flax_optax.init(jax.random.key(0), mesh)
  step, tx = flax_optax.make_train_step(mesh, specs)
  opt_state = flax_optax.init_opt_state(tx, params, mesh)
  # The optimizer state is sharded like the parameters.
  mu = opt_state[0].mu
  for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(mu)):
    assert m.sharding.is_equivalent_to(p.sharding, p.ndim)
  rng = np.random.default_rng(0)
  a = b = (params, opt_state)
  losses = []
  for _ in range(3):
    tokens = jax.device_put(
      rng.integers(0, 128, (16, 17)).astype(np.int32), NamedSharding(mesh, P("fsdp"))
    )
    *a, la = jax.jit(step)(*a, tokens)
    *b, lb = jax_overlap.overlap(step)(*b, tokens)
    assert float(la) == float(lb)
    losses.append(float(la))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert losses[-1] < losses[0]


@pytest.mark.parametrize("module", ["optax", "flax"])
def test_missing_training_packages_name_the_extra(monkeypatch, module):
  monkeypatch.setitem(sys.modules, module, None)
  if module == "flax":
    monkeypatch.setitem(sys.modules, "flax.linen", None)
  with pytest.raises(ImportError, match=r"pip install 'jax_overlap\[train\]'"):
    flax_optax.require()


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
  from jax_overlap.examples import fsdp_mlp

  fn, args = fsdp_mlp.build("h100x8", layers=1, hidden=256, mlp=512, tokens_per_device=64)
  report = jax_overlap.analyze(fn, *args, target="h100x8")
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
  with pytest.raises(ImportError, match=r"pip install 'jax_overlap\[plot\]'"):
    report.plot(str(tmp_path / "x.png"))


@pytest.mark.xla_default_cpu_emitters
@pytest.mark.slow
def test_flax_embedding_looked_up_where_its_rows_are_held():
  """A Linen ``nn.Embed`` sharded by rows, large against the batch: the rewrite planned for
  h100x8 looks its rows up where they are held (and scatter-adds its gradient there); the
  step gives the same numbers, bit for bit."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  size = dict(hidden=128, layers=2, vocab=32768)
  params, specs = flax_optax.init(jax.random.key(0), mesh, **size)
  step, tx = flax_optax.make_train_step(mesh, specs, **size)
  opt_state = flax_optax.init_opt_state(tx, params, mesh)
  rng = np.random.default_rng(0)
  tokens = jax.device_put(
    rng.integers(0, 40, (8, 9)).astype(np.int32), NamedSharding(mesh, P("fsdp"))
  )
  ov = jax_overlap.overlap(step, target="h100x8", select="rewrite", cache=False)
  assert len(ov.explain(params, opt_state, tokens).of_kind("embedding")) == 2
  a = jax.jit(step)(params, opt_state, tokens)
  b = ov(params, opt_state, tokens)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
