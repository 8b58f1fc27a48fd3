"""Tests of the simulator core: residency, dispatch, rates, policies, anchors, bad input."""

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_overlap import sim
from jax_overlap._src import targets
from jax_overlap._src.analysis import cost_model
from jax_overlap._src.sim import engine, policies

H100 = targets.get_gpu("h100")


# --- residency ---------------------------------------------------------------------------


def test_residency_limits_each_resource():
  # 1024 threads: 2 blocks by threads.
  assert sim.residency(H100, 1024, 32, 0) == 2
  # 256 threads x 128 regs = 32768 regs/block: 2 blocks by registers.
  assert sim.residency(H100, 256, 128, 0) == 2
  # 100 KB + 1 KB reserved of 228 KB: 2 blocks by shared memory.
  assert sim.residency(H100, 128, 32, 100 * 1024) == 2
  # Tiny blocks: the 32-block limit.
  assert sim.residency(H100, 32, 16, 0) == 32


def test_register_allocation_granularity():
  # 33 regs x 32 lanes = 1056 -> rounded up to 1280 per warp; 8 warps -> 10240 per block.
  assert sim.residency(H100, 256, 33, 0) == 65536 // 10240


def test_nccl_cta_takes_almost_a_whole_sm():
  # 640 threads x 96 registers: one per SM, and no room for a 256-thread, 32-register block.
  assert sim.residency(H100, 640, 96, 0) == 1
  regs = 20 * 96 * 32
  assert regs + 8 * 32 * 32 > H100.regs_per_sm


@pytest.mark.parametrize("r", [1, 2, 3, 5])
def test_shaped_smem_gives_requested_residency(r):
  smem = sim.shaped_smem(H100, 0, r)
  assert sim.residency(H100, 128, 32, smem) == r


def test_gemm_config_hopper_one_block_per_sm():
  cfg = sim.gemm_config(H100, 8192, 8192, 4096)
  assert cfg.tile == (128, 256, 64)
  assert cfg.threads == 384
  assert sim.residency(H100, cfg.threads, cfg.regs, cfg.smem) == 1


def test_gemm_config_ampere_small_tile_two_blocks_per_sm():
  a100 = targets.get_gpu("a100")
  cfg = sim.gemm_config(a100, 1024, 1024, 4096)  # 32 large tiles < 108 SMs -> 128x128
  assert cfg.tile == (128, 128, 32)
  assert sim.residency(a100, cfg.threads, cfg.regs, cfg.smem) == 2


# --- the engine --------------------------------------------------------------------------


def _one(kernel, target="h100x8", **kw):
  return sim.simulate(sim.Workload((kernel,)), target=target, policy="concurrent", **kw)


def test_waves_of_a_single_kernel():
  # 264 blocks that fit 1 per SM take two waves of the 132-block time.
  k1 = sim.Kernel("a", grid=132, threads=256, regs=32, smem=150 * 1024, flops=132 * 1e9)
  k2 = sim.Kernel("a", grid=264, threads=256, regs=32, smem=150 * 1024, flops=264 * 1e9)
  t1 = _one(k1).timing("a").duration_s
  t2 = _one(k2).timing("a").duration_s
  assert t2 == pytest.approx(2 * t1, rel=1e-6)


def _steady_workload():
  """A long loop fusion (eight blocks to an SM, 240 waves) that runs alone, then beside an
  all-gather that becomes ready part way through it, then a GEMM after both."""
  fill = sim.Kernel(
    "fill", grid=262144, threads=256, regs=32, bytes=2e9, flops=1e9, kind="fusion", stream=0
  )
  early = sim.Kernel("early", grid=132, threads=256, flops=132e6, stream=1)
  gather = sim.Collective("gather", "all-gather", 64e6, stream=1, after=("early",))
  gemm = sim.Kernel.gemm("gemm", 4096, 4096, 4096, after=("gather",))
  return sim.Workload((early, fill, gather, gemm), name="steady")


@pytest.mark.parametrize("policy", ["concurrent", "priority", "priority+shaping"])
def test_skipped_waves_give_the_event_by_event_result(policy, monkeypatch):
  # The fast path (sim/steady.py) skips whole periods of a kernel's repeated waves; the
  # result is the one of the loop stepping through every event.
  from jax_overlap._src.sim import steady

  skips = []
  original = steady.Periods.skip

  def counted(self, *args):
    out = original(self, *args)
    if out is not None:
      skips.append(out)
    return out

  def simulate(wl):
    # Each run computes its own per-item scales and isolated times (both cached by item,
    # not by the fast path's switch), and leaves none behind for other tests.
    engine.isolated_time.cache_clear()
    engine.work_scale.cache_clear()
    try:
      return sim.simulate(wl, target="h100x8", policy=policy)
    finally:
      engine.isolated_time.cache_clear()
      engine.work_scale.cache_clear()

  monkeypatch.setattr(steady.Periods, "skip", counted)
  wl = _steady_workload()
  fast = simulate(wl)
  assert skips and sum(s[2] for s in skips) > 100_000  # most of the fill's blocks skipped
  monkeypatch.setattr(engine, "_SKIP_PERIODS", False)
  slow = simulate(wl)
  assert fast.events == slow.events
  assert fast.makespan_s == pytest.approx(slow.makespan_s, rel=1e-9)
  for a, b in zip(fast.timings, slow.timings):
    assert a.name == b.name
    for field in ("ready_s", "start_s", "end_s"):
      assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-9, abs=1e-15), (
        a.name,
        field,
      )


