"""Measured overlap from a real profiler trace.

``measure(trace_dir)`` reads the Chrome/Perfetto trace that ``jax.profiler.trace``
writes (``plugins/profile/<run>/<host>.trace.json.gz``) and computes, per device,
from real kernel intervals:

* ``comm_time_s``: length of the union of communication kernel intervals;
* ``overlapped_s``: the part of it during which a compute kernel also ran;
* ``exposed_comm_s = comm_time_s - overlapped_s``;
* ``compute_time_s``: length of the union of compute kernel intervals;
* ``overlap_fraction = overlapped_s / comm_time_s``.

Device lanes are recognised as JAX writes them: on GPUs the
``/device:GPU:N`` processes and their ``Stream #...`` threads (kernels from
CUPTI); on CPUs the executor threads' events that carry ``hlo_op`` and
``device_ordinal`` arguments. Communication kernels are recognised by name
(NCCL's ``ncclDevKernel_*``/``ncclKernel_*`` and XLA's collective op names).

On a GPU cluster: wrap a few steps after warm-up in
``jax.profiler.trace("/tmp/trace")`` on each host (or use
``jax.profiler.start_server`` and capture from TensorBoard), copy the
``plugins/profile`` directory, and call ``measure`` on it; compare its
``exposed_comm_s`` with ``jax_overlap.analyze(...)``'s estimate.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import re
from collections.abc import Iterable

__all__ = ["Measured", "measure", "load_trace", "device_events", "COMM_PATTERN"]

COMM_PATTERN = re.compile(
  r"nccl|rccl|all[-_]?gather|reduce[-_]?scatter|all[-_]?reduce|all[-_]?to[-_]?all|"
  r"collective[-_]?permute|ragged[-_]?all|send|recv",
  re.IGNORECASE,
)
_SKIP = re.compile(r"^end: |^Wait|Rendezvous|Threadpool|^\$", re.IGNORECASE)


@dataclasses.dataclass
class DeviceMeasure:
  device: str
  comm_time_s: float
  overlapped_s: float
  exposed_comm_s: float
  compute_time_s: float
  span_s: float
  num_comm: int
  num_compute: int


@dataclasses.dataclass
class Measured:
  """Overlap measured from a trace, averaged over devices (per-device values in ``devices``)."""

  comm_time_s: float
  overlapped_s: float
  exposed_comm_s: float
  compute_time_s: float
  span_s: float
  overlap_fraction: float | None
  devices: list[DeviceMeasure]
  source: str

  def __str__(self) -> str:
    ov = "n/a" if self.overlap_fraction is None else f"{self.overlap_fraction * 100:.1f} %"
    return (
      f"measured from {os.path.basename(self.source)} ({len(self.devices)} devices, mean):\n"
      f"  communication  {self.comm_time_s * 1e3:10.3f} ms\n"
      f"  overlapped     {self.overlapped_s * 1e3:10.3f} ms\n"
      f"  exposed comm   {self.exposed_comm_s * 1e3:10.3f} ms\n"
      f"  compute        {self.compute_time_s * 1e3:10.3f} ms\n"
      f"  overlap        {ov:>10}"
    )


def _find_trace(path: str) -> str:
  if os.path.isfile(path):
    return path
  if not os.path.isdir(path):
    raise FileNotFoundError(f"measure: no trace file or directory at {path!r}")
  files = glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True)
  files += glob.glob(os.path.join(path, "**", "*.trace.json"), recursive=True)
  if not files:
    raise FileNotFoundError(
      f"measure: no *.trace.json.gz under {path!r}; write one with jax.profiler.trace(dir)"
    )
  return max(files, key=os.path.getmtime)


def load_trace(path: str) -> tuple[dict, str]:
  """Loads a trace-event JSON (gzipped or not) from a file or a profiler directory."""
  f = _find_trace(path)
  opener = gzip.open if f.endswith(".gz") else open
  try:
    with opener(f, "rt") as fh:
      data = json.load(fh)
  except (OSError, ValueError) as e:
    raise ValueError(f"measure: {f} is not a readable trace-event JSON file: {e}") from e
  if isinstance(data, list):
    data = {"traceEvents": data}
  if not isinstance(data, dict) or "traceEvents" not in data:
    raise ValueError(f"measure: {f} has no traceEvents")
  return data, f


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
  out: list[list[float]] = []
  for s, e in sorted(intervals):
    if e <= s:
      continue
    if out and s <= out[-1][1]:
      out[-1][1] = max(out[-1][1], e)
    else:
      out.append([s, e])
  return [(s, e) for s, e in out]


def _length(iv: list[tuple[float, float]]) -> float:
  return sum(e - s for s, e in iv)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
  i = j = 0
  total = 0.0
  while i < len(a) and j < len(b):
    s = max(a[i][0], b[j][0])
    e = min(a[i][1], b[j][1])
    if e > s:
      total += e - s
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return total


def device_events(events: list[dict]) -> dict[str, list[dict]]:
  """The trace's kernel events per device lane, as :func:`measure` reads them: on GPUs the
  complete events of each ``/device:GPU:N`` process's ``Stream`` threads (kernels, with
  ``hlo_op`` in their ``args`` where XLA launched them outside a command buffer), on CPUs
  the executor events that carry ``hlo_op`` and ``device_ordinal``.

  Args:
    events: the ``traceEvents`` of :func:`load_trace`'s trace.
  """
  procs = {
    e["pid"]: e.get("args", {}).get("name", "")
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  threads = {
    (e["pid"], e.get("tid")): e.get("args", {}).get("name", "")
    for e in events
    if e.get("ph") == "M" and e.get("name") == "thread_name"
  }
  by_dev: dict[str, list[dict]] = {}
  gpu_pids = {
    pid: name for pid, name in procs.items() if re.search(r"/device:(GPU|ROCM|CUDA)", name, re.I)
  }
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    if gpu_pids:
      if e.get("pid") not in gpu_pids:
        continue
      tname = threads.get((e["pid"], e.get("tid")), "")
      if tname and not tname.lower().startswith("stream"):
        continue  # "XLA Ops", "XLA Modules", "Steps" lines duplicate the kernels
      by_dev.setdefault(gpu_pids[e["pid"]], []).append(e)
    else:
      args = e.get("args", {})
      if "hlo_op" in args and "device_ordinal" in args and not _SKIP.search(e.get("name", "")):
        by_dev.setdefault(f"cpu:{args['device_ordinal']}", []).append(e)
  return by_dev


def _is_comm(e: dict) -> bool:
  args = e.get("args", {})
  return bool(
    COMM_PATTERN.search(e.get("name", "")) or COMM_PATTERN.search(str(args.get("hlo_op", "")))
  )


def measure(trace_dir: str, *, devices: Iterable[str] | None = None) -> Measured:
  """Communication, overlap and exposure measured from a ``jax.profiler`` trace.

  Args:
    trace_dir: the directory given to ``jax.profiler.trace`` (the newest trace
      under it is read), or a trace file.
    devices: restrict to these device lane names (e.g. ``["/device:GPU:0"]``).

  Returns:
    A :class:`Measured` (means over devices; per-device values in ``devices``).

  Raises:
    FileNotFoundError: when there is no trace.
    ValueError: when the trace has no device kernel events.
  """
  data, src = load_trace(trace_dir)
  by_dev = device_events(data["traceEvents"])
  if devices is not None:
    wanted = set(devices)
    by_dev = {k: v for k, v in by_dev.items() if k in wanted}
  if not by_dev:
    raise ValueError(
      f"measure: {src} has no device kernel events (GPU stream lanes, or CPU events with "
      "hlo_op); was the traced code run on the devices inside the trace?"
    )
  per = []
  for dev, evs in sorted(by_dev.items()):
    comm = _union((e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6) for e in evs if _is_comm(e))
    comp = _union((e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6) for e in evs if not _is_comm(e))
    c, k = _length(comm), _length(comp)
    ov = _intersection(comm, comp)
    allv = _union(comm + comp)
    span = (allv[-1][1] - allv[0][0]) if allv else 0.0
    per.append(
      DeviceMeasure(
        dev, c, ov, c - ov, k, span, sum(map(_is_comm, evs)), sum(not _is_comm(e) for e in evs)
      )
    )
  n = len(per)
  comm_t = sum(d.comm_time_s for d in per) / n
  ov_t = sum(d.overlapped_s for d in per) / n
  return Measured(
    comm_time_s=comm_t,
    overlapped_s=ov_t,
    exposed_comm_s=comm_t - ov_t,
    compute_time_s=sum(d.compute_time_s for d in per) / n,
    span_s=sum(d.span_s for d in per) / n,
    overlap_fraction=(ov_t / comm_t) if comm_t > 0 else None,
    devices=per,
    source=src,
  )
