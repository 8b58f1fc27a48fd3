"""cuBLAS's SM-count target on persistent library GEMMs in the simulator
(``sim.Policy(gemm_sm_count_target=N)``, a plan's ``library_gemms``), and the tuner that
proposes it only where cuBLAS was measured to follow it."""

import dataclasses

import pytest

from jax_overlap import runtime, sim


def _copy_behind_gemm():
  # The sweep's pair on an H200: cuBLAS's 8192^3 bf16 GEMM (1.41 ms, persistent) launched
  # first, an NCCL-channel-sized copy (16 CTAs, 256 MiB, 0.378 ms alone) behind it.
  gemm = dataclasses.replace(sim.Kernel.gemm("gemm", 8192, 8192, 8192), time_s=1.41e-3)
  copy = sim.Collective(
    "proxy", "copy", float(256 << 20), group_size=1, stream=1, channels=16, threads=544,
    regs=96, smem=82240, time_s=0.378e-3,
  )  # fmt: skip
  return sim.Workload((gemm, copy), "copy behind cuBLAS")


def _run(target, check=True):
  policy = sim.Policy("p", priority=True, gemm_sm_count_target=target)
  return sim.simulate(_copy_behind_gemm(), target="h200", policy=policy, check=check)


def test_a_target_leaves_the_other_sms_to_the_copy_and_slows_the_gemm_in_proportion():
  whole, left = _run(0), _run(116)  # 16 SMs left: one per copy CTA
  copy = lambda r: r.timing("proxy").end_s - r.timing("proxy").ready_s  # noqa: E731
  assert copy(whole) > 1.2e-3  # behind the whole persistent GEMM
  assert copy(left) == pytest.approx(0.378e-3, rel=0.02)  # at once, as alone
  # The GEMM's tiles run on 116 SMs: about 132/116 of its time.
  assert left.timing("gemm").duration_s == pytest.approx(1.41e-3 * 132 / 116, rel=0.03)
  # Fewer SMs left than the copy has CTAs: it runs in two turns.
  assert copy(_run(124)) == pytest.approx(2 * 0.378e-3, rel=0.05)
  # The fast path agrees with the checked one.
  assert _run(116, check=False).makespan_s == pytest.approx(left.makespan_s, rel=1e-9)


def test_a_plan_with_library_gemms_simulates_as_the_policy():
  plan = runtime.Plan(
    target="h200", streams={"priority": "highest"}, library_gemms={"sm_count_target": 116}
  )
  res = sim.simulate(_copy_behind_gemm(), target="h200", policy=plan)
  assert res.makespan_s == pytest.approx(_run(116).makespan_s)


def test_the_tuner_proposes_no_target_until_one_is_measured_to_be_followed():
  assert sim.sm_count_targets("h200") == ()  # nothing measured
  res = sim.tune(_copy_behind_gemm(), target="h200", progress=False)
  assert res.gemm_sm_count_target == 0 and res.plan.library_gemms is None
  # Given targets to assume, it keeps the one that pays and writes it into the plan.
  res = sim.tune(_copy_behind_gemm(), target="h200", progress=False, gemm_sm_targets=(124, 116))
  assert res.gemm_sm_count_target in (124, 116)
  assert res.plan.library_gemms.sm_count_target == res.gemm_sm_count_target
  assert res.makespan_s < res.baseline_s
  with pytest.raises(ValueError, match="SM counts from 1 to 132"):
    sim.tune(_copy_behind_gemm(), target="h200", progress=False, gemm_sm_targets=(200,))
  with pytest.raises(ValueError, match="gemm_sm_count_target must be an int >= 0"):
    sim.Policy("p", gemm_sm_count_target=-1)


def test_gemm_dispatch_records_say_whether_cublas_follows_a_target(gpu_records):
  records = gpu_records

  def rec(api, target, free):
    return {"gemm": {"api": api, "sm_count_target": target}, "free_sms": free}

  data = {
    "device": {"sm_count": 132},
    "records": [rec("cublasLt", 0, 0), rec("cublasLt", 100, 0), rec("cublas", 100, 30)],
  }
  assert records.target_followed(data) == {"cublasLt": False, "cublas": True}
  # A dry run measures nothing: no verdict.
  assert (
    records.target_followed({"device": {"sm_count": 132}, "records": [rec("cublas", 66, None)]})
    == {}
  )