def test_reserved_sms_hold_no_compute_block():
  # 4 SMs kept for communication: a kernel of one block per SM takes waves of 128 SMs, and
  # the occupancy record shows the reserved SMs idle while only compute runs.
  k = sim.Kernel("a", grid=1280, threads=256, regs=32, smem=150 * 1024, flops=1280 * 1e9)
  wl = sim.Workload((k,))
  free = sim.simulate(wl, target="h100x8", policy="concurrent", baseline=False)
  kept = sim.Policy("kept", reserve_sms=4)
  r = sim.simulate(wl, target="h100x8", policy=kept, record=True, check=True)
  # ceil(1280 / 132) = 10 waves on every SM; ceil(1280 / 128) = 10 waves on 128 SMs: the
  # same time. One block more per wave than 128 SMs hold (1290 blocks) takes an 11th.
  assert r.makespan_s == pytest.approx(free.makespan_s, rel=1e-9)
  more = dataclasses.replace(k, grid=1290, flops=1290 * 1e9)
  r11 = sim.simulate(sim.Workload((more,)), target="h100x8", policy=kept, baseline=False)
  r10 = sim.simulate(sim.Workload((more,)), target="h100x8", policy="concurrent", baseline=False)
  assert r11.makespan_s == pytest.approx(r10.makespan_s * 11 / 10, rel=1e-3)
  assert r.occupancy is not None and r.occupancy[:, 128:].max() == 0.0
  assert r.occupancy[:, :128].max() > 0.0
  # The reservation's cost is counted against the kernel alone on every SM.
  assert r.isolated_s["a"] == pytest.approx(free.timing("a").duration_s, rel=1e-9)


def test_reserved_sms_let_a_collective_start_beside_a_full_gemm():
  # An H100 GEMM holds each SM with one block and leaves no room for an NCCL channel: a
  # collective ready after it has started waits for its first wave. With SMs reserved it
  # starts at once, on those SMs.
  gemm = sim.Kernel.gemm("gemm", 8192, 8192, 8192)
  gather = sim.Collective("gather", "all-gather", 64e6, stream=1, after=("first",))
  late = sim.Workload((sim.Kernel("first", grid=1, threads=32, flops=1e3), gemm, gather))
  shared = sim.simulate(late, target="h100x8", policy="priority", baseline=False)
  kept = sim.simulate(
    late, target="h100x8", policy=sim.Policy("kept", priority=True, reserve_sms=12), check=True
  )
  wave = shared.timing("gemm").duration_s / math.ceil(2048 / 132)  # 128x256 tiles
  assert shared.timing("gather").start_s > shared.timing("gemm").start_s + 0.9 * wave
  assert kept.timing("gather").start_s < kept.timing("gemm").start_s + 1e-5
  assert kept.timing("gather").end_s < shared.timing("gather").end_s
  assert kept.timing("gemm").duration_s > shared.timing("gemm").duration_s  # fewer SMs


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_bad_reservation_is_refused(bad):
  with pytest.raises(ValueError, match=r"Policy.reserve_sms must be an int >= 0"):
    sim.Policy("kept", reserve_sms=bad)


def test_reserving_every_sm_is_refused():
  wl = sim.Workload((sim.Kernel("a", grid=132, threads=256, flops=1e9),))
  with pytest.raises(ValueError, match=r"reserve_sms=132 leaves no SM for compute on h100"):
    sim.simulate(wl, target="h100x8", policy=sim.Policy("kept", reserve_sms=132))


def test_compute_bound_block_time_matches_formula():
  const = sim.constants_for("h100")
  k = sim.Kernel(
    "a", grid=132, threads=256, regs=32, smem=150 * 1024, flops=132 * 1e9, efficiency=1.0
  )
  t = _one(k).timing("a").duration_s
  per_sm = H100.peak_fp32_flops / H100.sm_count
  assert t == pytest.approx(1e9 / per_sm + const.block_overhead_s, rel=1e-9)


def test_memory_bound_kernel_runs_at_memory_bandwidth():
  nbytes = 4e9
  k = sim.Kernel("copy", grid=132 * 8 * 10, threads=256, regs=32, bytes=nbytes, kind="fusion")
  t = _one(k).timing("copy").duration_s
  # The analysis's roofline for the same bytes (less its launch overhead): one DRAM figure.
  roof = cost_model.kernel_time(0.0, nbytes, H100) - cost_model.CostModel().kernel_overhead_s
  assert t == pytest.approx(roof, rel=0.02)


