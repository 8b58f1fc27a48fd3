"""Tests of realize() and the Report -> workload conversion, with stand-in Report objects."""

import dataclasses
import types

import pytest

from jax_overlap import sim
from jax_overlap._src import targets
from jax_overlap._src.analysis import schedule


def _kernel(name, kind, index, grid_blocks, threads_per_block, smem_bytes=0, regs=None, *,
            flops=0.0, bytes_accessed=0.0, time_s=1e-4, gemm_mnk=None, dtype="bf16"):  # fmt: skip
  """One kernel as the analysis reports it (the fields the tests vary, the rest defaulted)."""
  return schedule.KernelInfo(
    name=name, kind=kind, index=index, grid_blocks=grid_blocks,
    threads_per_block=threads_per_block, smem_bytes=smem_bytes, regs_per_thread=regs,
    flops=flops, bytes_accessed=bytes_accessed, time_s=time_s, gemm_mnk=gemm_mnk, dtype=dtype,
  )  # fmt: skip


def _collective(name, kind, nbytes, group_size, start_index, done_index, time_s, sync=False):
  return schedule.CollectiveInfo(
    name=name, kind=kind, bytes=nbytes, group_size=group_size, start_index=start_index,
    done_index=done_index, time_s=time_s, synchronous=sync,
  )  # fmt: skip


def _stand_in_report(kernels, collectives):
  """What ``workload_from_report`` documents it reads: ``target``, ``kernels`` and
  ``collectives`` (no ``step_time_s``: the analysis estimate is the critical path)."""
  return types.SimpleNamespace(target="h100x8", kernels=kernels, collectives=collectives)


def _report(sync=False):
  ks = []
  for i in range(4):
    # Deviceless default launch configuration of a Triton GEMM: not what runs on hardware.
    ks.append(
      _kernel(
        f"gemm_fusion_dot.{i}",
        "gemm",
        len(ks),
        32768,
        64,
        768,
        32,
        flops=2.0 * 8192**3,
        time_s=2.0 * 8192**3 / 700e12,
        gemm_mnk=(8192, 8192, 8192),
      )
    )
    ks.append(
      _kernel(
        f"loop_fusion.{i}",
        "fusion",
        len(ks),
        4096,
        256,
        0,
        None,
        flops=8192 * 8192.0,
        bytes_accessed=3 * 8192 * 8192 * 2.0,
        time_s=3 * 8192 * 8192 * 2.0 / 3.35e12,
      )
    )
  cs = [
    _collective("all-gather-start.1", "all-gather", 256 << 20, 8, 1, 4, 6e-4, sync),
    _collective("reduce-scatter-start.2", "reduce-scatter", 256 << 20, 8, 5, 8, 6e-4, sync),
  ]
  return _stand_in_report(ks, cs)


def test_conversion_rebuilds_gemms_and_wires_events():
  wl = sim.workload_from_report(_report())
  names = [it.name for it in wl.items]
  # Issued just before kernels[1], after kernels[0]; kernels[4] waits for it.
  assert names.index("all-gather-start.1") == names.index("gemm_fusion_dot.0") + 1
  ag = wl.items[names.index("all-gather-start.1")]
  assert ag.stream == 1 and ag.after == ("gemm_fusion_dot.0",)
  assert "all-gather-start.1" in wl.items[names.index("gemm_fusion_dot.2")].after
  g = wl.items[names.index("gemm_fusion_dot.0")]
  assert g.grid is None and g.gemm_mnk == (8192, 8192, 8192)  # rebuilt by shape
  r = sim.simulate(wl, target="h100x8", policy="concurrent", baseline=False)
  assert r.timing("gemm_fusion_dot.0").blocks == 64 * 32  # 128x256 tiles, not 32768
  assert r.timing("gemm_fusion_dot.2").start_s >= r.timing("all-gather-start.1").end_s


def test_synchronous_collectives_run_in_place():
  wl = sim.workload_from_report(_report(sync=True))
  assert all(c.stream == 0 for c in wl.collectives)
  r = sim.simulate(wl, target="h100x8", policy="concurrent", baseline=False)
  ts = sorted(r.timings, key=lambda t: t.start_s)
  for a, b in zip(ts, ts[1:]):
    assert b.start_s >= a.end_s


