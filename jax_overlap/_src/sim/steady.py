"""The event loop's fast path: the repeated waves of a kernel that runs alone.

A kernel with many more blocks than the SMs hold (a loop fusion of 262,144 blocks, eight
to an SM) refills each SM as its blocks finish. While it is the only kernel resident, no
other item becomes ready and it has blocks left, the dispatcher's state returns to itself:
the same batches on the same groups of SMs with the same remaining work, one *period*
later and a fixed number of blocks further. Everything in that state (rates, DRAM shares,
which slot empties next) is a function of the state, so the periods that follow are
copies of the one observed, and the loop may skip whole periods at once: the clock
advances by their time and the kernel's remaining blocks by their blocks. The result is
the one the loop computes event by event, to the resolution at which states are compared
(a billionth of a block's work) and the rounding of the clock's sum.

A state is recognised by its signature: per group of SMs, its size and the (blocks,
remaining work to 1e-9) of each resident batch; the kernel; and the pending items.
"""

from __future__ import annotations

import math

# Signatures remembered before the memory is cleared (a state that never repeats).
_MAX_SEEN = 1024
# Remaining work is compared to this resolution (as the loop merges groups).
_RESOLUTION = 1e9


class Periods:
  """Recognises a repeated state and says how many whole periods may be skipped."""

  def __init__(self, comm):
    self._comm = comm
    self._seen: dict = {}

  def skip(
    self, groups, pending, remaining, running, t: float, events: int, next_ready: float | None
  ):
    """``(kernel, seconds, blocks, events)`` to skip from ``t``, or None.

    ``pending``: the dispatcher's queue ((-priority, order, item) tuples); ``remaining``,
    ``running``: each item's blocks still to dispatch and resident; ``next_ready``: the
    time the next item becomes ready (None if none will).
    """
    k = next((g.batches[0].k for g in groups if g.batches), None)
    # A period refills every resident slot once: one period observed and another skipped
    # need at least three times the resident blocks still to dispatch.
    if k is None or self._comm[k] or remaining[k] < 3 * running[k]:
      self._seen.clear()
      return None
    for g in groups:
      for b in g.batches:
        if b.k != k:
          self._seen.clear()
          return None
    parts = sorted(
      (len(g.sms), g.reserved, tuple(sorted((b.cnt, int(b.rem * _RESOLUTION)) for b in g.batches)))
      for g in groups
    )
    key = (k, tuple(parts), tuple(p[2] for p in pending))
    ref = self._seen.get(key)
    if ref is None:
      if len(self._seen) >= _MAX_SEEN:
        self._seen.clear()
      self._seen[key] = (t, remaining[k], events)
      return None
    self._seen.clear()
    t_ref, left_ref, events_ref = ref
    period, blocks = t - t_ref, left_ref - remaining[k]
    if period <= 0.0 or blocks <= 0:
      return None
    # Every skipped period must start with a period's blocks still to dispatch (one spare),
    # and end before the next item becomes ready (one period's margin for rounding).
    n = remaining[k] // blocks - 1
    if next_ready is not None:
      n = min(n, math.floor((next_ready - t) / period) - 1)
    if n < 1:
      return None
    return k, n * period, n * blocks, n * (events - events_ref)