def test_bandwidth_sharing_slows_concurrent_kernels():
  nbytes = 2e9
  a = sim.Kernel("a", grid=132 * 4, threads=256, regs=32, bytes=nbytes, stream=0)
  b = sim.Kernel("b", grid=132 * 4, threads=256, regs=32, bytes=nbytes, stream=1)
  r = sim.simulate(sim.Workload((a, b)), target="h100", policy="concurrent")
  # Together they move 4 GB at the device bandwidth the roofline assumes.
  roof = cost_model.kernel_time(0.0, 2 * nbytes, H100) - cost_model.CostModel().kernel_overhead_s
  assert r.makespan_s == pytest.approx(roof, rel=0.05)


def test_stream_order_and_launch_overhead():
  const = sim.constants_for("h100")
  a = sim.Kernel("a", grid=132, threads=256, flops=132e8)
  b = sim.Kernel("b", grid=132, threads=256, flops=132e8)
  r = sim.simulate(sim.Workload((a, b)), target="h100", policy="concurrent")
  assert r.timing("b").start_s == pytest.approx(r.timing("a").end_s + const.launch_overhead_s)


def test_cross_stream_event_is_respected():
  a = sim.Kernel("a", grid=10, threads=256, flops=1e10, stream=0)
  b = sim.Kernel("b", grid=10, threads=256, flops=1e8, stream=1, after=("a",))
  r = sim.simulate(sim.Workload((a, b)), target="h100", policy="concurrent")
  assert r.timing("b").start_s >= r.timing("a").end_s


def test_collective_time_alpha_beta():
  topo = targets.get("h100x8")
  const = sim.constants_for("h100")
  c = sim.Collective("ag", "all-gather", 1 << 30, group_size=8)
  r = sim.simulate(sim.Workload((c,)), target=topo, policy="concurrent")
  bw = min(topo.gpu.link_bandwidth, const.channels * const.cta_copy_bandwidth)
  expect = 7 * topo.gpu.link_latency_s + (1 << 30) * 7 / 8 / bw
  assert r.timing("ag").duration_s == pytest.approx(expect, rel=0.02)


def test_collective_limited_by_resident_ctas():
  # Only 4 channels: the per-CTA copy bandwidth binds, not the link.
  const = sim.constants_for("h100")
  c = sim.Collective("ag", "all-gather", 1 << 30, group_size=8, channels=4)
  r = sim.simulate(sim.Workload((c,)), target="h100", policy="concurrent")
  assert r.timing("ag").duration_s == pytest.approx(
    (1 << 30) * 7 / 8 / (4 * const.cta_copy_bandwidth), rel=0.02
  )


def test_all_reduce_moves_twice_the_data():
  ag = sim.simulate(sim.Workload((sim.Collective("c", "all-gather", 1 << 30),)), target="h100")
  ar = sim.simulate(sim.Workload((sim.Collective("c", "all-reduce", 1 << 30),)), target="h100")
  assert ar.makespan_s == pytest.approx(2 * ag.makespan_s, rel=0.02)


def test_record_occupancy():
  r = sim.simulate(sim.tail_effect(), target="h100", policy="concurrent", record=True)
  assert r.occupancy.shape == (len(r.occupancy_times), 132)
  assert r.occupancy.max() <= 1.0
  first = r.occupancy[r.occupancy_times >= r.timing("gemm").start_s][0]
  assert first.min() > 0.5  # every SM busy once the GEMM is placed
  assert r.occupancy[0].max() == 0.0  # nothing placed before the first launch


# --- sanity anchors (BACKGROUND section 2) -------------------------------------------------


def test_anchor_h100_tail_effect():
  """A 132-block GEMM beside a 24-CTA all-gather spills into a second wave: ~2x."""
  seq = sim.simulate(sim.tail_effect(), target="h100x8", policy="sequential")
  con = sim.simulate(sim.tail_effect(), target="h100x8", policy="concurrent")
  ratio = con.timing("gemm").duration_s / seq.timing("gemm").duration_s
  # "nearly doubles": the second wave is a whole block time; bandwidth sharing may add a bit.
  assert 1.8 <= ratio <= 2.2


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_anchor_compute_slowdown_under_concurrency(gpu):
  """A multi-wave GEMM beside a collective slows by 10-40% (arXiv 2507.03114: 18.9% avg)."""
  wl = sim.synthetic([(16384, 16384, 8192)], [("all-gather", 4 << 30)])
  r = sim.simulate(wl, target=gpu, policy="concurrent")
  assert 0.10 <= r.compute_slowdown <= 0.40