def test_realize_all_policies_and_gap():
  rep = _report()
  res = sim.realize(rep)
  assert set(res.results) == set(sim.POLICIES)
  a = res.analysis_s
  # Analysis: 8 kernels back to back; the collectives hide behind them.
  assert a == pytest.approx(sum(k.time_s for k in rep.kernels), rel=1e-9)
  # Sequential puts the collectives on the critical path: slower than the analysis.
  assert res.gap("sequential") > 0.05
  assert res.results["concurrent"].makespan_s < res.results["sequential"].makespan_s
  assert "analysis (contention-free)" in res.table()
  # No policy beats the unlimited-resource critical path of the simulator's own times.
  for p in sim.POLICIES:
    assert res.contention(p) >= -1e-9
  assert res.contention("sequential") > res.contention("concurrent")
  assert res.best in sim.POLICIES


def test_realize_single_policy_and_step_time_attribute():
  rep = _report()
  rep.step_time_s = 1.0
  res = sim.realize(rep, "priority")
  assert list(res.results) == ["priority"] and res.analysis_s == 1.0


def test_unknown_launch_configuration_is_sized_by_bytes():
  rep = _report()
  rep.kernels.append(_kernel("memcpy", "copy", 8, 0, 0, bytes_accessed=1e6))
  rep.kernels.append(_kernel("tiny", "copy", 9, 0, 0, bytes_accessed=10))
  wl = sim.workload_from_report(rep)
  big, tiny = wl.items[-2], wl.items[-1]
  # 128-thread blocks moving 64 bytes per thread, as XLA's loop fusions do.
  assert (big.name, big.grid, big.threads) == ("memcpy", 123, 128)
  assert (tiny.name, tiny.grid, tiny.threads) == ("tiny", 1, 128)


def test_duplicate_kernel_names_are_disambiguated():
  rep = _report()
  rep.kernels[1].name = rep.kernels[3].name
  wl = sim.workload_from_report(rep)
  assert len({it.name for it in wl.items}) == len(wl.items)


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("done_index", 0, r"done_index 0 is before start_index 1"),
    ("kind", "broadcast", r"\.kind must be one of"),
    ("bytes", -1, r"\.bytes must be >= 0, got -1"),
    ("start_index", 99, r"start_index 99 and done_index 4 must be in \[0, 8\]"),
  ],
)
def test_bad_collectives(field, value, match):
  rep = _report()
  setattr(rep.collectives[0], field, value)
  with pytest.raises(ValueError, match=match):
    sim.workload_from_report(rep)


def test_bad_kernel_fields():
  rep = _report()
  rep.kernels[1].grid_blocks = -4
  with pytest.raises(ValueError, match=r"report kernel 'loop_fusion.0': grid_blocks must be >= 0"):
    sim.workload_from_report(rep)
  with pytest.raises(TypeError, match=r"report has no attribute 'kernels'"):
    sim.workload_from_report(object())
  rep = _report()
  rep.kernels[1].smem_bytes = 300 * 1024
  with pytest.raises(ValueError, match=r"'loop_fusion.0': smem per block 307200 bytes exceeds"):
    sim.realize(rep, "concurrent")


def test_kinds_and_unknown_launch_fields():
  rep = _report()
  rep.kernels.append(_kernel("triton_dot_fusion", "fusion", 8, 99, 64, gemm_mnk=(4096, 4096, 4096)))
  rep.kernels.append(_kernel("conv", "convolution", 9, 500, 0, flops=1e9))
  wl = sim.workload_from_report(rep)
  dot, conv = wl.item("triton_dot_fusion"), wl.item("conv")
  assert dot.kind == "gemm" and dot.grid is None
  assert conv.kind == "custom" and conv.threads == 256
  res = sim.realize(rep, "concurrent")
  assert res.results["concurrent"].target == "h100x8"


