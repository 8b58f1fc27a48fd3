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
    hidden_s: compute between its issue and its first use (matmuls, by the cost model).
    matmuls: how many matmuls run in that window.
    exposed_s: what the cost model expects it to leave exposed.
  """

  eqn: int
  first_use: int
  after: int | None
  nbytes: int
  time_s: float
  hidden_s: float
  matmuls: int
  exposed_s: float


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
  eqns, order: list[int], wanted: dict[int, tuple[int, int, int]], topo
) -> list[Issue]:
  """Each gather of ``wanted`` (equation -> (the equation first reading it, bytes gathered,
  devices it gathers over)), placed on the timeline of ``order`` (module docstring); in order
  of first use. A gather is tied after a matmul or a loop (whose results vary over the mesh as
  the gathered weights do), never issued later than ``order`` has it."""
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
    after = order[q - 1] if q >= 1 else None
    out.append(Issue(g, use, after, size, t_of[g], hidden, n_mm[u] - n_mm[q], exposed))
  return out
