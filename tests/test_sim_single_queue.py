"""One hardware queue (``sim.Policy(single_queue=True)``, CUDA_DEVICE_MAX_CONNECTIONS=1):
launch order, head-of-line waits, priority deciding nothing, and the H200's figures."""

import dataclasses

import pytest

from jax_overlap import sim
from jax_overlap._src import targets

PRIORITY = sim.Policy("priority", priority=True)
ONE_QUEUE = sim.Policy("one queue", priority=True, single_queue=True)


def _copy(name="copy", **kw):
  # An NCCL channel's footprint: 24 CTAs x 544 threads, 96 registers, 82,240 B (BACKGROUND's
  # H200 copy, 96 MiB).
  return sim.Collective(
    name, "copy", float(96 << 20), group_size=1, stream=1, channels=24, threads=544, regs=96,
    smem=82240, **kw,
  )  # fmt: skip


def _gemm(name, dtype="bf16", time_s=1.41e-3, **kw):
  return dataclasses.replace(
    sim.Kernel.gemm(name, 8192, 8192, 8192, dtype=dtype, **kw), time_s=time_s
  )


def _latency(res, name="copy"):
  t = res.timing(name)
  return t.end_s - t.ready_s


def test_one_queue_serialises_a_copy_launched_behind_the_fp32_cublas_gemm_as_measured():
  # Measured on an H200 (BACKGROUND section 2): a copy launched behind cuBLAS's fp32 GEMM
  # (2.73 ms) ended 2.9 ms after its launch with CUDA_DEVICE_MAX_CONNECTIONS=1.
  wl = sim.Workload((_gemm("gemm", "f32", 2.73e-3), _copy(time_s=0.11e-3)), "fp32")
  one = sim.simulate(wl, target="h200", policy=ONE_QUEUE, check=True)
  assert _latency(one) == pytest.approx(2.9e-3, rel=0.10)
  # With its own queue at the highest priority it gets in long before the GEMM ends (measured
  # 1.0 ms; the model's guessed TF32 tiles let it in sooner, 0.28 ms).
  own = sim.simulate(wl, target="h200", policy=PRIORITY, check=True)
  assert _latency(own) < 0.5 * _latency(one)


def test_a_copy_launched_first_goes_first_in_one_queue():
  # Measured: launched before the GEMM the copy took 0.135 ms (the GEMM 7% slower).
  wl = sim.Workload((_copy(time_s=0.11e-3), _gemm("gemm")), "copy first")
  for policy in (PRIORITY, ONE_QUEUE):
    res = sim.simulate(wl, target="h200", policy=policy, check=True)
    assert _latency(res) < 0.2e-3


def test_one_queue_lets_a_collective_launched_before_a_persistent_gemm_take_the_sms_first():
  # Both wait for the kernel before: with a queue each, the GEMM's launch reaches the
  # dispatcher first (an event resolves later than a launch on the same stream) and holds
  # every SM; in one queue the collective, launched first, is dispatched first.
  wl = sim.Workload(
    (_gemm("k"), sim.Collective("ag", "all-gather", float(64 << 20), 8, stream=1, after=("k",)),
     _gemm("g")),
    "held",
  )  # fmt: skip
  own = sim.simulate(wl, target="h200x8", policy=PRIORITY, check=True)
  one = sim.simulate(wl, target="h200x8", policy=ONE_QUEUE, check=True)
  g = own.timing("g")
  assert own.timing("ag").start_s > g.start_s + 0.9 * g.duration_s  # as its tiles run out
  assert one.timing("ag").start_s < one.timing("g").start_s + 1e-6
  assert one.makespan_s < own.makespan_s


def test_an_item_waiting_for_its_stream_holds_back_every_later_launch_in_one_queue():
  # c1 waits for c0 on the communication stream; the kernel launched after c1 waits too.
  c0 = _copy("c0", time_s=1e-3)
  c1 = dataclasses.replace(_copy("c1", time_s=1e-4))
  k = sim.Kernel("k", grid=132, threads=128, regs=32, flops=1e9, kind="fusion", time_s=1e-4)
  wl = sim.Workload((c0, c1, k), "head of line")
  own = sim.simulate(wl, target="h100", policy=PRIORITY, check=True)
  one = sim.simulate(wl, target="h100", policy=ONE_QUEUE, check=True)
  assert own.timing("k").start_s < own.timing("c0").end_s
  assert one.timing("k").start_s >= one.timing("c0").end_s
  assert one.timing("k").start_s >= one.timing("c1").ready_s


def test_stream_priority_decides_nothing_in_one_queue():
  wl = sim.Workload(
    (_gemm("g0", "f32", 2.73e-3), _copy(time_s=0.11e-3), _gemm("g1", stream=0)), "mix"
  )
  with_priority = sim.simulate(wl, target="h200", policy=ONE_QUEUE)
  without = sim.simulate(wl, target="h200", policy=sim.Policy("one", single_queue=True))
  assert [(t.start_s, t.end_s) for t in with_priority.timings] == [
    (t.start_s, t.end_s) for t in without.timings
  ]


def test_single_queue_must_be_a_bool():
  with pytest.raises(ValueError, match="single_queue must be True or False"):
    sim.Policy("x", single_queue=1)


def test_only_16_and_8_bit_library_gemms_are_persistent_on_hopper():
  h200 = targets.get_gpu("h200")
  assert sim.gemm_config(h200, 8192, 8192, 8192, "bf16").persistent
  assert not sim.gemm_config(h200, 8192, 8192, 8192, "f32").persistent
  assert not sim.gemm_config("a100", 8192, 8192, 8192, "bf16").persistent


def test_gemm_dispatch_records_are_predicted_as_launched_and_in_one_queue(gpu_records):
  # gemm_dispatch.cu's record form, with BACKGROUND's H200 figures for the 8192^3 bf16 cuBLAS
  # GEMM (1.41 ms): a copy launched behind it at the greatest priority ended 1.47-1.55 ms
  # after its launch, and 1.48 ms under CUDA_DEVICE_MAX_CONNECTIONS=1. The copy's time alone
  # is assumed (0.12 ms; the wait dominates).
  records = gpu_records
  rec = {
    "gemm": {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16", "sm_count_target": 0},
    "priority": True,
    "issue": "compute_first",
    "gemm_alone_s": 1.41e-3,
    "proxy_alone_s": 0.12e-3,
  }
  data = {
    "device": {"name": "NVIDIA H200"},
    "proxy": {"ctas": 24, "threads": 544, "smem": 82240, "bytes": 96 << 20},
  }
  as_launched = records.dispatch_prediction({**data, "cuda_device_max_connections": None}, rec)
  one_queue = records.dispatch_prediction({**data, "cuda_device_max_connections": "1"}, rec)
  assert as_launched == pytest.approx(1.51e-3, rel=0.2)
  assert one_queue == pytest.approx(1.48e-3, rel=0.2)
  assert records.dispatch_prediction(data, {**rec, "gemm_alone_s": None}) is None