def test_realize_a_real_deviceless_report():
  import jax_overlap
  from jax_overlap.examples import fsdp_mlp

  fn, args = fsdp_mlp.build("h100x8", layers=2, hidden=1024, mlp=4096, tokens_per_device=1024)
  report = jax_overlap.analyze(fn, *args, target="h100x8")
  wl = sim.workload_from_report(report)
  names = {it.name for it in wl.items}
  assert len(names) == len(report.kernels) + len(report.collectives)
  res = sim.realize(report, ["concurrent", "priority+shaping"])
  assert res.analysis_s == pytest.approx(report.step_time_s)
  for policy in ("concurrent", "priority+shaping"):
    # Contention can only add time to the uncontended critical path.
    assert res.results[policy].makespan_s >= res.ideal_s * (1 - 1e-9)
  tuned = sim.tune(wl, target="h100x8", progress=False, max_evals=32)
  # The tuned plan, simulated on its own, takes the time the tuner reports.
  assert sim.simulate(
    wl, target="h100x8", policy=tuned.policy, baseline=False
  ).makespan_s == pytest.approx(tuned.makespan_s)
  assert tuned.plan.version == 1 and tuned.plan.target == "h100"


def test_each_item_alone_takes_the_analysis_time():
  # One kernel-time model: every converted kernel, alone on the device, takes its analysis
  # time less the launch gap the simulator adds; every collective its alpha-beta time.
  rep = _report()
  for k in rep.kernels:
    k.time_s *= 2  # the stand-in's fusions run at the full DRAM peak, which no kernel reaches
  wl = sim.workload_from_report(rep)
  launch = sim.constants_for("h100").launch_overhead_s
  want = {k.name: k.time_s - launch for k in rep.kernels}
  want.update({c.name: c.time_s for c in rep.collectives})
  for it in wl.items:
    alone = dataclasses.replace(it, stream=0, after=())
    got = sim.simulate(sim.Workload((alone,)), target="h100x8", policy="concurrent", baseline=False)
    assert got.timings[0].duration_s == pytest.approx(want[it.name], rel=2e-3), it.name
  # A perturbed analysis time moves the simulated one with it.
  rep.kernels[1].time_s *= 3
  slow = sim.workload_from_report(rep).item("loop_fusion.0")
  got = sim.simulate(
    sim.Workload((dataclasses.replace(slow, after=()),)), target="h100x8", policy="concurrent"
  )
  assert got.timings[0].duration_s == pytest.approx(rep.kernels[1].time_s - launch, rel=2e-3)


def test_time_s_is_checked():
  with pytest.raises(ValueError, match=r"sim.Kernel\('k'\): time_s must be a finite number"):
    sim.Kernel("k", grid=1, threads=32, time_s=-1.0)
  with pytest.raises(TypeError, match=r"sim.Collective\('c'\): time_s must be a number"):
    sim.Collective("c", "all-gather", 1e6, time_s="1ms")


@pytest.mark.slow
@pytest.mark.parametrize("which", ["demo", "scan"])
def test_simulator_without_contention_matches_the_analysis(which):
  # The demo's GPT step and a scanned, rematerialized FSDP step, compiled deviceless.
  import jax_overlap
  from jax_overlap.examples import gpt, shard_map_fsdp

  if which == "demo":
    fn, args = gpt.build(
      "h100x8",
      layers=2,
      hidden=2048,
      heads=16,
      mlp=8192,
      seq=1025,
      batch=16,
      vocab=32000,
      dtype="bfloat16",
    )
  else:
    fn, args = shard_map_fsdp.build(
      "h100x8",
      form="scan",
      layers=2,
      hidden=2048,
      mlp=5504,
      heads=16,
      seq=2048,
      batch_per_device=1,
    )
  report = jax_overlap.analyze(fn, *args, target="h100x8")
  res = sim.realize(report, "priority")
  assert abs(res.ideal_s / report.step_time_s - 1) < 0.05, (res.ideal_s, report.step_time_s)
  # Contention only adds to it, and the simulated step stays in the analysis's range.
  assert res.results["priority"].makespan_s >= res.ideal_s * (1 - 1e-9)
  # The simulator's uncontended step follows the analysis's times: doubling each of them
  # doubles ideal_s.
  for k in report.kernels:
    k.time_s *= 2
  for c in report.collectives:
    c.time_s *= 2
  twice = sim.realize(report, "priority").ideal_s
  assert twice == pytest.approx(2 * res.ideal_s, rel=0.02)


