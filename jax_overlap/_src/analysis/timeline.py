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

Dispatch rule: a persistent kernel (a library GEMM on Hopper, ``KernelInfo.persistent``)
holds every SM until it ends when it starts with the device to itself, so an async
collective that becomes ready while it runs, or just as it starts (both waited for the
kernel before it, and the compute stream's next kernel reaches the dispatcher before a
collective released by an event; at the step's start the collective, launched first, goes
first), starts only when it ends (``CollectiveInfo.held_by`` names it). Measured on an H200: a copy
launched behind cuBLAS's persistent GEMM waited for all of it at the highest priority. A
collective already running when such a GEMM starts keeps its SMs, and one queued behind
it on its stream takes them as it ends. The simulator applies the same rule
(``sim.Kernel.persistent``).

Otherwise this placement assumes that whatever XLA's schedule puts side by side really
runs concurrently at full speed; ``jax_overlap.sim.realize`` gives the
contention-aware time of the same sequence.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

from jax_overlap._src.analysis.schedule import CollectiveInfo, Schedule

__all__ = ["Event", "Placement", "hold_behind_persistent", "held_behind_persistent", "place"]


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
  """Places every kernel and collective of ``schedule`` on its stream, applying the
  dispatch rule of persistent kernels (module docstring)."""
  persistent = [k for k in schedule.kernels if k.persistent]
  async_ = [c for c in schedule.collectives if not c.synchronous]

  def once(held):
    placed = _place(schedule, held)
    spans = [(k.name, k.start_s, k.end_s) for k in persistent]
    return placed, spans, [(c.name, c.start_s, c.end_s) for c in async_]

  placed, held = hold_behind_persistent(once, len(async_))
  if held:
    placed.notes.append(
      f"{len(held)} collective(s) became ready while a persistent library GEMM held every "
      "SM and start when it ends (Hopper's cuBLAS kernels; see CollectiveInfo.held_by)"
    )
  for c in schedule.collectives:
    c.held_by = held[c.name][1] if c.name in held else ""
  return placed


def hold_behind_persistent(once, collectives: int):
  """The placement ``once(held)`` at the fixed point of :func:`held_behind_persistent`.

  ``once(held)`` places the step with each collective in ``held`` starting no earlier than
  its time there, and returns (its result, the persistent kernels' spans, the async
  collectives' spans). Each pass only moves collectives later: at most one more pass than
  there are collectives. Returns (the last result, held). The analysis's timeline and the
  simulator's contention-free critical path both place by it.
  """
  held: dict[str, tuple[float, str]] = {}
  for _ in range(collectives + 1):
    result, kernels, spans = once(held)
    more = held_behind_persistent(kernels, spans, held) if kernels else {}
    if not more:
      break
    held.update(more)
  return result, held


def held_behind_persistent(
  kernels: list[tuple[str, float, float]],
  collectives: list[tuple[str, float, float]],
  held: dict[str, tuple[float, str]],
) -> dict[str, tuple[float, str]]:
  """The dispatch rule of persistent kernels (module docstring) on one placement.

  ``kernels``: (name, start, end) of the persistent kernels of the compute stream, in
  order; ``collectives``: (name, start, end) of the async collectives; ``held``: the
  collectives already held. Returns the others that start inside a persistent kernel that
  began with no collective running (or start just as it began), and the held ones whose
  kernel has moved: name -> (its end, its name). A held collective is not held again by
  the kernel after its own: it gets the SMs its kernel's last blocks leave. The
  simulator's contention-free critical path applies the same function.
  """
  starts = [k[1] for k in kernels]
  ends = {k[0]: k[2] for k in kernels}
  out = {n: (ends[k], k) for n, (t, k) in held.items() if k in ends and ends[k] != t}
  for name, start, _ in collectives:
    j = bisect.bisect_right(starts, start) - 1
    if j < 0 or name in held:
      continue
    k_name, k_start, k_end = kernels[j]
    # Ready just as the kernel starts: both waited for the kernel before, and the compute
    # stream's next kernel reaches the dispatcher first. At the step's start nothing came
    # before: the collective, launched first, goes first.
    if not (k_start < start < k_end or (start == k_start and start > 0.0)):
      continue
    # A collective resident when the kernel started kept SMs from it.
    if any(s < k_start < e for n, s, e in collectives if n != name):
      continue
    out[name] = (k_end, k_name)
  return out


def _place(schedule: Schedule, held: dict[str, tuple[float, str]]) -> Placement:
  """One placement; each collective in ``held`` starts no earlier than its time there."""
  for c in schedule.collectives:
    c.exposed_s = 0.0
    c.overlapped_kernels = 0
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
      c.start_s = max(t, stream_free[c.stream], held.get(c.name, (0.0, ""))[0])
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
