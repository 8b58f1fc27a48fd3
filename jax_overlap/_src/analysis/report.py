"""The analysis Report: tables, JSON, a timeline picture and a Perfetto trace."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from jax_overlap._src.analysis.schedule import CollectiveInfo, KernelInfo, LoopInfo
from jax_overlap._src.analysis.timeline import Event
from jax_overlap._src.compile.memory_stats import MemoryStats

__all__ = ["Report", "Comparison", "compare"]

COLLECTIVE_COLOURS = {
  "all-gather": "#1f77b4",
  "reduce-scatter": "#2ca02c",
  "all-reduce": "#9467bd",
  "all-to-all": "#ff7f0e",
  "collective-permute": "#17becf",
}


def _ms(s: float | None) -> str:
  return "n/a" if s is None else f"{s * 1e3:.3f}"


def _mb(b: float) -> str:
  return f"{b / 2**20:.1f}"


@dataclasses.dataclass
class Report:
  """What XLA's schedule of a step will do on a target, as estimated by the cost model.

  Attributes:
    name: a label (the function's name unless given).
    target: topology name, or "cpu" for the local devices.
    step_time_s: estimated step time.
    compute_time_s: sum of kernel times (the compute-only lower bound).
    comm_time_s: sum of collective times.
    exposed_comm_s: communication not hidden under compute.
    overlap_fraction: 1 - exposed/comm (None when there is no communication).
    flops: FLOPs per device per step, counted from the HLO.
    kernels: compute kernels in schedule order.
    collectives: collectives in schedule order.
    events: the timeline.
    memory: XLA's memory analysis per device (:class:`MemoryStats`); None where the
      backend gives none.
    xla_options: the per-compile options used.
    notes: anything the analysis assumed or could not model.
    compile_time_s: time XLA took to compile.
    loops: one :class:`LoopInfo` per while loop, with its trip count.
    uncounted_costs: estimated cost (s) of each kernel and collective in the branches of a
      conditional the step does not count (all but the most expensive), by instruction name.
    profile_missing: for a compile scheduled from a latency profile, the instructions XLA's
      scheduler costed itself because the profile does not name them (XLA's own warnings
      about them are kept off stderr and summarised in ``notes``); None without a profile.
  """

  name: str
  target: str
  step_time_s: float
  compute_time_s: float
  comm_time_s: float
  exposed_comm_s: float
  overlap_fraction: float | None
  flops: float
  kernels: list[KernelInfo]
  collectives: list[CollectiveInfo]
  events: list[Event]
  memory: MemoryStats | None
  xla_options: dict[str, Any]
  notes: list[str]
  compile_time_s: float = 0.0
  loops: list[LoopInfo] = dataclasses.field(default_factory=list)
  topology: Any = dataclasses.field(default=None, repr=False, compare=False)
  hlo_text: str = dataclasses.field(default="", repr=False, compare=False)
  uncounted_costs: dict[str, float] = dataclasses.field(
    default_factory=dict, repr=False, compare=False
  )
  profile_missing: tuple[str, ...] | None = dataclasses.field(
    default=None, repr=False, compare=False
  )

  # Simulator interface: the topology object behind ``target``.
  @property
  def exposed_fraction(self) -> float | None:
    return None if not self.comm_time_s else self.exposed_comm_s / self.comm_time_s

  def summary(self) -> dict[str, Any]:
    return {
      "name": self.name,
      "target": self.target,
      "step_time_s": self.step_time_s,
      "compute_time_s": self.compute_time_s,
      "comm_time_s": self.comm_time_s,
      "exposed_comm_s": self.exposed_comm_s,
      "overlap_fraction": self.overlap_fraction,
      "flops": self.flops,
      "num_kernels": len(self.kernels),
      "num_collectives": len(self.collectives),
      "async_collectives": sum(not c.synchronous for c in self.collectives),
    }

  def __str__(self) -> str:
    lines = [
      f"jax_overlap analysis: {self.name} on {self.target}",
      f"  step time        {_ms(self.step_time_s):>10} ms",
      f"  compute (sum)    {_ms(self.compute_time_s):>10} ms   ({self.flops / 1e12:.3f} TFLOP per device, "
      f"{len(self.kernels)} kernels)",
      f"  communication    {_ms(self.comm_time_s):>10} ms   ({len(self.collectives)} collectives, "
      f"{sum(not c.synchronous for c in self.collectives)} async)",
      f"  exposed comm     {_ms(self.exposed_comm_s):>10} ms",
      "  overlap          "
      + (
        "       n/a      (no collectives)"
        if self.overlap_fraction is None
        else f"{self.overlap_fraction * 100:>9.1f} %"
      ),
    ]
    if self.memory is not None:
      sizes = dataclasses.asdict(self.memory).items()
      lines.append("  memory/device    " + ", ".join(f"{k} {_mb(v)} MiB" for k, v in sizes if v))
    if self.collectives:
      by_kind: dict[str, list[CollectiveInfo]] = {}
      for c in self.collectives:
        by_kind.setdefault(c.kind, []).append(c)
      lines.append("")
      lines.append(
        f"  {'collective':<20}{'count':>6}{'MiB':>10}{'time ms':>10}{'exposed ms':>12}{'async':>7}"
      )
      for kind, cs in by_kind.items():
        lines.append(
          f"  {kind:<20}{len(cs):>6}{_mb(sum(c.bytes for c in cs)):>10}"
          f"{sum(c.time_s for c in cs) * 1e3:>10.3f}{sum(c.exposed_s for c in cs) * 1e3:>12.3f}"
          f"{sum(not c.synchronous for c in cs):>7}"
        )
      worst = sorted(self.collectives, key=lambda c: -c.exposed_s)[:5]
      worst = [c for c in worst if c.exposed_s > 0]
      if worst:
        lines.append("")
        lines.append("  most exposed:")
        for c in worst:
          lines.append(
            f"    {c.name:<36} {c.kind:<18} {_mb(c.bytes):>8} MiB  {c.exposed_s * 1e3:8.3f} ms "
            f"exposed of {c.time_s * 1e3:.3f} ms ({c.overlapped_kernels} kernels under it)"
          )
    else:
      lines.append("")
      lines.append("  no collectives: nothing to overlap")
    for n in self.notes:
      lines.append(f"  note: {n}")
    return "\n".join(lines)

  def to_dict(self, *, with_events: bool = True) -> dict[str, Any]:
    d = self.summary()
    d.update(
      {
        "memory": dataclasses.asdict(self.memory) if self.memory is not None else {},
        "xla_options": {
          k: (v if isinstance(v, (bool, int, float)) else str(v))
          for k, v in self.xla_options.items()
        },
        "notes": self.notes,
        "compile_time_s": self.compile_time_s,
        "loops": [dataclasses.asdict(lp) for lp in self.loops],
        "kernels": [dataclasses.asdict(k) for k in self.kernels],
        "collectives": [dataclasses.asdict(c) for c in self.collectives],
      }
    )
    if with_events:
      d["events"] = [dataclasses.asdict(e) for e in self.events]
    return d

  def to_json(self, path: str | None = None, *, indent: int | None = 1) -> str:
    """The report as JSON (written to ``path`` when given)."""
    text = json.dumps(self.to_dict(), indent=indent, default=str)
    if path is not None:
      with open(path, "w") as f:
        f.write(text)
    return text

  def to_perfetto(self, path: str) -> str:
    """Writes a Chrome trace-event JSON file that Perfetto UI and TensorBoard open."""
    lanes = sorted({e.lane for e in self.events}, key=lambda s: (s != "compute", s))
    tid = {lane: i for i, lane in enumerate(lanes)}
    trace = [
      {
        "ph": "M",
        "name": "process_name",
        "pid": 0,
        "args": {"name": f"{self.name} on {self.target} (estimated)"},
      }
    ]
    for lane, i in tid.items():
      trace.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": lane}})
    for e in self.events:
      trace.append(
        {
          "ph": "X",
          "name": e.name,
          "cat": e.kind,
          "pid": 0,
          "tid": tid[e.lane],
          "ts": e.start_s * 1e6,
          "dur": max(e.end_s - e.start_s, 0.0) * 1e6,
          "args": e.args,
        }
      )
    with open(path, "w") as f:
      json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f, default=str)
    return path

  def plot(self, path: str, *, title: str | None = None) -> str:
    """Writes a PNG timeline: one lane per stream, collectives coloured by kind."""
    plt = _pyplot()
    lanes = sorted({e.lane for e in self.events}, key=lambda s: (s != "compute", s)) or ["compute"]
    fig, ax = plt.subplots(figsize=(12, 1.9 + 0.7 * len(lanes)))
    y = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    scale = 1e3
    for e in self.events:
      width = (e.end_s - e.start_s) * scale
      if e.kind == "wait":
        ax.barh(
          y[e.lane],
          width,
          left=e.start_s * scale,
          height=0.8,
          color="#ffdddd",
          edgecolor="#d62728",
          hatch="///",
          linewidth=0.5,
        )
      elif e.kind in COLLECTIVE_COLOURS:
        ax.barh(
          y[e.lane],
          width,
          left=e.start_s * scale,
          height=0.6,
          color=COLLECTIVE_COLOURS[e.kind],
          edgecolor="black",
          linewidth=0.3,
        )
      else:
        ax.barh(
          y[e.lane],
          width,
          left=e.start_s * scale,
          height=0.6,
          color="#ff9896" if e.kind == "gemm" else "#c7c7c7",
          linewidth=0,
        )
    ax.set_yticks(list(y.values()))
    ax.set_yticklabels(list(y.keys()))
    ax.set_xlabel("time (ms, estimated)")
    overlap = "n/a" if self.overlap_fraction is None else f"{self.overlap_fraction * 100:.0f}%"
    ax.set_title(
      title
      or f"{self.name} on {self.target}: step {self.step_time_s * 1e3:.2f} ms, exposed comm "
      f"{self.exposed_comm_s * 1e3:.2f} ms, overlap {overlap}"
    )
    from matplotlib.patches import Patch

    handles = [
      Patch(color="#ff9896", label="matmul"),
      Patch(color="#c7c7c7", label="other kernels"),
    ]
    handles += [
      Patch(color=c, label=k)
      for k, c in COLLECTIVE_COLOURS.items()
      if any(e.kind == k for e in self.events)
    ]
    handles.append(
      Patch(facecolor="#ffdddd", edgecolor="#d62728", hatch="///", label="exposed (waiting)")
    )
    ax.legend(
      handles=handles,
      loc="upper center",
      bbox_to_anchor=(0.5, -0.45),
      ncol=len(handles),
      fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pyplot():
  try:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise ImportError("plotting needs matplotlib: pip install 'jax_overlap[plot]'") from e
  return plt


@dataclasses.dataclass
class Comparison:
  """Several reports side by side."""

  names: list[str]
  reports: list[Report]

  def rows(self) -> list[dict[str, Any]]:
    base = self.reports[0].step_time_s if self.reports else 0.0
    out = []
    for n, r in zip(self.names, self.reports):
      d = r.summary()
      d["variant"] = n
      d["speedup_vs_first"] = base / r.step_time_s if r.step_time_s else None
      d["exposed_fraction"] = r.exposed_fraction
      out.append(d)
    return out

  def __str__(self) -> str:
    w = max([len(n) for n in self.names] + [7])
    header = (
      f"{'variant':<{w}}  {'step ms':>9} {'compute ms':>10} {'comm ms':>9} {'exposed ms':>10} "
      f"{'exposed %':>9} {'overlap %':>9} {'vs first':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in self.rows():
      exp = row["exposed_fraction"]
      ov = row["overlap_fraction"]
      lines.append(
        f"{row['variant']:<{w}}  {row['step_time_s'] * 1e3:>9.3f} {row['compute_time_s'] * 1e3:>10.3f} "
        f"{row['comm_time_s'] * 1e3:>9.3f} {row['exposed_comm_s'] * 1e3:>10.3f} "
        f"{'n/a' if exp is None else f'{exp * 100:.1f}':>9} {'n/a' if ov is None else f'{ov * 100:.1f}':>9} "
        f"{row['speedup_vs_first']:>7.3f}x"
      )
    return "\n".join(lines)

  def to_json(self, path: str | None = None) -> str:
    text = json.dumps(self.rows(), indent=1, default=str)
    if path:
      with open(path, "w") as f:
        f.write(text)
    return text

  def to_markdown(self) -> str:
    lines = [
      "| variant | step ms | compute ms | comm ms | exposed ms | exposed % | overlap % |",
      "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in self.rows():
      exp, ov = row["exposed_fraction"], row["overlap_fraction"]
      lines.append(
        f"| {row['variant']} | {row['step_time_s'] * 1e3:.3f} | {row['compute_time_s'] * 1e3:.3f} | "
        f"{row['comm_time_s'] * 1e3:.3f} | {row['exposed_comm_s'] * 1e3:.3f} | "
        f"{'n/a' if exp is None else f'{exp * 100:.1f}'} | {'n/a' if ov is None else f'{ov * 100:.1f}'} |"
      )
    return "\n".join(lines)


def compare(
  reports: Sequence[Report] | dict[str, Report], names: Sequence[str] | None = None
) -> Comparison:
  """Side-by-side table of several analyses of variants of one step.

  Args:
    reports: a list of reports, or a dict of name -> report.
    names: labels for a list of reports (default: each report's name).

  Raises:
    ValueError: for an empty input or a names list of the wrong length.
  """
  if isinstance(reports, dict):
    names, reports = list(reports.keys()), list(reports.values())
  reports = list(reports)
  if not reports:
    raise ValueError("compare: need at least one report")
  for r in reports:
    if not isinstance(r, Report):
      raise TypeError(f"compare: expected jax_overlap Reports, got {type(r).__name__}")
  if names is None:
    names = [r.name for r in reports]
  if len(names) != len(reports):
    raise ValueError(f"compare: {len(names)} names for {len(reports)} reports")
  return Comparison(list(names), reports)
