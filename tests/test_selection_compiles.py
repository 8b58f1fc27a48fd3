"""The compiles a selection makes for a target: without XLA's autotuning (deviceless, it
only compiles every fusion apart) nor ptxas's optimisations, which change nothing the
analysis reads."""

import pytest

import jax_overlap
from jax_overlap._src.analysis import analyze as analysis
from jax_overlap._src.transform import compiles
from jax_overlap.examples import fsdp_transformer as G


def _kernels(report):
  return [
    (k.name, k.kind, k.grid_blocks, k.threads_per_block, k.smem_bytes) for k in report.kernels
  ]


@pytest.mark.parametrize("scan", [False, True])
def test_autotuning_and_ptxas_optimisations_off_change_no_kernel_grid_or_estimate(scan):
  fn, args = G.build_small("h100x8", layers=2, scan=scan)
  base = jax_overlap.flags.as_compiler_options(target="h100x8", workload="fsdp")
  tuned = jax_overlap.analyze(fn, *args, target="h100x8", xla_options=base)
  untuned = jax_overlap.analyze(
    fn, *args, target="h100x8", xla_options={**base, **compiles.NO_AUTOTUNING}
  )
  assert untuned.xla_options["xla_gpu_autotune_level"] == 0
  assert untuned.xla_options["xla_gpu_disable_gpuasm_optimizations"] is True
  assert _kernels(untuned) == _kernels(tuned)
  assert untuned.step_time_s == tuned.step_time_s
  assert [(c.name, c.bytes, c.start_index, c.done_index) for c in untuned.collectives] == [
    (c.name, c.bytes, c.start_index, c.done_index) for c in tuned.collectives
  ]


def _compiled_options(monkeypatch):
  seen = []
  analyze = analysis.analyze

  def recording(*a, **kw):
    seen.append(dict(kw.get("xla_options") or {}))
    return analyze(*a, **kw)

  monkeypatch.setattr(analysis, "analyze", recording)
  return seen


def test_a_selection_compiles_without_autotuning_and_builds_with_it(monkeypatch):
  seen = _compiled_options(monkeypatch)
  fn, args = G.build_small("h100x8", layers=2)
  step = jax_overlap.overlap(fn, target="h100x8", cache=False)
  explained = step.explain(*args)
  assert explained.choice.how == "cost_model" and len(seen) > 1
  assert all(o.get("xla_gpu_autotune_level") == 0 for o in seen)
  assert all(o.get("xla_gpu_disable_gpuasm_optimizations") is True for o in seen)
  # The chosen variant runs with XLA's autotuning: the options are the selection's own.
  assert "xla_gpu_autotune_level" not in explained.xla_options
  assert "xla_gpu_disable_gpuasm_optimizations" not in explained.xla_options


def test_the_users_autotuning_level_is_kept(monkeypatch):
  seen = _compiled_options(monkeypatch)
  fn, args = G.build_small("h100x8", layers=2)
  step = jax_overlap.overlap(
    fn, target="h100x8", cache=False, xla_options={"xla_gpu_autotune_level": 4}
  )
  step.explain(*args)
  assert seen and all(o.get("xla_gpu_autotune_level") == 4 for o in seen)