def test_anchor_sequential_slower_than_overlapped():
  """Sequential execution is slower than overlapped (arXiv 2507.03114: 10.2% avg, max 26.6%)."""
  wl = sim.transformer_step(2, d=8192, tokens=4096)
  seq = sim.simulate(wl, target="h100", policy="sequential", baseline=False).makespan_s
  con = sim.simulate(wl, target="h100", policy="concurrent", baseline=False).makespan_s
  assert 0.05 <= seq / con - 1 <= 0.30


# --- policies ----------------------------------------------------------------------------


def _many_waves(kernel: sim.Kernel) -> sim.Kernel:
  """A GEMM launched one block per tile (XLA's Triton GEMMs; library GEMMs before Hopper)."""
  return dataclasses.replace(kernel, persistent=False, cluster=1)


def test_priority_lets_collective_in_before_pending_blocks():
  # A long multi-wave GEMM is running when the collective becomes ready.
  gemm = _many_waves(sim.Kernel.gemm("gemm", 16384, 16384, 8192))
  late = sim.Collective("c1", "all-gather", 1 << 28, stream=1)
  first = sim.Collective("c0", "all-gather", 64 << 20, stream=1)
  wl = sim.Workload((sim.Kernel("warm", grid=132, threads=256, flops=1e6), first, gemm, late))
  fifo = sim.simulate(wl, target="h100", policy="concurrent")
  prio = sim.simulate(wl, target="h100", policy="priority")
  assert prio.timing("c1").start_s < 0.2 * fifo.timing("c1").start_s
  assert prio.timing("c1").end_s < fifo.timing("c1").end_s


def test_nothing_gets_past_a_persistent_library_gemm_on_hopper():
  # cuBLAS's GEMMs on Hopper are persistent (measured on an H200): a copy launched after
  # one waits for the whole GEMM at any priority; launched before it, it runs beside it.
  assert sim.gemm_config("h100", 8192, 8192, 8192).persistent
  assert not sim.gemm_config("a100", 8192, 8192, 8192).persistent
  copy = sim.Collective("copy", "copy", 256 << 20, group_size=1, channels=16)
  gemm = sim.Kernel.gemm("gemm", 8192, 8192, 8192)
  behind = sim.Workload((gemm, copy))
  for policy in ("concurrent", "priority"):
    r = sim.simulate(behind, target="h100", policy=policy, check=True)
    assert r.timing("copy").start_s > 0.9 * r.timing("gemm").end_s, policy
  # The same GEMM launched one block per tile lets a prioritised copy in after a wave.
  waves = sim.simulate(sim.Workload((_many_waves(gemm), copy)), target="h100", policy="priority")
  assert waves.timing("copy").start_s < 0.2 * waves.timing("gemm").end_s
  # Launched first, the copy runs at once and the GEMM takes its SMs as it ends: the GEMM
  # loses less than the copy's time on those SMs would cost a static split of its tiles.
  ahead = sim.simulate(sim.Workload((copy, gemm)), target="h100", policy="priority", check=True)
  assert ahead.timing("copy").start_s < 1e-5
  alone = ahead.isolated_s["gemm"]
  copy_s = ahead.timing("copy").end_s - ahead.timing("copy").start_s
  grown = ahead.timing("gemm").end_s - ahead.timing("gemm").start_s - alone
  assert 0 < grown < 0.5 * copy_s
  # Every tile ran: the kernel's blocks all completed once.
  assert ahead.timing("gemm").blocks == sim.gemm_config("h100", 8192, 8192, 8192).grid


def test_a_synchronous_collective_leaves_the_compute_stream_at_default_priority():
  # XLA runs a collective it could not overlap on the compute stream. That stream keeps its
  # default priority: an async collective on a side stream must still go before the
  # compute stream's pending GEMM blocks.
  sync = sim.Collective("sync", "all-reduce", 1 << 20, stream=0)
  gemm = _many_waves(sim.Kernel.gemm("gemm", 16384, 16384, 8192))
  late = sim.Collective("late", "all-gather", 1 << 28, stream=1, after=("sync",))
  wl = sim.Workload((sim.Kernel("warm", grid=132, threads=256, flops=1e6), sync, gemm, late))
  fifo = sim.simulate(wl, target="h100", policy="concurrent")
  prio = sim.simulate(wl, target="h100", policy="priority")
  assert fifo.timing("late").start_s > 0.8 * fifo.timing("gemm").end_s  # starved by the GEMM
  assert prio.timing("late").start_s < 0.2 * fifo.timing("late").start_s
  # Only the side stream is a communication stream.
  _, priorities, _ = policies.apply("priority", wl, "h100")
  assert priorities == {1: 1}


