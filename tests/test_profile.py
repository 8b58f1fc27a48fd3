"""Tests for measured overlap from profiler traces (jax_overlap.profile.measure)."""

import gzip
import json
import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap import profile


def _write(path, events):
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  return str(path)


def _gpu_trace(kernels_by_stream):
  """A GPU-style trace: /device:GPU:0 with Stream lanes, plus a host lane that must be ignored."""
  ev = [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 99, "args": {"name": "XLA Ops"}},
    {"ph": "X", "pid": 2, "tid": 1, "name": "ncclDevKernel_AllGather", "ts": 0, "dur": 1e6},
    {"ph": "X", "pid": 1, "tid": 99, "name": "all-gather-start", "ts": 0, "dur": 1e6},
  ]
  for tid, (lane, kernels) in enumerate(kernels_by_stream.items()):
    ev.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": lane}})
    for name, ts, dur in kernels:
      ev.append({"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur})
  return ev


def test_synthetic_gpu_trace_with_known_answer(tmp_path):
  # Compute on stream 7 at [0,100) and [150,250) us; an all-gather on stream 20 at [50,200) us.
  ev = _gpu_trace(
    {
      "Stream #7(compute)": [("gemm_fusion_dot_1", 0, 100), ("loop_add_fusion", 150, 100)],
      "Stream #20(comm)": [("ncclDevKernel_AllGather_RING_LL", 50, 150)],
    }
  )
  m = profile.measure(_write(tmp_path / "a.trace.json.gz", ev))
  assert m.comm_time_s == pytest.approx(150e-6)
  assert m.overlapped_s == pytest.approx(100e-6)  # [50,100) and [150,200)
  assert m.exposed_comm_s == pytest.approx(50e-6)
  assert m.compute_time_s == pytest.approx(200e-6)
  assert m.overlap_fraction == pytest.approx(2 / 3)
  assert m.span_s == pytest.approx(250e-6)
  assert len(m.devices) == 1 and m.devices[0].num_comm == 1


def test_overlapping_comm_kernels_are_counted_once(tmp_path):
  ev = _gpu_trace(
    {
      "Stream #1": [("fusion", 0, 10)],
      "Stream #2": [("ncclDevKernel_ReduceScatter", 0, 40)],
      "Stream #3": [("all-reduce.3", 20, 40)],
    }
  )
  m = profile.measure(_write(tmp_path / "b.trace.json.gz", ev))
  assert m.comm_time_s == pytest.approx(60e-6)
  assert m.exposed_comm_s == pytest.approx(50e-6)


def test_real_cpu_trace(tmp_path):
  mesh = jax.make_mesh((8,), ("fsdp",))

  @jax.jit
  def f(w, x):
    def body(w, x):
      y = jnp.tanh(x @ jax.lax.all_gather(w, "fsdp", axis=0, tiled=True))
      return jax.lax.psum_scatter(y, "fsdp", scatter_dimension=0, tiled=True)

    return jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P("fsdp"))(
      w, x
    )

  w = jax.device_put(jnp.ones((256, 256)), NamedSharding(mesh, P("fsdp")))
  x = jax.device_put(jnp.ones((512, 256)), NamedSharding(mesh, P("fsdp")))
  f(w, x).block_until_ready()
  trace_dir = str(tmp_path / "trace")
  with jax.profiler.trace(trace_dir):
    for _ in range(2):
      f(w, x).block_until_ready()
  m = profile.measure(trace_dir)
  assert len(m.devices) == 8
  assert all(d.num_comm >= 2 and d.num_compute >= 1 for d in m.devices)
  assert m.comm_time_s > 0 and m.compute_time_s > 0
  # XLA:CPU runs collectives synchronously on the device's thread: nothing overlaps.
  assert m.overlapped_s == pytest.approx(0.0, abs=1e-9)
  assert m.exposed_comm_s == pytest.approx(m.comm_time_s)
  assert "exposed comm" in str(m)


def test_bad_traces(tmp_path):
  with pytest.raises(FileNotFoundError, match="no trace file or directory"):
    profile.measure(str(tmp_path / "missing"))
  os.makedirs(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz under"):
    profile.measure(str(tmp_path / "empty"))
  p = tmp_path / "junk.trace.json.gz"
  with gzip.open(p, "wt") as f:
    f.write("not json")
  with pytest.raises(ValueError, match="not a readable trace-event JSON"):
    profile.measure(str(p))
  host_only = [{"ph": "X", "pid": 1, "tid": 1, "name": "python", "ts": 0, "dur": 5}]
  with pytest.raises(ValueError, match="no device kernel events"):
    profile.measure(_write(tmp_path / "h.trace.json.gz", host_only))
