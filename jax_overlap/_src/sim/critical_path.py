"""The contention-free critical path of a workload: what the analysis's timeline computes
for the same sequence, which :func:`~jax_overlap.sim.realize` reports as ``ideal_s``."""

from __future__ import annotations

from jax_overlap._src.analysis import timeline
from jax_overlap._src.sim import engine
from jax_overlap._src.sim.gemm import gemm_config
from jax_overlap._src.sim.model import Workload

__all__ = ["critical_path", "persistent_kernels"]


def critical_path(wl: Workload, durations, persistent=()) -> float:
  """End time of ``wl`` with unlimited resources: each item takes ``durations[name]`` and
  starts when its stream predecessor and everything it waits for have finished; a
  collective that would start inside one of the ``persistent`` kernels (names) starts when
  it ends, by the analysis's rule (``timeline.held_behind_persistent``)."""
  held: dict[str, tuple[float, str]] = {}
  for _ in range(len(wl.collectives) + 1):
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    last: dict[int, float] = {}
    for it in wl.items:
      s = max([last.get(it.stream, 0.0), *(end[a] for a in it.after)])
      start[it.name] = max(s, held.get(it.name, (0.0, ""))[0])
      end[it.name] = start[it.name] + float(durations[it.name])
      last[it.stream] = end[it.name]
    if not persistent:
      break
    more = timeline.held_behind_persistent(
      [(n, start[n], end[n]) for n in _in_launch_order(wl, persistent)],
      [(c.name, start[c.name], end[c.name]) for c in wl.collectives],
      held,
    )
    if not more:
      break
    held.update(more)
  return max(end.values())


def _in_launch_order(wl: Workload, names) -> list[str]:
  """``names`` in the workload's launch order."""
  names = set(names)
  return [it.name for it in wl.items if it.name in names]


def persistent_kernels(wl: Workload, topo) -> tuple[str, ...]:
  """The kernels of ``wl`` that run persistent on ``topo`` (as the simulator decides)."""
  gpu = engine.resolve_target(topo).gpu
  out = []
  for k in wl.kernels:
    p = k.persistent
    if p is None:
      p = k.grid is None and gemm_config(gpu, *k.gemm_mnk, k.dtype).persistent
    if p:
      out.append(k.name)
  return tuple(out)