def test_a_waiting_prioritised_channel_holds_back_the_gemm_until_an_sm_drains():
  # Two GEMM blocks per SM and many waves. Dispatch is in order (measured on an H200): a
  # prioritised channel that does not fit holds back the GEMM's next blocks, so an SM
  # drains and the channel lands there; at equal priority it waits behind every GEMM block.
  # No cap leaves room for the channel beside these blocks (registers), so the default
  # shaping leaves the GEMM alone; a cap of 1 applied anyway (a plan with comm_block null)
  # drains an SM after one block instead of two.
  g = sim.Kernel(
    "gemm",
    grid=108 * 2 * 20,
    threads=256,
    regs=128,
    smem=80 * 1024,
    flops=108 * 2 * 20 * 2e9,
    kind="gemm",
  )
  wl = sim.Workload(
    (
      sim.Kernel("warm", grid=108, threads=256, flops=1e6),
      sim.Collective("c0", "all-gather", 64 << 20),
      g,
      sim.Collective("c1", "all-gather", 1 << 28),
    )
  )
  assert sim.no_room(wl, target="a100") == {"gemm": ("registers",)}
  assert sim.default_shaping(wl, target="a100") == {}
  runs = {p: sim.simulate(wl, target="a100", policy=p) for p in sim.POLICIES}
  t = {p: r.timing("c1").start_s for p, r in runs.items()}
  gemm = runs["concurrent"].timing("gemm")
  assert t["concurrent"] > gemm.end_s - gemm.duration_s / 20  # in the GEMM's last wave
  assert t["priority"] < 0.1 * t["concurrent"]
  assert t["shaping"] == t["concurrent"] and t["priority+shaping"] == t["priority"]
  drain = sim.Policy("drain", priority=True, shaping={"gemm": 1})
  assert sim.simulate(wl, target="a100", policy=drain).timing("c1").start_s < 0.75 * t["priority"]
  no_priority = sim.Policy("cap only", shaping={"gemm": 1})
  assert sim.simulate(wl, target="a100", policy=no_priority).timing("c1").start_s == pytest.approx(
    t["concurrent"], rel=0.05
  )


def test_sequential_serialises_everything():
  wl = sim.synthetic([(4096, 4096, 4096)] * 2, [("all-gather", 1 << 28)])
  r = sim.simulate(wl, target="h100", policy="sequential")
  ts = sorted(r.timings, key=lambda t: t.start_s)
  for a, b in zip(ts, ts[1:]):
    assert b.start_s >= a.end_s


def test_policy_objects_and_explicit_shaping():
  wl = sim.synthetic([(4096, 4096, 4096)], [("all-gather", 1 << 28)])
  pol = sim.Policy("mine", priority=True, shaping={"gemm.0": {"padding_bytes": 1024}})
  r = sim.simulate(wl, target="a100", policy=pol)
  assert r.policy == "mine"
  assert r.timing("gemm.0").smem > sim.gemm_config(targets.get_gpu("a100"), 4096, 4096, 4096).smem


# --- bad input ---------------------------------------------------------------------------


def test_error_kernel_cannot_fit():
  k = sim.Kernel("big", grid=1, threads=1024, regs=128)
  with pytest.raises(ValueError, match=r"'big': registers per block 1024 x 128 exceed h100's"):
    _one(k)
  # Fits the per-block limits but not an A40 SM next to its 1 KB reservation... on a
  # custom GPU whose SM is smaller than the block limits.
  import dataclasses

  tiny = dataclasses.replace(targets.get_gpu("h100"), name="tiny", max_threads_per_sm=512)
  with pytest.raises(ValueError, match=r"cannot fit on one tiny SM at all \(limited by threads\)"):
    _one(sim.Kernel("wide", grid=1, threads=1024), target=tiny)


def test_error_threads_over_block_limit():
  with pytest.raises(ValueError, match=r"'big': threads per block 2048 exceeds"):
    _one(sim.Kernel("big", grid=1, threads=2048))


def test_error_smem_over_optin():
  with pytest.raises(ValueError, match=r"smem per block 300000 bytes exceeds"):
    _one(sim.Kernel("big", grid=1, threads=32, smem=300000))


def test_error_zero_grid():
  with pytest.raises(ValueError, match=r"Kernel\('z'\): grid must be at least 1, got 0"):
    sim.Kernel("z", grid=0, threads=32)


@pytest.mark.parametrize("field,value", [("flops", -1.0), ("bytes", -5.0)])
def test_error_negative_sizes(field, value):
  with pytest.raises(ValueError, match=rf"{field} must be a finite number >= 0, got {value}"):
    sim.Kernel("n", grid=1, threads=32, **{field: value})


def test_error_negative_collective_bytes_and_gemm_dims():
  with pytest.raises(ValueError, match=r"Collective\('c'\): bytes must be a finite number"):
    sim.Collective("c", "all-gather", -1)
  with pytest.raises(ValueError, match=r"gemm\('g'\): k must be at least 1, got -3"):
    sim.Kernel.gemm("g", 8, 8, -3)


def test_error_wrong_types():
  with pytest.raises(TypeError, match=r"grid must be an int, got float"):
    sim.Kernel("t", grid=1.5, threads=32)
  with pytest.raises(TypeError, match=r"workload must be a sim.Workload"):
    sim.simulate([sim.Kernel("t", grid=1, threads=32)], target="h100")


