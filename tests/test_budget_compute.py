"""Tests for jax_overlap.budget.compute: FLOP accounting and the compute governor."""

import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_overlap.budget import compute
from jax_overlap.budget.compute import ComputeGovernor, FlopCounter, keep_fraction_for_budget


def _matmul(a, b):
  return a @ b


class TestStepFlops:
  def test_function_counts_matmul_flops(self):
    x, y = jnp.ones((8, 16)), jnp.ones((16, 4))
    assert compute.step_flops(_matmul, x, y) == 2 * 8 * 16 * 4

  def test_compiled_and_lowered(self):
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    y = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    lowered = jax.jit(_matmul).lower(x, y)
    assert compute.step_flops(lowered) == 2 * 32 * 64 * 128
    assert compute.step_flops(lowered.compile()) == 2 * 32 * 64 * 128

  def test_counts_a_training_step(self):
    def step(w, x):
      return w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)

    w, x = jnp.ones((64, 32)), jnp.ones((16, 64))
    # forward x @ w and the weight gradient x^T @ dy: two matmuls of 2*16*64*32.
    assert compute.step_flops(step, w, x) >= 2 * (2 * 16 * 64 * 32)

  @pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins") is None, reason="needs the CUDA plugin (deviceless)"
  )
  def test_deviceless_gpu_without_cost_analysis_raises(self):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_overlap.targets import compile_only_mesh

    try:
      mesh = compile_only_mesh("h100x8", {"fsdp": 8})
    except Exception as e:  # plugin present but unusable
      pytest.skip(f"no deviceless GPU compile here: {e}")
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    compiled = jax.jit(_matmul).lower(x, x).compile()
    assert compiled.cost_analysis() is None
    with pytest.raises(RuntimeError, match="no cost analysis"):
      compute.step_flops(compiled)
    # Given the function, the count comes from the HLO and covers every device, as XLA's
    # own count does for the same program on 8 CPU devices.
    cpu = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    a = jax.device_put(jnp.ones((64, 64)), NamedSharding(cpu, P("fsdp")))
    want = compute.step_flops(_matmul, a, a)
    assert want == 2 * 64 * 64 * 64
    assert compute.step_flops(_matmul, x, x, target="h100x8") == want


class TestFlopCounter:
  def test_accumulates_steps_and_extra_flops(self):
    c = FlopCounter(flops_per_step=1e12)
    c.step()
    c.step(3)
    c.step(flops=5e11)
    assert c.steps == 4
    assert c.total == pytest.approx(4.5e12)
    assert c.pflops == pytest.approx(4.5e-3)

  @pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
  def test_bad_flops_per_step(self, bad):
    with pytest.raises(ValueError, match="FlopCounter: flops_per_step"):
      FlopCounter(flops_per_step=bad)

  def test_bad_step_arguments(self):
    c = FlopCounter(flops_per_step=1.0)
    with pytest.raises(ValueError, match="FlopCounter.step: n must be >= 0, got -1"):
      c.step(-1)
    with pytest.raises(ValueError, match="FlopCounter.step: flops must be"):
      c.step(flops=math.nan)


