"""The runtime library's SM-count target on cuBLAS's GEMMs (``library_gemms`` in a plan),
against a fake cuBLAS reached as XLA reaches it (dlopen + dlsym)."""

import pytest
from fake_cuda import harness

from jax_overlap import runtime


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
  return harness.build(tmp_path_factory.mktemp("fake_cublas"))


def _run(fake, tmp_path, plan=None, env=None):
  lib = str(fake / "libcublas_fake.so")
  rules = plan.to_rules() if plan is not None else None
  return harness.run_app(
    fake, "dlopen", [f"cublas:{lib}", f"cublaslt:{lib}"], rules=rules, env=env, tmp=tmp_path
  )


def test_the_plan_sets_the_target_on_every_handle_and_descriptor(fake, tmp_path):
  plan = runtime.Plan(target="h100", library_gemms={"sm_count_target": 100})
  run = _run(fake, tmp_path, plan)
  assert run.returncode == 0, run.stderr
  assert run.results == ["cublas 0 sm_count_target=100", "cublaslt 0 sm_count_target=100"]
  c = run.counters
  assert (c["gemm_handles_seen"], c["gemm_handles_targeted"]) == (1, 1)
  assert (c["gemm_descs_seen"], c["gemm_descs_targeted"]) == (1, 1)
  assert c["gemm_target_errors"] == 0 and c["lookups_dlsym"] >= 2


def test_without_the_rule_cublas_keeps_its_own_target_and_is_counted(fake, tmp_path):
  run = _run(fake, tmp_path, runtime.Plan(target="h100", streams={"priority": "highest"}))
  assert run.results == ["cublas 0 sm_count_target=0", "cublaslt 0 sm_count_target=0"]
  assert run.counters["gemm_handles_seen"] == 1 and run.counters["gemm_handles_targeted"] == 0
  # Without the library the program reaches cuBLAS unchanged.
  lib = str(fake / "libcublas_fake.so")
  plain = harness.run_app(fake, "dlopen", [f"cublas:{lib}"], preload=False, tmp=tmp_path)
  assert plain.results == ["cublas 0 sm_count_target=0"]


def test_a_target_cublas_refuses_is_counted_and_the_handle_still_works(fake, tmp_path):
  plan = runtime.Plan(library_gemms={"sm_count_target": 66})
  run = _run(fake, tmp_path, plan, env={"FAKE_CUBLAS_REFUSE": "1"})
  assert run.results == ["cublas 0 sm_count_target=0", "cublaslt 0 sm_count_target=0"]
  assert run.counters["gemm_target_errors"] == 2 and run.counters["gemm_handles_targeted"] == 0


def test_bad_library_gemms_sections_are_named():
  with pytest.raises(ValueError, match="at most 132 \\(the SMs of h100\\), got 200"):
    runtime.Plan(target="h100", library_gemms={"sm_count_target": 200})
  with pytest.raises(ValueError, match="from 1 to 4096, got 0"):
    runtime.Plan(library_gemms={"sm_count_target": 0})
  with pytest.raises(TypeError, match="must be an integer"):
    runtime.Plan(library_gemms={"sm_count_target": "66"})
  with pytest.raises(ValueError, match="missing key 'sm_count_target'"):
    runtime.Plan(library_gemms={})
  with pytest.raises(ValueError, match="sms_count_target"):
    runtime.Plan.from_json({"version": 1, "library_gemms": {"sms_count_target": 66}})
  plan = runtime.Plan(target="h200", library_gemms=runtime.LibraryGemms(100))
  assert runtime.Plan.from_json(plan.to_json()) == plan and not plan.empty
  assert "library_gemms\tsm_count_target\t100" in plan.to_rules().splitlines()