def test_error_unknown_target_and_policy_and_kind():
  wl = sim.Workload((sim.Kernel("t", grid=1, threads=32),))
  with pytest.raises(ValueError, match=r"jax_overlap.sim: target: unknown target 'b300x8'"):
    sim.simulate(wl, target="b300x8")
  with pytest.raises(ValueError, match=r"unknown policy 'fast'"):
    sim.simulate(wl, target="h100", policy="fast")
  with pytest.raises(ValueError, match=r"kind must be one of"):
    sim.Collective("c", "broadcast", 10)


def test_error_plan_names_missing_kernel():
  wl = sim.Workload((sim.Kernel("t", grid=1, threads=32),))
  pol = sim.Policy("p", shaping={"nope": 1})
  with pytest.raises(ValueError, match=r"shapes kernel\(s\) \['nope'\] that are not in workload"):
    sim.simulate(wl, target="h100", policy=pol)


def test_error_bad_shaping_values():
  wl = sim.Workload((sim.Kernel("t", grid=1, threads=32),))
  with pytest.raises(ValueError, match=r"shaping\['t'\].blocks_per_sm must be an int >= 1, got 0"):
    sim.simulate(wl, target="h100", policy=sim.Policy("p", shaping={"t": 0}))
  with pytest.raises(ValueError, match=r"shaping\['t'\] has unknown key"):
    sim.simulate(wl, target="h100", policy=sim.Policy("p", shaping={"t": {"bps": 1}}))


def test_error_duplicate_and_forward_references():
  k = sim.Kernel("t", grid=1, threads=32)
  with pytest.raises(ValueError, match=r"duplicate name 't'"):
    sim.Workload((k, k))
  with pytest.raises(ValueError, match=r"'u' waits for 'later', which is not an earlier item"):
    sim.Workload(
      (
        sim.Kernel("u", grid=1, threads=32, after=("later",)),
        sim.Kernel("later", grid=1, threads=32),
      )
    )
  with pytest.raises(ValueError, match=r"items must not be empty"):
    sim.Workload(())


# --- properties (hypothesis) -------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  seed=st.integers(0, 10**6),
  target=st.sampled_from(["a40", "a100", "h100", "mi250x"]),
  policy=st.sampled_from(sim.POLICIES),
)
def test_random_workloads_terminate_and_keep_invariants(seed, target, policy):
  wl = sim.random_workload(seed, n_items=7, max_grid=300)
  r = sim.simulate(wl, target=target, policy=policy, check=True, baseline=False)
  assert math.isfinite(r.makespan_s) and r.makespan_s > 0
  by_name = {t.name: t for t in r.timings}
  # Every block runs exactly once.
  placed = {}
  for k, nb, _, _, t0, t1 in r.batches:
    placed[k] = placed.get(k, 0) + nb
    assert t1 >= t0
  for i, t in enumerate(r.timings):
    assert placed[i] == t.blocks
    assert t.start_s >= t.ready_s and t.end_s > t.start_s
  # Stream order and cross-stream events.
  items = wl.items if policy != "sequential" else None
  if items is not None:
    last = {}
    for it in items:
      if it.stream in last:
        assert by_name[it.name].start_s >= by_name[last[it.stream]].end_s
      last[it.stream] = it.name
      for a in it.after:
        assert by_name[it.name].start_s >= by_name[a].end_s
  else:
    ts = [by_name[it.name] for it in wl.items]
    for a, b in zip(ts, ts[1:]):
      assert b.start_s >= a.end_s


def test_priority_never_preempts():
  # A one-wave kernel fills every SM; a high-priority collective arrives while it runs. It
  # must wait for blocks to finish: nothing running is evicted.
  fill = sim.Kernel(
    "fill", grid=132, threads=384, regs=168, smem=200 * 1024, flops=132 * 5e9, kind="gemm"
  )
  tick = sim.Kernel("tick", grid=1, threads=32, flops=1e3, stream=1)
  comm = sim.Collective("c", "all-gather", 1 << 26, stream=1)
  wl = sim.Workload((fill, tick, comm))
  r = sim.simulate(wl, target="h100", policy="priority", check=True, baseline=False)
  c = r.timing("c")
  first_end = min(t1 for k, _, _, _, _, t1 in r.batches if k == 0)
  assert c.ready_s < first_end  # it was ready while every SM was busy ...
  assert c.start_s >= first_end  # ... and started only when blocks finished
  placed = sum(nb for k, nb, *_ in r.batches if k == 0)
  assert placed == 132  # each block ran once, none restarted


def test_loop_guard_names_the_workload(monkeypatch):
  wl = sim.synthetic([(4096, 4096, 4096)], [("all-gather", 1 << 28)])
  monkeypatch.setattr(engine, "_EPS", -1.0)  # no batch ever counts as finished by tolerance
  r = sim.simulate(wl, target="h100")  # still terminates: the earliest batch always finishes
  assert r.makespan_s > 0