class TestGovernor:
  def test_linear_loss_gives_exact_slope(self):
    gov = ComputeGovernor(flop_budget=1e18, min_gain_per_pflop=0.0, window=3, log=False)
    for k in range(3):
      d = gov.update(flops=k * 1e15, loss=10.0 - 2.0 * k)
    assert d.gain_per_pflop == pytest.approx(2.0)
    assert d.reason == "continue" and not d.stop

  def test_warmup_until_window_is_full(self):
    gov = ComputeGovernor(flop_budget=1e18, min_gain_per_pflop=1e9, window=4, log=False)
    reasons = [gov.update(flops=k * 1e14, loss=1.0).reason for k in range(4)]
    assert reasons == ["warmup", "warmup", "warmup", "low_gain"]

  def test_stops_on_low_gain_of_a_saturating_curve(self):
    gov = ComputeGovernor(flop_budget=1e18, min_gain_per_pflop=0.5, window=3, log=False)
    for k in range(1, 1000):
      d = gov.update(flops=k * 1e14, loss=1.0 / k)
      if d.stop:
        break
    assert d.reason == "low_gain"
    assert d.gain_per_pflop < 0.5
    # The previous decision still had a rate above the threshold.
    assert gov.decisions[-2].gain_per_pflop >= 0.5
    assert gov.stopped

  def test_stops_when_budget_spent(self):
    gov = ComputeGovernor(flop_budget=5e14, min_gain_per_pflop=0.0, window=2, log=False)
    decisions = [gov.update(flops=k * 1e14, loss=10.0 - k) for k in range(1, 7)]
    assert [d.stop for d in decisions] == [False, False, False, False, True, True]
    assert decisions[4].reason == "budget"

  def test_nan_loss_stops_by_default(self):
    gov = ComputeGovernor(flop_budget=1e18, min_gain_per_pflop=0.0, window=2, log=False)
    gov.update(flops=1e14, loss=2.0)
    d = gov.update(flops=2e14, loss=jnp.float32(jnp.nan))
    assert d.stop and d.reason == "nan"
    assert gov.best_loss == 2.0

  def test_nan_loss_raises_when_asked(self):
    gov = ComputeGovernor(
      flop_budget=1e18, min_gain_per_pflop=0.0, window=2, on_nan="raise", log=False
    )
    with pytest.raises(FloatingPointError, match="loss is inf at evaluation 0"):
      gov.update(flops=1e14, loss=math.inf)

  def test_decisions_are_logged_with_numbers(self, caplog):
    import logging as pylogging

    gov = ComputeGovernor(flop_budget=1e18, min_gain_per_pflop=0.0, window=2)
    with caplog.at_level(pylogging.INFO):
      gov.update(flops=1e15, loss=3.0)
      gov.update(flops=2e15, loss=2.0)
    assert "gain/PFLOP=1" in gov.summary()
    assert any(
      "ComputeGovernor" in r.getMessage() and "loss=2" in r.getMessage() for r in caplog.records
    )

  def test_flops_must_not_decrease(self):
    gov = ComputeGovernor(flop_budget=1e18, min_gain_per_pflop=0.0, log=False)
    gov.update(flops=2e14, loss=1.0)
    with pytest.raises(ValueError, match="flops is cumulative and must not decrease"):
      gov.update(flops=1e14, loss=1.0)

  def test_a_loss_that_is_not_a_real_scalar_is_refused(self):
    # float("1.5") would have taken a string for a loss; a batch of losses, or None, is
    # named as what it is. One-element arrays (a jitted step's loss) are taken.
    gov = ComputeGovernor(flop_budget=1e18, min_gain_per_pflop=0.0, log=False)
    assert gov.update(flops=1e14, loss=jnp.float32(2.0)).loss == 2.0
    assert gov.update(flops=2e14, loss=np.array([1.5])).loss == 1.5
    for loss, what in [("1.5", "str '1.5'"), (jnp.ones(3), r"an array of shape \(3,\)"),
                       (None, "NoneType None"), (1 + 2j, r"complex \(1\+2j\)")]:  # fmt: skip
      with pytest.raises(
        TypeError, match=f"ComputeGovernor.update: loss must be a real scalar.*got {what}"
      ):
        gov.update(flops=3e14, loss=loss)
    with pytest.raises(TypeError, match="flops must be a real scalar.*got str '3e15'"):
      gov.update(flops="3e15", loss=1.0)
    assert len(gov.decisions) == 2

  @pytest.mark.parametrize(
    "kwargs, message",
    [
      (
        dict(flop_budget=0, min_gain_per_pflop=1.0),
        "flop_budget must be a finite number > 0, got 0",
      ),
      (dict(flop_budget=-5.0, min_gain_per_pflop=1.0), "flop_budget must be a finite number > 0"),
      (dict(flop_budget=1e15, min_gain_per_pflop=-1.0), "min_gain_per_pflop must be a number >= 0"),
      (
        dict(flop_budget=1e15, min_gain_per_pflop=1.0, window=1),
        "window must be an integer >= 2, got 1",
      ),
      (
        dict(flop_budget=1e15, min_gain_per_pflop=1.0, on_nan="skip"),
        "on_nan must be 'stop' or 'raise'",
      ),
    ],
  )
  def test_bad_configuration(self, kwargs, message):
    with pytest.raises(ValueError, match=message):
      ComputeGovernor(**kwargs)

  def test_adaptive_inference_loop(self):
    # Refinement (e.g. more samples of a stochastic estimate) stops when more
    # compute no longer improves the error enough.
    rng = np.random.default_rng(0)
    target = 0.3
    samples: list[float] = []
    gov = ComputeGovernor(flop_budget=1e12, min_gain_per_pflop=1e-1, window=4, log=False)
    flops_per_sample = 1e9
    for _ in range(10_000):
      samples.extend(rng.normal(target, 1.0, size=16))
      err = abs(float(np.mean(samples)) - target) + 1.0 / len(samples)
      if gov.update(flops=len(samples) * flops_per_sample, loss=err).stop:
        break
    assert gov.stopped
    assert gov.decisions[-1].reason in ("low_gain", "budget")
    assert len(samples) * flops_per_sample <= 1e12 + 16 * flops_per_sample


class TestKeepFraction:
  def test_fits_the_budget(self):
    kf = keep_fraction_for_budget(
      2.5e12, flops_per_example=3e6, examples=1_000_000, score_flops_per_example=1e6
    )
    assert kf == pytest.approx(0.5)
    spent = 1_000_000 * (1e6 + kf * 3e6)
    assert spent <= 2.5e12 * (1 + 1e-12)

  def test_clips(self):
    assert keep_fraction_for_budget(1e20, flops_per_example=1.0, examples=10) == 1.0
    assert (
      keep_fraction_for_budget(11.0, flops_per_example=1e3, examples=10, min_fraction=0.1) == 0.1
    )

  def test_budget_below_scoring_cost(self):
    with pytest.raises(ValueError, match="does not cover scoring"):
      keep_fraction_for_budget(1.0, flops_per_example=1.0, examples=10, score_flops_per_example=1.0)

  @pytest.mark.parametrize("budget", [0, -1.0, math.nan])
  def test_bad_budget(self, budget):
    with pytest.raises(ValueError, match="flop_budget must be a finite number > 0"):
      keep_fraction_for_budget(budget, flops_per_example=1.0, examples=10)
