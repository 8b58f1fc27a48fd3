"""Plans name kernels as XLA launches them: checked against XLA's own dump of a real step."""

import glob
import os
import re

import pytest

from jax_overlap import runtime, sim


@pytest.fixture(scope="module")
def compiled(fsdp_h100_dump):
  report, dump_dir = fsdp_h100_dump
  # The kernels XLA emitted, by the names the driver will report: PTX .entry names.
  entries = set()
  for path in glob.glob(os.path.join(dump_dir, "*.ptx")):
    with open(path) as f:
      entries |= set(re.findall(r"\.entry\s+(\w+)", f.read()))
  return report, entries


@pytest.mark.slow
def test_launch_names_are_kernels_xla_emitted(compiled):
  report, entries = compiled
  named = [k for k in report.kernels if k.launch_name]
  assert len(entries) > 10 and len(named) >= 0.8 * len(report.kernels)
  assert {k.launch_name for k in named} <= entries
  # The HLO instruction names are not what the driver reports.
  assert not any(k.name in entries for k in named if "." in k.name)
  # What has no launch name is not a kernel XLA emitted (device copies, library calls).
  assert all(
    k.kind in ("copy", "gemm", "custom", "other") for k in report.kernels if not k.launch_name
  )


def test_plan_for_every_nameable_kernel_matches_the_step(compiled):
  report, _ = compiled
  wl = sim.workload_from_report(report)
  kernels = [it for it in wl.items if isinstance(it, sim.Kernel)]
  shaping = {k.name: 1 for k in kernels if k.launch_name}
  plan = sim.plan_dict("h100x8", shaping, True, wl)
  check = runtime.check_plan(plan, report)
  assert check.ok and check.unmatched == ()
  assert set(check.matched) == {k.launch_name for k in kernels if k.launch_name}
  assert len(check.unnamed) == sum(1 for k in kernels if not k.launch_name)


def test_plan_naming_hlo_instructions_matches_nothing(compiled):
  report, _ = compiled
  hlo_names = [k.name for k in report.kernels if k.launch_name and "." in k.name][:5]
  plan = {"version": 1, "kernels": [{"match": n, "blocks_per_sm": 1} for n in hlo_names]}
  check = runtime.check_plan(plan, report)
  assert check.unmatched == tuple(hlo_names) and not check.ok
  assert "5 kernel rule(s): 0 select kernels of the step, 5 select none" in str(check)
  regex = {"version": 1, "kernels": [{"regex": "^loop_.*fusion", "blocks_per_sm": 1}]}
  assert runtime.check_plan(regex, report).unmatched == ()


def test_check_plan_needs_a_gpu_report():
  class CpuReport:
    kernels = []

  with pytest.raises(ValueError, match="the report has no kernel launch names"):
    runtime.check_plan({"version": 1, "kernels": []}, CpuReport())


def test_check_plan_counts_the_cublas_gemms_a_library_gemms_target_reaches(compiled):
  import jax
  import jax.numpy as jnp

  import jax_overlap

  # A step whose GEMMs XLA hands to cuBLAS (its Triton GEMMs off), compiled deviceless.
  def step(a, b):
    return jnp.tanh(a @ b) @ b

  x = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)
  report = jax_overlap.analyze(
    step, x, x, target="h100x8", xla_options={"xla_gpu_enable_triton_gemm": False}
  )
  gemms = [k.name for k in report.kernels if k.library]
  assert len(gemms) == 2
  plan = {"version": 1, "library_gemms": {"sm_count_target": 100}}
  check = runtime.check_plan(plan, report)
  assert check.library_gemms == tuple(gemms) and check.sm_count_target == 100
  assert "library_gemms: SM-count target 100 on the step's 2 cuBLAS GEMM(s)" in str(check)
  assert runtime.check_plan({"version": 1}, report).library_gemms == ()
  # The FSDP step's GEMMs are XLA's own (Triton): the target reaches none, and says so.
  none = runtime.check_plan(plan, compiled[0])
  assert none.library_gemms == () and "the step has none" in str(none)