def test_error_shaping_a_collective_and_bad_constants():
  wl = sim.synthetic([(1024, 1024, 1024)], [("all-gather", 1 << 20)])
  with pytest.raises(ValueError, match=r"shaping\['all-gather.0'\] names a collective"):
    sim.simulate(wl, target="h100", policy=sim.Policy("p", shaping={"all-gather.0": 1}))
  with pytest.raises(ValueError, match=r"sim.Constants: gemm_efficiency must be positive, got 0"):
    sim.Constants(gemm_efficiency=0)
  with pytest.raises(ValueError, match=r"unknown constant\(s\) \['speed'\]"):
    sim.constants_for("h100", {"speed": 1.0})
  with pytest.raises(TypeError, match=r"constants must be a sim.Constants or a dict"):
    sim.simulate(wl, target="h100", constants=3)


def test_overrides_change_the_prediction():
  wl = sim.Workload((sim.Collective("c", "all-gather", 1 << 30, channels=4),))
  slow = sim.simulate(wl, target="h100", constants={"cta_copy_bandwidth": 5e9}).makespan_s
  fast = sim.simulate(wl, target="h100", constants={"cta_copy_bandwidth": 10e9}).makespan_s
  assert slow == pytest.approx(2 * fast, rel=0.02)


def test_dram_is_shared_only_among_memory_bound_blocks():
  # A compute-bound kernel reading a few bytes keeps its pace next to a DRAM-saturating
  # copy, exactly as one reading nothing does; the copy takes what DRAM has left.
  mem = sim.Kernel("mem", grid=132 * 8 * 20, threads=256, bytes=8e9, stream=1)

  def compute(nbytes):
    return sim.Kernel("c", grid=132, threads=256, flops=132 * 4e8, bytes=nbytes, kind="fusion")

  light = sim.simulate(sim.Workload((compute(1e6), mem)), target="h100", policy="concurrent")
  none = sim.simulate(sim.Workload((compute(0.0), mem)), target="h100", policy="concurrent")
  assert light.timing("c").duration_s == pytest.approx(none.timing("c").duration_s, rel=1e-3)
  # The copy alone is DRAM-bound; beside the compute kernel it is not faster.
  alone = sim.simulate(
    sim.Workload((dataclasses.replace(mem, stream=0),)), target="h100", policy="concurrent"
  )
  assert light.timing("mem").duration_s >= alone.timing("mem").duration_s * (1 - 1e-6)


def test_communication_ctas_take_sm_throughput_from_compute_blocks():
  # MI250X: RCCL's 256-thread CTAs fit beside GEMM blocks, so only the SM share slows the
  # GEMM; the slowdown grows with comm_sm_share and is zero without it.
  wl = sim.synthetic([(16384, 16384, 8192)], [("all-gather", 4 << 30)])
  slow = [
    sim.simulate(
      wl, target="mi250x", policy="concurrent", constants={"comm_sm_share": s}
    ).compute_slowdown
    for s in (0.0, 0.1, 0.3)
  ]
  assert slow[0] == pytest.approx(0.0, abs=1e-9)
  assert 0 < slow[1] < slow[2]
  with pytest.raises(ValueError, match=r"comm_sm_share must be in \[0, 1\]"):
    sim.Constants(comm_sm_share=1.5)


# --- point-to-point collectives: NCCL's send/recv channels ------------------------------


def test_p2p_channels_follow_nccl_rule():
  from jax_overlap._src.sim import collectives

  h100, a100 = targets.get("h100x8"), targets.get("a100x8")
  ch, ca = sim.constants_for("h100"), sim.constants_for("a100")
  # 32 p2p channels and 32 per peer on an H100 node (NCCL's INFO line on DGX H100); an
  # 8-rank communicator starts each send/recv on 32 / 8 = 4 of them, and doubles only
  # while a part exceeds 16 MiB.
  assert collectives.nccl_p2p_channels(16 << 20, 8, h100, ch) == 4
  assert collectives.nccl_p2p_channels(64 << 20, 8, h100, ch) == 4
  assert collectives.nccl_p2p_channels(128 << 20, 8, h100, ch) == 8
  assert collectives.nccl_p2p_channels(1 << 30, 8, h100, ch) == 32
  # Small messages: parts of at least 64 KiB.
  assert collectives.nccl_p2p_channels(100 << 10, 8, h100, ch) == 2
  # Two ranks: 16 channels each; A100's 16 collective channels leave 2 per op for 8 ranks.
  assert collectives.nccl_p2p_channels(16 << 20, 2, h100, ch) == 16
  assert collectives.nccl_p2p_channels(16 << 20, 8, a100, ca) == 2
  # Across hosts: 2 channels per network peer whatever the size ("8 p2p channels, 2 p2p
  # channels per peer" in NCCL's INFO line for 2 hosts x 2 GPUs with 8 channels).
  two_hosts = targets.Topology("h100_2x2", targets.get_gpu("h100"), 2, 2)
  assert collectives.nccl_p2p_channels(1 << 30, 4, two_hosts, ch.replace(channels=8)) == 2


