"""Kernel costs calibrated on a GPU: the fit on committed H200 measurements, the stored
calibration the analysis picks up for its GPU and jaxlib, and what needs a GPU refusing
without one."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap import analysis, targets
from jax_overlap._src.analysis import calibration
from jax_overlap._src.transform import selection_cache

REPO = pathlib.Path(__file__).resolve().parents[1]
H200 = REPO / "benchmarks" / "results" / "model_check_nocb_nvidia_h200_2026-12-04.json"


def _rows(data: dict, program: str) -> list[dict]:
  p = data["programs"][program]
  return calibration.match(p["per_op_estimate"], p["per_op_measured_s"])["rows"]


def _estimate(rows, cal, launch=1e-6) -> tuple[float, float]:
  """(calibrated estimate, measured) of the rows matched to a kernel."""
  matched = [r for r in rows if r["measured_s"] is not None]
  est = sum(launch + (r["est_s"] - launch) * cal.factor(r["kind"]) for r in matched)
  return est, sum(r["measured_s"] for r in matched)


def test_a_calibration_fitted_on_two_h200_programs_checked_on_a_third():
  # The TP+SP step measured on an H200 (command buffers off, so every kernel, cuBLAS's
  # included, carries its instruction): fitted on hidden 8192 and 4096 unrolled, checked
  # on the scanned, rematerialized form of the large one.
  data = json.loads(H200.read_text())
  rows = _rows(data, "large") + _rows(data, "medium")
  cal = calibration.fit(
    rows, gpu="h200", device="NVIDIA H200", jaxlib=data["jaxlib"], programs=("large", "medium")
  )
  kinds = dict(cal.factors)
  assert set(kinds) == {"gemm", "fusion", "reduction"}  # copies: under 1% of the time
  assert all(0.8 < f < 1.2 for f in kinds.values()) and 0.9 < cal.overall < 1.1
  assert cal.kernels == sum(r["measured_s"] is not None for r in rows) == 134
  # On what it was fitted, the calibrated kernels sum to the measured time.
  est, measured = _estimate(rows, cal)
  assert est == pytest.approx(measured, rel=0.01)
  # On the scanned program it played no part in: within 5% (the uncalibrated model is
  # within 1% there; its fusions run 7% slower than the unrolled steps' did).
  check = _rows(data, "large+scan_remat")
  est, measured = _estimate(check, cal)
  assert abs(est / measured - 1) < 0.05
  assert "kernel times calibrated on NVIDIA H200 (jaxlib 0.11.2; 134 kernels" in cal.describe()


def test_fit_refuses_rows_without_measured_kernels():
  with pytest.raises(ValueError, match="no instruction was matched to a measured kernel"):
    calibration.fit(
      [{"kind": "gemm", "est_s": 1e-3, "measured_s": None}], gpu="h200", device="x", jaxlib="0"
    )


def _gemm_step(target: str):
  mesh = targets.compile_only_mesh(target, ("fsdp",))

  def f(a, b):
    return jnp.tanh(a @ b)

  x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  return f, (x, x)


def test_the_stored_calibration_is_used_for_its_gpu_and_jaxlib_only():
  f, args = _gemm_step("h100x8")
  plain = jax_overlap.analyze(f, *args, target="h100x8", cost_model=analysis.CostModel())
  cal = analysis.Calibration(
    gpu="h100",
    device="NVIDIA H100 80GB HBM3",
    jaxlib=jaxlib.__version__,
    factors=(("gemm", 2.0),),
    overall=1.5,
    kernels=10,
    programs=("test",),
  )
  before = selection_cache.key("program", "sig", {})
  path = analysis.save_calibration(cal)
  try:
    assert analysis.load_calibration("h100") == cal
    # A new calibration is a new key for remembered selections.
    assert selection_cache.key("program", "sig", {}) != before
    calibrated = jax_overlap.analyze(f, *args, target="h100x8")
    assert any(n.startswith("kernel times calibrated on NVIDIA H100") for n in calibrated.notes)
    launch = analysis.CostModel().kernel_overhead_s
    for k0, k1 in zip(plain.kernels, calibrated.kernels):
      factor = 2.0 if k0.kind == "gemm" else 1.5
      assert k1.time_s == pytest.approx(launch + (k0.time_s - launch) * factor, rel=1e-9)
    # Another GPU, or an explicit cost model, is not calibrated.
    f2, args2 = _gemm_step("a100x8")
    other = jax_overlap.analyze(f2, *args2, target="a100x8")
    assert not any("calibrated" in n for n in other.notes)
    explicit = jax_overlap.analyze(f, *args, target="h100x8", cost_model=analysis.CostModel())
    assert [k.time_s for k in explicit.kernels] == [k.time_s for k in plain.kernels]
    # A calibration made with another jaxlib's kernels is not this one's.
    assert analysis.load_calibration("h100", jaxlib="0.0.1") is None
    # An unreadable file is said, naming it.
    pathlib.Path(path).write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*calibrations.*delete it or calibrate"):
      jax_overlap.analyze(f, *args, target="h100x8")
  finally:
    pathlib.Path(path).unlink()


def test_calibrate_needs_a_gpu(capsys):
  from jax_overlap import cli

  with pytest.raises(RuntimeError, match="calibrate needs a GPU to run the step on"):
    analysis.calibrate(jax.jit(jnp.sin), jnp.ones(4))
  cli._define_flags()
  cli.FLAGS(["jax-overlap"])
  assert cli.main(["jax-overlap", "calibrate", "jax_overlap.examples.fsdp_mlp:build"]) == 2
  assert "calibrate runs the step on a GPU; this machine's devices are cpu" in (
    capsys.readouterr().err
  )
  assert cli.main(["jax-overlap", "calibrate"]) == 2
  assert "calibrate expects exactly one MODULE:BUILDER" in capsys.readouterr().err


def test_the_measured_step_runs_again_on_its_arguments(tmp_path):
  # calibrate runs the step many times on the same arguments; a train step donates them
  # (here its parameters, and an nnx.jit step its Modules): the executable the estimate
  # comes from donates nothing, and runs on the arrays returned with it.
  import functools

  import optax
  from flax import nnx

  @functools.partial(jax.jit, donate_argnums=0)
  def step(w, x):
    loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    return w - 0.1 * g, loss

  w, x = jnp.ones((64, 64)) * 0.1, jnp.ones((32, 64))
  _, per_op, executable, inputs = calibration.estimate_same_compile(step, (w, x), "h200x1")
  assert per_op and inputs == [w, x]
  measured = calibration.measure_step(executable, inputs, 2, str(tmp_path / "jit"))
  assert len(measured["wall_all_s"]) == 2 and not w.is_deleted()

  model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit(donate_argnames=("model", "optimizer"))
  def nnx_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  before = np.asarray(model.kernel[...])
  _, per_op, executable, inputs = calibration.estimate_same_compile(
    nnx_step, (model, optimizer, x), "h200x1"
  )
  measure = calibration.measure_step(executable, inputs, 2, str(tmp_path / "nnx"))
  assert len(measure["wall_all_s"]) == 2
  np.testing.assert_array_equal(np.asarray(model.kernel[...]), before)  # the Modules untouched
  # What it ran is the update: the new kernel among its outputs.
  new_kernel = [o for o in jax.tree.leaves(executable(*inputs)) if o.shape == (64, 64)]
  assert new_kernel and not np.array_equal(np.asarray(new_kernel[0]), before)
