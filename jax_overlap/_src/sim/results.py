"""What a simulation returns: each kernel's and collective's timing, and the step's."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

__all__ = ["KernelTiming", "SimResult"]


@dataclasses.dataclass(frozen=True)
class KernelTiming:
  """When one kernel or collective ran in a simulation."""

  name: str
  kind: str
  stream: int
  priority: int
  ready_s: float
  start_s: float
  end_s: float
  blocks: int
  blocks_per_sm: int
  threads: int
  smem: int
  is_collective: bool

  @property
  def duration_s(self) -> float:
    return self.end_s - self.start_s


@dataclasses.dataclass
class SimResult:
  """Outcome of one simulation.

  Attributes:
    target: topology name.
    policy: policy name.
    makespan_s: end of the last block.
    timings: one :class:`KernelTiming` per workload item, in workload order.
    events: loop iterations the simulation took.
    occupancy_times: event times (seconds) when recorded, else None.
    occupancy: array [events, sm_count] of the fraction of each SM in use (max over
      threads, registers, shared memory, blocks) from each event time on, else None.
    isolated_s: isolated duration of each compute kernel (alone on the device, unshaped).
    batches: with ``check=True``, one entry per finished batch of blocks: (item index,
      blocks, blocks per SM, SM ids, start, end); else None.
  """

  target: str
  policy: str
  makespan_s: float
  timings: list[KernelTiming]
  events: int
  occupancy_times: np.ndarray | None = None
  occupancy: np.ndarray | None = None
  isolated_s: dict[str, float] | None = None
  batches: list | None = None

  def timing(self, name: str) -> KernelTiming:
    for t in self.timings:
      if t.name == name:
        return t
    raise KeyError(f"SimResult.timing: no kernel named {name!r}")

  @property
  def compute_time_s(self) -> float:
    """Sum of compute-kernel durations."""
    return sum(t.duration_s for t in self.timings if not t.is_collective)

  @property
  def compute_slowdown(self) -> float:
    """Sum of compute durations over the sum of their isolated durations, minus one."""
    if not self.isolated_s:
      return 0.0
    base = sum(self.isolated_s.values())
    actual = sum(t.duration_s for t in self.timings if t.name in self.isolated_s)
    return actual / base - 1.0 if base > 0 else 0.0

  @property
  def comm_end_s(self) -> dict[str, float]:
    """Completion time of each collective."""
    return {t.name: t.end_s for t in self.timings if t.is_collective}

  @property
  def comm_latency_s(self) -> dict[str, float]:
    """Ready-to-done time of each collective."""
    return {t.name: t.end_s - t.ready_s for t in self.timings if t.is_collective}

  def to_dict(self) -> dict:
    return {
      "target": self.target,
      "policy": self.policy,
      "makespan_s": self.makespan_s,
      "compute_time_s": self.compute_time_s,
      "compute_slowdown": self.compute_slowdown,
      "events": self.events,
      "kernels": [dataclasses.asdict(t) for t in self.timings],
    }

  def to_json(self, indent: int | None = 1) -> str:
    return json.dumps(self.to_dict(), indent=indent)

  def plot(self, path: str, **kwargs) -> str:
    """Writes a PNG timeline (one lane per stream) and SM-occupancy heat map; see sim.plot."""
    from jax_overlap._src.sim.plot import plot

    return plot(self, path, **kwargs)