def test_permute_runs_on_few_wide_ctas_and_slows_a_gemm_less_than_an_all_gather():
  from jax_overlap._src.sim import collectives

  topo, const = targets.get("h100x8"), sim.constants_for("h100")
  cw = collectives.channel_work(sim.Collective("p", "collective-permute", 16 << 20), topo, const)
  assert (cw["channels"], cw["threads"]) == (4, 640)
  assert cw["bytes"] == (16 << 20) / 4
  a2a = collectives.channel_work(sim.Collective("a", "all-to-all", 16 << 20), topo, const)
  assert a2a["channels"] == 7 * collectives.nccl_p2p_channels((16 << 20) / 8, 8, topo, const)
  # An explicit channel count still wins; AMD keeps the collective channel count.
  assert (
    collectives.channel_work(
      sim.Collective("p", "collective-permute", 16 << 20, channels=24), topo, const
    )["channels"]
    == 24
  )
  mi = targets.get("mi250x")
  cm = sim.constants_for("mi250x")
  assert (
    collectives.channel_work(sim.Collective("p", "collective-permute", 16 << 20), mi, cm)[
      "channels"
    ]
    == cm.channels
  )
  # Beside a kernel of many small blocks (so that the SM time the CTAs take shows, not a
  # GEMM's wave quantization) the permute's 4 CTAs cost less than the all-gather's 16.
  slow = {}
  for kind in ("collective-permute", "all-gather"):
    k = sim.Kernel("f", grid=132 * 8 * 40, threads=256, flops=132 * 8 * 40 * 2e7)
    wl = sim.synthetic([k], [(kind, 256 << 20)])
    slow[kind] = sim.simulate(wl, target="h100", policy="concurrent").compute_slowdown
  assert 0 < slow["collective-permute"] < 0.95 * slow["all-gather"]


def test_kernel_dtype_spellings_simulate_alike():
  """A dtype by its short name, NumPy's name or as a NumPy/JAX dtype: the same kernel."""
  import jax.numpy as jnp
  import numpy as np

  def run(d):
    k = sim.Kernel.gemm("g", 2048, 2048, 2048, dtype=d)
    return k.dtype, sim.simulate(sim.Workload((k,), "one"), target="h100").makespan_s

  bf16 = [run(d) for d in ("bf16", "BF16", "bfloat16", jnp.bfloat16, np.dtype(jnp.bfloat16))]
  f32 = [run(d) for d in ("f32", "float32", np.float32, jnp.float32)]
  assert {name for name, _ in bf16} == {"bf16", "bfloat16"}
  assert {name for name, _ in f32} == {"f32", "float32"}
  assert len({t for _, t in bf16}) == 1 and len({t for _, t in f32}) == 1
  assert f32[0][1] > 2 * bf16[0][1]  # FP32 runs off the tensor cores
  with pytest.raises(TypeError, match="dtype must be a name"):
    sim.Kernel.gemm("g", 64, 64, 64, dtype=object())


@pytest.mark.parametrize(
  "build, kwargs, error, message",
  [
    (sim.transformer_step, {"layers": 0}, ValueError, r"transformer_step: layers must be at least 1, got 0"),
    (sim.transformer_step, {"layers": 2.5}, TypeError, r"transformer_step: layers must be an int, got float"),
    (sim.transformer_step, {"seq": 0}, ValueError, r"transformer_step: seq must be at least 1"),
    (sim.transformer_step, {"group_size": 0}, ValueError, r"transformer_step: group_size must be at least 1"),
    (sim.tp_chain, {"n": 0}, ValueError, r"tp_chain: n must be at least 1, got 0"),
    (sim.tp_chain, {"lag": -1}, ValueError, r"tp_chain: lag must be at least 0, got -1"),
    (sim.tail_effect, {"gpu_sms": 8}, ValueError, r"tail_effect: gpu_sms must be at least 12, got 8"),
    (sim.large_step, {"comm_every": 0}, ValueError, r"large_step: comm_every must be at least 1"),
    (sim.random_workload, {"seed": 0, "streams": 0}, ValueError, r"random_workload: streams must be at least 1"),
    (lambda **k: sim.attention("a", **k), {"tokens": 8, "d": 128, "seq": 0}, ValueError, r"attention: seq must be at least 1"),
  ],
)  # fmt: skip
def test_workload_builders_refuse_counts_that_build_nothing(build, kwargs, error, message):
  # A transformer of no layers was a workload of one all-gather, a zero sequence an
  # attention kernel of no work: the step simulated was not the one asked for.
  with pytest.raises(error, match=message):
    build(**kwargs)
