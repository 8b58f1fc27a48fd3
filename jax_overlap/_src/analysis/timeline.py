"""Placing a schedule on streams: when each kernel and collective runs.

The compute stream executes kernels one after another in XLA's schedule
order. An async collective enters its communication stream when the compute
stream reaches its start (streams are FIFO, so collectives on one stream run
one after another); the compute stream waits at the matching done until the
collective has finished. A synchronous collective runs on the compute stream.

From the placement:

* ``compute_time_s``: the sum of kernel times (the compute-only lower bound);
* ``comm_time_s``: the sum of collective times;
* ``exposed_comm_s``: time the compute stream spends waiting for collectives,
  plus the time of synchronous collectives (communication not hidden by compute);
* ``step_time_s``: when the last stream finishes;
* ``overlap_fraction``: ``1 - exposed_comm_s / comm_time_s``.

This placement assumes that whatever XLA's schedule puts side by side really
runs concurrently at full speed; ``jax_overlap.sim.realize`` gives the
contention-aware time of the same sequence.
"""

from __future__ import annotations

import collections
import dataclasses

from jax_overlap._src.analysis.schedule import CollectiveInfo, Schedule

__all__ = ["Event", "Placement", "place"]


@dataclasses.dataclass
class Event:
  """A span on one lane of the timeline."""

  lane: str  # "compute", "comm[0]", ...
  name: str
  kind: str  # kernel kind, collective kind, or "wait"
  start_s: float
  end_s: float
  args: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Placement:
  events: list[Event]
  step_time_s: float
  compute_time_s: float
  comm_time_s: float
  exposed_comm_s: float
  notes: list[str]


def _event(track: str, item, args: dict) -> Event:
  """``item`` (a kernel or a collective, already placed) as an event on ``track``."""
  return Event(track, item.name, item.kind, item.start_s, item.end_s, args)


def place(schedule: Schedule) -> Placement:
  """Places every kernel and collective of ``schedule`` on its stream."""
  t = 0.0
  events: list[Event] = []
  stream_free: dict[int, float] = collections.defaultdict(float)
  in_flight: dict[str, CollectiveInfo] = {}
  order: list[str] = []  # FIFO of in-flight names, for dones whose start is in another iteration
  exposed = 0.0
  notes: list[str] = []
  unmatched = 0
  kernels_done = 0
  running: list[CollectiveInfo] = []

  for op in schedule.ops:
    if op.kind == "kernel":
      k = op.kernel
      k.start_s, k.end_s = t, t + k.time_s
      t = k.end_s
      kernels_done += 1
      for c in running:
        c.overlapped_kernels += 1
      events.append(_event("compute", k, {"flops": k.flops, "bytes": k.bytes_accessed}))
    elif op.kind == "sync":
      c = op.collective
      c.start_s, c.end_s = t, t + c.time_s
      c.exposed_s = c.time_s
      exposed += c.time_s
      t = c.end_s
      events.append(_event("compute", c, {"bytes": c.bytes, "sync": True}))
    elif op.kind == "start":
      c = op.collective
      c.start_s = max(t, stream_free[c.stream])
      c.end_s = c.start_s + c.time_s
      stream_free[c.stream] = c.end_s
      in_flight[c.name] = c
      order.append(c.name)
      running.append(c)
      events.append(_event(f"comm[{c.stream}]", c, {"bytes": c.bytes, "group": c.group_size}))
    elif op.kind == "done":
      c = in_flight.pop(op.start_name, None) if op.start_name else None
      if c is None:
        # A done whose start was issued in another loop iteration (pipelined collectives).
        name = order[0] if order else None
        c = in_flight.pop(name, None) if name else None
        if c is None:
          unmatched += 1
          continue
      order.remove(c.name)
      running.remove(c)
      c.done_index = kernels_done
      if c.end_s > t:
        wait = c.end_s - t
        c.exposed_s += wait
        exposed += wait
        events.append(
          Event("compute", f"wait {c.name}", "wait", t, c.end_s, {"collective": c.kind})
        )
        t = c.end_s
  # Collectives never waited for (none in well-formed programs) still finish.
  for c in in_flight.values():
    c.done_index = kernels_done
  if unmatched:
    notes.append(f"{unmatched} collective done(s) had no matching start and were ignored")
  end = max([t] + [c.end_s for c in schedule.collectives])
  compute = sum(k.time_s for k in schedule.kernels)
  comm = sum(c.time_s for c in schedule.collectives)
  return Placement(events, end, compute, comm, exposed, notes)
