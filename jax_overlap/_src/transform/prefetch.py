"""Prefetch by time: where each parameter all-gather of a body is issued so that, by the cost
model, it has arrived when it is first used.

No notion of "layer": every gather (or a pipelined loop's first gathers, issued before the
loop) is placed on one timeline of the body's compute, in the planned order. The gathers share
one link and go one at a time, as XLA runs all-gathers on GPUs, so they are placed latest
first: each finishes by its first use or by the start of the next one, whichever is earlier,
and is issued after the last equation that ends before it must start (its input is tied to
that equation's output: XLA may issue it later, not earlier, so it neither holds memory nor
takes the link before it has to). The gathers that cannot finish in time (the step's first
ones: little or nothing runs before them) go from the start one after another in order of
first use, the compute waiting for them; each is tied after the last compute that ends, on
that timeline, before the link is free for it, so XLA neither merges it with the ones before
nor issues it ahead of them.

Compute time counts matmuls alone (a loop's: its body's times its length), by the roofline of
:mod:`jax_overlap._src.analysis.cost_model`: the fused elementwise work is left out, so the
gathers are issued early rather than late.

A memory cap (``prefetch_memory``) bounds the bytes held ahead of first use: a gather holds its
bytes from its issue point (in flight or arrived) to its first use, and at no point between two
equations may the gathers held sum to more than the cap. Taken in order of first use (the
link's order), each is issued at the first point after the compute that is no earlier than its
time, no earlier than the one before it, and where what is still held leaves room for it:
issue points only move later, each as little as the cap allows. A gather larger than the cap
is issued just in time for its use (after the last compute before it), alone: the ones after
it wait for its use. Gathers first read by one equation are held together, even above the cap.
Where the cap delays a gather, both placements, with the cap and without it, are run on one
timeline (:func:`timeline`): the link takes the gathers one at a time in order of first use,
each as soon as it is issued and the link is free, and each first use waits for its gather.
What each leaves exposed and hides under comes from there; that timeline also counts the
waits for the link behind the step's first gathers, which the placement alone leaves out, so
its exposed time without the cap can be above the one reported with no cap given.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from jax_overlap._src.transform.jaxprs import MATMUL, is_var, nbytes, subjaxprs


@dataclasses.dataclass(frozen=True)
class Issue:
  """Where one gather (or a loop's first gathers) is issued.

  Attributes:
    eqn: the all-gather's equation (or the pipelined loop's).
    first_use: the equation that first reads it.
    after: the equation it is issued after (its input is tied to that equation's output),
      None when it is issued at the start.
    nbytes: bytes gathered.
    time_s: the gather's time by the cost model.
    hidden_s: compute between its issue and its first use (matmuls, by the cost model;
      where a memory cap delays gathers, from its start on the link, :func:`timeline`).
    matmuls: how many matmuls run in that window.
    exposed_s: what the cost model expects it to leave exposed.
    capped: issued later than its time to keep within the memory cap.
    exposed_uncapped_s: with a memory cap, what it leaves exposed placed without the cap:
      ``exposed_s`` where the cap delays nothing, else both on :func:`timeline`; None
      without a cap.
  """

  eqn: int
  first_use: int
  after: int | None
  nbytes: int
  time_s: float
  hidden_s: float
  matmuls: int
  exposed_s: float
  capped: bool = False
  exposed_uncapped_s: float | None = None


def eqn_time(e, gpu) -> float:
  """Compute time of one equation by the roofline: matmuls, and the matmuls of the loops and
  calls inside it (a ``lax.scan``'s times its length); 0 for everything else."""
  from jax_overlap._src.analysis import cost_model as cost

  name = e.primitive.name
  if name == "dot_general":
    (lc, _), (lb, _) = e.params["dimension_numbers"]
    lhs = e.invars[0].aval
    k = math.prod(lhs.shape[d] for d in lc)
    out = e.outvars[0].aval
    flops = 2.0 * math.prod(out.shape) * k
    moved = sum(nbytes(v.aval) for v in (*e.invars, *e.outvars) if is_var(v))
    return cost.kernel_time(flops, moved, gpu, dtype=str(lhs.dtype), is_dot=True)
  if name in MATMUL:  # convolutions: their output bytes, as a floor
    return cost.kernel_time(0.0, sum(nbytes(v.aval) for v in e.outvars), gpu)
  inner = sum(eqn_time(s, gpu) for sub in subjaxprs(e) for s in sub.eqns)
  if name == "scan":
    inner *= int(e.params.get("length", 1))
  return inner


def count_matmuls(e) -> int:
  name = e.primitive.name
  if name in MATMUL:
    return 1
  n = sum(count_matmuls(s) for sub in subjaxprs(e) for s in sub.eqns)
  return n * int(e.params.get("length", 1)) if name == "scan" else n


def issue_by_time(
  eqns,
  order: list[int],
  wanted: dict[int, tuple[int, int, int]],
  topo,
  prefetch_memory: int | None = None,
) -> list[Issue]:
  """Each gather of ``wanted`` (equation -> (the equation first reading it, bytes gathered,
  devices it gathers over)), placed on the timeline of ``order`` (module docstring); in order
  of first use. A gather is tied after a matmul or a loop (whose results vary over the mesh as
  the gathered weights do), never issued later than ``order`` has it unless
  ``prefetch_memory`` (the most bytes held ahead of first use; None: no cap) delays it."""
  from jax_overlap._src.analysis import cost_model as cost

  pos = {i: p for p, i in enumerate(order)}
  times = [eqn_time(eqns[i], topo.gpu) for i in order]
  begin = [0.0]  # begin[p]: when the equation at position p starts
  n_mm = [0]  # matmuls before position p
  for i, t in zip(order, times):
    begin.append(begin[-1] + t)
    n_mm.append(n_mm[-1] + count_matmuls(eqns[i]))
  by_use = sorted(wanted, key=lambda g: (pos[wanted[g][0]], pos[g]))
  t_of = {
    g: cost.collective_time("all-gather", wanted[g][1], max(wanted[g][2], 2), topo) for g in by_use
  }

  def tie(g: int, p: int) -> int:
    """Position to issue ``g`` before: after the last compute that precedes ``p``."""
    q = min(p, pos[g], pos[wanted[g][0]])
    while q >= 1 and times[q - 1] <= 0.0:
      q -= 1
    return max(q, 0)

  # Latest first: each finishes by its first use or by the next one's start.
  start: dict[int, float] = {}
  next_start = math.inf
  for g in reversed(by_use):
    start[g] = min(begin[pos[wanted[g][0]]], next_start) - t_of[g]
    next_start = start[g]
  # The ones that cannot finish in time go from the start, one after another in order of
  # first use; the compute waits for them (a second timeline, with those waits).
  late = [g for g in by_use if start[g] < 0.0]
  issue_at: dict[int, float] = {}
  finish: dict[int, float] = {}
  free = 0.0
  for g in late:
    issue_at[g], free = free, free + t_of[g]
    finish[g] = free
  waits_at: dict[int, list[int]] = {}
  for g in late:
    waits_at.setdefault(pos[wanted[g][0]], []).append(g)
  clock, stalled_begin, ends = 0.0, {}, []
  for p in range(len(order)):
    for g in waits_at.get(p, ()):
      clock = max(clock, finish[g])
    stalled_begin[p] = clock
    clock += times[p]
    ends.append(clock)
  out: list[Issue] = []
  at: list[int] = []  # the issue point of each, as a position
  last_q = 0  # issue points never go back: the link takes them in order of first use
  for g in by_use:
    use, size, _ = wanted[g]
    u = pos[use]
    if g in issue_at:
      q = tie(g, bisect.bisect_right(ends, issue_at[g] + 1e-12))
      exposed = max(0.0, finish[g] - (ends[u - 1] if u else 0.0))  # the wait it adds
      hidden = max(0.0, t_of[g] - exposed)  # compute that runs while it travels
    else:
      q = tie(g, bisect.bisect_right(begin, start[g] + 1e-12) - 1)
      hidden, exposed = begin[u] - begin[q], 0.0
    if q < last_q and last_q <= min(pos[g], u):
      q = last_q
      hidden = begin[u] - begin[q]
      exposed = max(exposed, t_of[g] - hidden)
    last_q = max(last_q, q)
    at.append(q)
    after = order[q - 1] if q >= 1 else None
    out.append(Issue(g, use, after, size, t_of[g], hidden, n_mm[u] - n_mm[q], exposed))
  if prefetch_memory is None:
    return out
  return _within(prefetch_memory, out, at, [pos[it.first_use] for it in out], times, order, n_mm)


def _within(
  cap: int,
  issues: list[Issue],
  at: list[int],
  uses: list[int],
  times: list[float],
  order: list[int],
  n_mm: list[int],
) -> list[Issue]:
  """``issues`` (placed by time, in order of first use, issued before positions ``at`` and
  first used at positions ``uses``) delayed as little as ``cap`` bytes held ahead of first use
  allow (module docstring) and placed again on the timeline of ``times``."""
  # Where a gather may be issued: at the start, right after a compute (as by time), or right
  # after an earlier gather's first use (where the bytes held fall).
  points = [q for q in range(len(times) + 1) if q == 0 or times[q - 1] > 0.0]
  used: list[int] = []  # first uses of the gathers placed so far (non-decreasing)
  held = [0]  # held[k]: bytes of the first k of them

  def held_at(q: int) -> int:
    """Bytes placed and still held at the point before position ``q`` (all issued by then:
    issue points only move later)."""
    return held[-1] - held[bisect.bisect_left(used, q)]

  new_at: list[int] = []
  last_q = 0
  for it, q0, u in zip(issues, at, uses):
    lo = max(q0, last_q)
    room = cap - min(it.nbytes, cap)  # one larger than the cap goes alone
    q = lo
    if held_at(lo) > room:
      # The first release after ``lo`` that leaves room, if one comes before its use;
      # else just in time: after the last compute or release before its use.
      k = bisect.bisect_left(used, lo)
      while k < len(used) and used[k] < u and held_at(used[k] + 1) > room:
        k += 1
      if k < len(used) and used[k] < u:
        q = used[k] + 1
      else:
        last = points[bisect.bisect_right(points, u) - 1]
        release = used[bisect.bisect_left(used, u) - 1] + 1 if used and used[0] < u else 0
        q = max(lo, last, release)
    new_at.append(q)
    last_q = q
    used.append(u)
    held.append(held[-1] + it.nbytes)
  if new_at == at:  # the cap costs nothing
    return [dataclasses.replace(it, exposed_uncapped_s=it.exposed_s) for it in issues]
  # Both placements on one timeline that also counts the waits for the link.
  uncapped = timeline(times, [(q, u, it.time_s) for it, q, u in zip(issues, at, uses)])
  capped = timeline(times, [(q, u, it.time_s) for it, q, u in zip(issues, new_at, uses)])
  return [
    dataclasses.replace(
      it,
      after=order[q - 1] if q >= 1 else None,
      hidden_s=hidden,
      matmuls=n_mm[u] - n_mm[q],
      exposed_s=exposed,
      capped=q > q0,
      exposed_uncapped_s=free,
    )
    for it, q0, q, u, (exposed, hidden), (free, _) in zip(
      issues, at, new_at, uses, capped, uncapped
    )
  ]


def timeline(
  times: list[float], gathers: list[tuple[int, int, float]]
) -> list[tuple[float, float]]:
  """The compute of ``times`` (seconds per position) run with ``gathers`` ((issued before
  position, first used at position, seconds on the link), in the link's order): the link
  takes one at a time, each as soon as it is issued and the link is free, and its first use
  waits for it. Per gather: (exposed, hidden), the wait it adds at its first use and the
  compute that runs between its start on the link and its first use."""
  issued: dict[int, list[int]] = {}
  waited: dict[int, list[int]] = {}
  for k, (q, u, _) in enumerate(gathers):
    issued.setdefault(q, []).append(k)
    waited.setdefault(u, []).append(k)
  n = len(times)
  starts, finish = [0.0] * len(gathers), [0.0] * len(gathers)
  exposed = [0.0] * len(gathers)
  run_start: list[float] = []  # when the compute at each position starts
  clock = free = 0.0
  for p in range(n + 1):
    for k in issued.get(p, ()):
      starts[k] = max(clock, free)
      free = finish[k] = starts[k] + gathers[k][2]
    for k in waited.get(p, ()):
      exposed[k] = max(0.0, finish[k] - clock)
      clock += exposed[k]
    if p < n:
      run_start.append(clock)
      clock += times[p]
  done = [0.0]  # compute before each position
  for t in times:
    done.append(done[-1] + t)
  out = []
  for k, (q, u, _) in enumerate(gathers):
    # Positions from q on whose compute ends after it starts on the link.
    p = max(q, bisect.bisect_right(run_start, starts[k]) - 1)
    hidden = 0.0
    if p < u:
      hidden = (
        done[u] - done[p + 1] + max(0.0, run_start[p] + times[p] - max(run_start[p], starts[k]))
      )
    out.append((exposed[k], hidden))
  return out