def test_channel_count_sets_a_collectives_speed_and_its_sms():
  # 256 MiB all-gathers on h100x8: NCCL's default channels saturate NVLink; 4 channels
  # (NCCL_MAX_NCHANNELS=4) move min(link, 4 x cta_copy_bandwidth).
  rep = _report()
  topo = targets.get("h100x8")
  const = sim.constants_for("h100")
  link, _ = topo.link_for(8, False)
  default = {c.name: c for c in sim.workload_from_report(rep).items if c.kind == "all-gather"}
  few = {
    c.name: c for c in sim.workload_from_report(rep, channels=4).items if c.kind == "all-gather"
  }
  many = {
    c.name: c for c in sim.workload_from_report(rep, channels=32).items if c.kind == "all-gather"
  }
  ag = "all-gather-start.1"
  assert default[ag].channels is None and default[ag].time_s == pytest.approx(6e-4)
  assert const.cta_copy_bandwidth * const.channels >= link  # the default saturates the link
  moved = (256 << 20) * 7 / 8
  lat = 7 * topo.link_for(8, False)[1]
  slow = (lat + moved / (4 * const.cta_copy_bandwidth)) / (lat + moved / link)
  assert few[ag].channels == 4 and few[ag].time_s == pytest.approx(6e-4 * slow, rel=1e-9)
  assert slow > 4
  assert many[ag].time_s == pytest.approx(6e-4)  # more channels: no faster than the link
  # Simulated alone: the 4-channel gather takes its rescaled time on 4 CTAs.
  alone = sim.simulate(
    sim.Workload((dataclasses.replace(few[ag], after=()),)),
    target="h100x8",
    policy="concurrent",
    baseline=False,
  )
  t = alone.timing(ag)
  assert t.blocks == 4 and t.end_s - t.start_s == pytest.approx(few[ag].time_s, rel=0.02)
  # In the step: fewer channels leave the GEMMs more SMs but the gathers take longer.
  steps = {
    c: sim.realize(rep, "concurrent", channels=c).results["concurrent"].makespan_s
    for c in (4, None)
  }
  assert steps[4] > steps[None]


def test_losses_say_which_resource_the_step_waits_for():
  # The gathers are issued beside 8192^3 GEMMs whose 2048 tiles fill every SM many times
  # over: their CTAs wait for SMs, and the GEMMs lose what the gathers take.
  res = sim.realize(_report(), ["concurrent", "priority"])
  names = ("all-gather-start.1", "reduce-scatter-start.2")
  for p in ("concurrent", "priority"):
    loss = res.losses(p)
    assert loss.collectives == 2
    assert loss.collective_alone_s == pytest.approx(sum(res.alone_s[n] for n in names))
    assert loss.collective_wait_s > 0 and loss.compute_slowdown_s > 0
    # Every collective took its time alone plus its stretch.
    took = sum(res.results[p].timing(n).duration_s for n in names)
    assert took >= loss.collective_alone_s + loss.collective_stretch_s - 1e-12
  assert "waited" in res.table() and "for SMs" in str(res.losses("priority"))
  # Issued alone (synchronous, in place on the compute stream), nothing is lost.
  alone = sim.realize(_report(sync=True), "priority").losses("priority")
  assert alone.compute_slowdown_s == pytest.approx(0.0, abs=1e-9)
  assert alone.collective_wait_s == pytest.approx(0.0, abs=1e-9)
  assert alone.collective_stretch_s == pytest.approx(0.0, abs=1e-7)
  for api in ("losses", "contention", "gap"):
    with pytest.raises(
      KeyError, match=rf"{api}: policy 'sequential' was not simulated; simulated: concurrent"
    ):
      getattr(res, api)("sequential")
