"""Environment settings judged by the simulator (``jax_overlap.flags.judge_environment``)."""

import dataclasses

import pytest

from jax_overlap import flags, sim
from jax_overlap._src import targets
from jax_overlap._src.flags import environment


def test_each_verdict_is_the_simulated_step_with_and_without_the_setting():
  topo = targets.get("h100x8")
  verdicts = flags.judge_environment(target="h100x8", workload="fsdp")
  assert [(v.name, v.value) for v in verdicts] == [
    ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
    *[("NCCL_MAX_CTAS", str(c)) for c in (16, 8, 4, 2)],  # below NCCL's 24 on H100
  ]
  wl, step = environment.representative(topo, "fsdp")
  xla = sim.Policy("xla", priority=True)
  base = sim.simulate(wl, target=topo, policy=xla).makespan_s
  one = sim.Policy("one", priority=True, single_queue=True)
  assert verdicts[0].baseline_s == pytest.approx(base)
  assert verdicts[0].step_s == pytest.approx(sim.simulate(wl, target=topo, policy=one).makespan_s)
  # A cap of 8 channels: each collective on 8 CTAs, slower below the link's rate.
  capped = sim.Workload(
    tuple(
      dataclasses.replace(i, channels=8) if isinstance(i, sim.Collective) else i for i in wl.items
    )
  )
  assert verdicts[2].step_s == pytest.approx(
    sim.simulate(capped, target=topo, policy=xla).makespan_s
  )
  for v in verdicts:
    assert v.step in v.why and "not a measurement" in v.why
    assert (" pays:" in v.why) is v.recommended
    assert ("does not pay" in v.why) is (v.gain <= 0)


def test_recommended_sets_a_variable_exactly_where_its_verdict_pays():
  for target in ("h100x8", "h200x8", "a100x8", "a40x8"):
    for workload in flags.WORKLOADS:
      opts = flags.recommended(target=target, workload=workload)
      paying = {
        v.name for v in flags.judge_environment(target=target, workload=workload) if v.recommended
      }
      assert {k for k in opts if flags.REGISTRY[k].kind == "env"} == paying


def _held_step() -> sim.Workload:
  """Four cuBLAS-sized GEMMs, each output reduce-scattered (released with the next GEMM)."""
  items = []
  for i in range(4):
    items.append(dataclasses.replace(sim.Kernel.gemm(f"g{i}", 8192, 8192, 8192), time_s=1.4e-3))
    items.append(
      sim.Collective(f"rs{i}", "reduce-scatter", float(1 << 30), 8, stream=1, after=(f"g{i}",))
    )
  return sim.Workload(tuple(items), "held")


def test_one_queue_pays_where_a_collective_would_wait_behind_a_persistent_gemm():
  # A collective released with the next GEMM (both wait for the kernel before): with a queue
  # per stream it waits behind cuBLAS's persistent GEMM on Hopper, in one queue it goes first.
  wl = _held_step()
  one = flags.judge_environment(wl, target="h200x8")[0]
  assert one.name == "CUDA_DEVICE_MAX_CONNECTIONS" and one.recommended and "pays:" in one.why
  # On Ampere nothing is persistent: the same step gains nothing from it.
  assert not flags.judge_environment(wl, target="a100x8")[0].recommended


def test_no_cuda_variable_on_amd_and_no_cap_at_or_above_nccls_own_choice():
  assert all(
    v.name != "CUDA_DEVICE_MAX_CONNECTIONS" for v in flags.judge_environment(target="mi250xx8")
  )
  # NCCL takes 2 channels on a PCIe box: no cap below it is judged.
  assert [v.name for v in flags.judge_environment(target="a40x8")] == [
    "CUDA_DEVICE_MAX_CONNECTIONS"
  ]


def test_bad_input_is_named():
  with pytest.raises(TypeError, match="must be an analysis Report"):
    flags.judge_environment("step")
  with pytest.raises(ValueError, match="unknown workload 'pipeline'"):
    flags.judge_environment(workload="pipeline")
  with pytest.raises(ValueError, match="unknown target"):
    flags.judge_environment(target="b300x8")


@pytest.mark.slow
def test_a_users_step_is_judged_from_its_deviceless_compile():
  import jax_overlap
  from jax_overlap.examples import tp_sp

  step, args = tp_sp.build("h100x8", hidden=1024, mlp=4096, heads=8, seq=1024)
  report = jax_overlap.analyze(step, *args, target="h100x8")
  verdicts = flags.judge_environment(report)
  assert verdicts and all(v.step == "this step (h100x8)" for v in verdicts)
  base = sim.realize(report, sim.Policy("xla", priority=True)).results["xla"].makespan_s
  assert verdicts[0].baseline_s == pytest.approx(base)


def test_overlap_tells_the_user_of_a_setting_that_pays_on_the_chosen_step():
  from jax_overlap._src.transform import explain

  held = _held_step()
  (note,) = explain.environment_notes(held)  # judged on h100x8 (the default target)
  assert note.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 pays: simulated step")
  assert "cannot be set per compile" in note
  # Nothing pays on the representative FSDP step: no note.
  wl, _ = environment.representative(targets.get("h100x8"), "fsdp")
  assert explain.environment_notes(wl) == []
  assert explain.environment_notes("nothing")[0].startswith("environment settings not judged")
