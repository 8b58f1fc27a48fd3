"""The contention-free critical path of a workload: what the analysis's timeline computes
for the same sequence, which :func:`~jax_overlap.sim.realize` reports as ``ideal_s``."""

from __future__ import annotations

from jax_overlap._src.analysis import timeline
from jax_overlap._src.sim import engine
from jax_overlap._src.sim.gemm import launch_kind
from jax_overlap._src.sim.model import Workload

__all__ = ["critical_path", "persistent_kernels"]


def critical_path(wl: Workload, durations, persistent=()) -> float:
  """End time of ``wl`` with unlimited resources: each item takes ``durations[name]`` and
  starts when its stream predecessor and everything it waits for have finished; a
  collective that would start inside one of the ``persistent`` kernels (names) starts when
  it ends, by the analysis's rule (``timeline.hold_behind_persistent``)."""
  persistent = set(persistent)

  def once(held):
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    last: dict[int, float] = {}
    for it in wl.items:
      s = max([last.get(it.stream, 0.0), *(end[a] for a in it.after)])
      start[it.name] = max(s, held.get(it.name, (0.0, ""))[0])
      end[it.name] = start[it.name] + float(durations[it.name])
      last[it.stream] = end[it.name]
    kernels = [(it.name, start[it.name], end[it.name]) for it in wl.items if it.name in persistent]
    return (
      max(end.values()),
      kernels,
      [(c.name, start[c.name], end[c.name]) for c in wl.collectives],
    )

  return timeline.hold_behind_persistent(once, len(wl.collectives))[0]


def persistent_kernels(wl: Workload, topo) -> tuple[str, ...]:
  """The kernels of ``wl`` that run persistent on ``topo`` (as the simulator decides)."""
  gpu = engine.resolve_target(topo).gpu
  return tuple(k.name for k in wl.kernels if launch_kind(k, gpu)[0])
