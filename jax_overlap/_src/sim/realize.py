"""Contention-aware step time of an analysed kernel sequence, under each policy.

The analysis Report lists a compiled step's kernels in schedule order and its collectives
with the positions where they are issued and awaited. Its own step-time estimate assumes
that whatever the schedule places side by side really runs side by side (each kernel at
its roofline time, each collective at its alpha-beta time on a free link). Here the same
sequence runs through the SM-level simulator, where collectives need resident CTAs and
share DRAM bandwidth with the kernels, under each policy. The gap between the two is what
tells a user whether the runtime controls are worth turning on.

One kernel-time model: every kernel and collective carries the analysis's own duration
(``time_s``: the roofline time less the launch gap the simulator adds between kernels of a
stream, and the alpha-beta time), and the simulator scales each one's block work so that,
alone on the device, it takes exactly that long (:func:`engine.work_scale`). The block
model only decides how that work is spread over blocks and SMs, so the two estimates differ
by what the analysis leaves out (residency, dispatch order, shared DRAM, link and SM
bandwidth, cross-stream event latency) and by nothing else: without contention
``ideal_s`` is the analysis's critical path.

Conversion (:func:`workload_from_report`):
  * kernels keep their order on stream 0. Library GEMMs (``KernelInfo.library``) are
    launched as the target's library launches them (persistent on Hopper, as the
    analysis's timeline assumes); XLA's own kernels are not persistent and keep the
    thread-block clusters of XLA's thunk listing. Kernels with ``gemm_mnk`` (GEMMs and fusions
    containing a dot) are rebuilt by shape (:meth:`Kernel.gemm`), keeping the report's
    bytes: a deviceless compile cannot autotune, so its GEMM launch configurations are
    defaults, not what runs on hardware. Other kernels keep the report's grid, threads (256 when unknown), shared
    memory and registers (32 when unknown), flops and bytes; convolutions count as
    tensor-core ("custom") kernels;
  * a kernel with an empty grid (a memcpy or a custom call without launch information) is
    modelled as one 32-thread block carrying its bytes and flops;
  * asynchronous collectives go on stream 1 in issue order; each waits (event) for the
    kernel before its ``start_index`` and the kernel at ``done_index`` waits for it;
    synchronous collectives run on stream 0 in place.

The analysis estimate (when the report has no ``step_time_s``) is the critical path of the
same sequence with the report's ``time_s`` values (:func:`critical_path`: kernels back to
back, collectives one after another on their stream, each item starting when what it waits
for is done). The same critical path with the simulator's isolated times (``ideal_s``:
each kernel alone plus the launch gap, each collective alone) checks the conversion: it
must equal the analysis up to the analysis's own placement rules.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jax_overlap._src import targets
from jax_overlap._src.sim import collectives, engine
from jax_overlap._src.sim.critical_path import critical_path, persistent_kernels
from jax_overlap._src.sim.model import (
  COLLECTIVE_KINDS,
  COMPUTE_KINDS,
  Collective,
  Constants,
  Kernel,
  Workload,
)
from jax_overlap._src.sim.policies import POLICIES, Policy, _constants, get_policy, simulate

__all__ = [
  "workload_from_report",
  "analysis_step_time",
  "critical_path",
  "realize",
  "RealizeResult",
  "ContentionLosses",
]


def _attr(obj, name: str, where: str):
  if not hasattr(obj, name):
    raise TypeError(f"sim.workload_from_report: {where} has no attribute {name!r}")
  return getattr(obj, name)


def _kernel_names(kernels) -> list[str]:
  names, seen = [], {}
  for k in kernels:
    n = str(_attr(k, "name", "a report kernel"))
    if n in seen:
      n = f"{n}#{_attr(k, 'index', 'a report kernel')}"
    seen[n] = True
    names.append(n)
  return names


def workload_from_report(
  report, *, channels: int | None = None, constants: Constants | dict | None = None
) -> Workload:
  """The simulator workload of an analysis Report's kernel sequence (see module docstring).

  Args:
    report: an object with ``target``, ``kernels`` and ``collectives`` (the analysis
      Report's interface).
    channels: override the communication CTAs per collective; each collective's
      ``time_s`` is rescaled from the default count's by the channel model's ratio.
    constants: the simulator constants the workload will run under (their
      ``launch_overhead_s`` is taken out of each kernel's analysis time, since the
      simulator adds it between kernels); default: the target's.

  Returns:
    A :class:`Workload` on stream 0 (compute, synchronous collectives) and 1
    (asynchronous collectives).

  Raises:
    ValueError: naming the kernel or collective with a bad field (negative sizes,
      unknown kinds, done before start, indices out of range).
    TypeError: when the report lacks a field.
  """
  return _convert(report, channels, constants)[0]


def _convert(report, channels, constants=None):
  kernels = list(_attr(report, "kernels", "report"))
  colls = list(_attr(report, "collectives", "report"))
  const = _constants(constants, target_of(report))
  launch = const.launch_overhead_s
  n = len(kernels)
  if n == 0 and not colls:
    raise ValueError("sim.workload_from_report: the report has no kernels and no collectives")
  names = _kernel_names(kernels)
  times = {nm: float(getattr(k, "time_s", 0.0) or 0.0) for nm, k in zip(names, kernels)}
  waits: list[list[str]] = [[] for _ in range(n + 1)]
  issued: list[list] = [[] for _ in range(n + 1)]
  cnames = set()
  for j, c in enumerate(colls):
    where = f"report.collectives[{j}] ({getattr(c, 'name', '?')!r})"
    kind = _attr(c, "kind", where)
    if kind not in COLLECTIVE_KINDS:
      raise ValueError(
        f"sim.workload_from_report: {where}.kind must be one of {COLLECTIVE_KINDS}, got {kind!r}"
      )
    s, d = int(_attr(c, "start_index", where)), int(_attr(c, "done_index", where))
    if not 0 <= s <= n or not 0 <= d <= n:
      raise ValueError(
        f"sim.workload_from_report: {where}: start_index {s} and done_index {d} must be in [0, {n}]"
      )
    if d < s:
      raise ValueError(
        f"sim.workload_from_report: {where}: done_index {d} is before start_index {s}"
      )
    nbytes = float(_attr(c, "bytes", where))
    if nbytes < 0:
      raise ValueError(f"sim.workload_from_report: {where}.bytes must be >= 0, got {nbytes}")
    cname = str(c.name)
    while cname in cnames or cname in names:
      cname += "'"
    cnames.add(cname)
    sync = bool(getattr(c, "synchronous", False))
    after = (names[s - 1],) if (s > 0 and not sync) else ()
    coll = Collective(
      cname,
      kind,
      nbytes,
      group_size=int(_attr(c, "group_size", where)),
      stream=0 if sync else 1,
      after=after,
      time_s=_positive(getattr(c, "time_s", None)),
    )
    if channels is not None:
      coll = _with_channels(coll, channels, target_of(report), const)
    issued[s].append(coll)
    times[cname] = float(getattr(c, "time_s", 0.0) or 0.0)
    if not sync and d < n:
      waits[d].append(cname)
  items: list = []
  for i, k in enumerate(kernels):
    items.extend(issued[i])
    items.append(_kernel(k, names[i], tuple(waits[i]), launch))
  items.extend(issued[n])
  return Workload(tuple(items), name=str(getattr(report, "name", "report"))), times


def _with_channels(c: Collective, channels: int, topo, const: Constants) -> Collective:
  """``c`` run on ``channels`` CTAs. Its ``time_s`` (the analysis' time at NCCL's default
  channel count) scales by the channel model's ratio of the two counts' times alone on the
  device: fewer channels take fewer SMs and, below the link's rate, move data slower
  (``min(link, cta_copy_bandwidth x channels)``, :mod:`.collectives`)."""
  shaped = dataclasses.replace(c, channels=channels)
  if c.time_s is None:
    return shaped
  before = collectives.alone_time(c, topo, const)
  if before <= 0:
    return shaped
  after = collectives.alone_time(shaped, topo, const)
  return dataclasses.replace(shaped, time_s=c.time_s * after / before)


def with_channels(wl: Workload, channels: int, topo, const: Constants) -> Workload:
  """``wl`` with each collective on at most ``channels`` CTAs (``NCCL_MAX_CTAS``), its
  ``time_s`` rescaled as :func:`workload_from_report`'s ``channels`` does."""
  items = tuple(
    _with_channels(it, min(channels, it.channels or const.channels), topo, const)
    if isinstance(it, Collective)
    else it
    for it in wl.items
  )
  return Workload(items, wl.name)


# The duration a kernel is given when the analysis has it take no longer than the launch
# gap (a block must take some time).
_MIN_BODY_S = 1e-9


def _positive(t) -> float | None:
  return float(t) if t is not None and float(t) > 0 else None


def _kernel(k, name: str, after: tuple[str, ...], launch_s: float) -> Kernel:
  where = f"report kernel {name!r}"
  t = getattr(k, "time_s", None)
  time_s = max(float(t) - launch_s, _MIN_BODY_S) if t is not None else None
  raw_kind = kind = str(_attr(k, "kind", where))
  if kind not in COMPUTE_KINDS:
    kind = "other"
  for f in ("grid_blocks", "threads_per_block", "smem_bytes", "flops", "bytes_accessed"):
    v = _attr(k, f, where)
    if v is not None and v < 0:
      raise ValueError(f"sim.workload_from_report: {where}: {f} must be >= 0, got {v}")
  dtype = str(getattr(k, "dtype", "bf16") or "bf16")
  mnk = getattr(k, "gemm_mnk", None)
  flops = float(_attr(k, "flops", where) or 0.0)
  nbytes = float(_attr(k, "bytes_accessed", where) or 0.0)
  launch_name = str(getattr(k, "launch_name", "") or "")
  # A library GEMM is launched as the target's library launches it (persistent and in
  # clusters on Hopper); a kernel XLA emitted as its thunk listing says.
  library = bool(getattr(k, "library", False))
  persistent = None if library else False
  cluster = None if library else int(getattr(k, "cluster", 1) or 1)
  if mnk:
    # Any kernel with a dot (a Triton GEMM fusion, a cuBLAS call): rebuilt by shape.
    gemm = Kernel.gemm(name, *(int(x) for x in mnk), dtype=dtype, after=after)
    # The report's DRAM bytes (one kernel-time model), the simulator's tiling.
    return dataclasses.replace(
      gemm,
      launch_name=launch_name,
      time_s=time_s,
      bytes=nbytes or gemm.bytes,
      persistent=persistent,
      cluster=cluster,
    )
  if raw_kind == "convolution":
    kind = "custom"  # tensor-core kernel with its own launch configuration
  grid = int(_attr(k, "grid_blocks", where))
  threads = int(_attr(k, "threads_per_block", where))
  if grid == 0:
    # Unknown launch configuration: XLA's loop-fusion default (128 threads, each
    # thread moving a few 16-byte vectors), sized by the bytes the kernel moves.
    threads = 128
    grid = max(1, math.ceil(nbytes / (threads * 64)))
  elif threads == 0:
    threads = 256  # unknown: XLA's usual block size for loop fusions
  regs = getattr(k, "regs_per_thread", None) or 32
  return Kernel(
    name,
    grid=grid,
    threads=threads,
    regs=int(regs),
    smem=int(_attr(k, "smem_bytes", where) or 0),
    flops=flops,
    bytes=nbytes,
    after=after,
    kind=kind,
    dtype=dtype,
    launch_name=launch_name,
    time_s=time_s,
    persistent=persistent,
    cluster=cluster,
  )


def analysis_step_time(report) -> float:
  """The report's contention-free step time: its ``step_time_s`` if it has one, else the
  critical path of its sequence with its own ``time_s`` values."""
  st = getattr(report, "step_time_s", None)
  if st is not None:
    return float(st)
  wl, times = _convert(report, None)
  return critical_path(wl, times, persistent_kernels(wl, target_of(report)))


def ideal_durations(wl: Workload, result, topo, const: Constants) -> dict[str, float]:
  """Each item's contention-free duration in the simulator: a kernel alone plus the launch
  gap before it, a collective alone (no event latency)."""
  iso = {k: v + const.launch_overhead_s for k, v in dict(result.isolated_s).items()}
  for c in wl.collectives:
    alone = dataclasses.replace(c, name="c", stream=0, after=())
    iso[c.name] = (
      engine.run(Workload((alone,), "alone"), topo, constants=const, baseline=False)
      .timings[0]
      .duration_s
    )
  return iso


# How XLA runs a JAX program by default: its async collective streams at the highest
# priority (xla_gpu_enable_highest_priority_async_stream, on by default), no shaping.
XLA_POLICY = "priority"


@dataclasses.dataclass(frozen=True)
class ContentionLosses:
  """Where one simulated step spends time its items would not spend alone.

  Each field is a sum over items, in seconds. The items run side by side, so the sums
  overlap in time and do not add up to the step's difference from ``ideal_s``; they say
  which resource the step waits for.

  Attributes:
    compute_slowdown_s: compute kernels' time beyond their time alone (SMs and DRAM
      shared with collectives and other kernels).
    collective_wait_s: time collectives were ready to run with none of their CTAs
      resident (no SM had room: the kernels beside them held it).
    collective_stretch_s: collectives' time, from their first CTA placed to their last
      finished, beyond their time alone (CTAs placed late, DRAM and link shared).
    collective_alone_s: the collectives' time alone, for scale.
    collectives: how many collectives the step has.
  """

  compute_slowdown_s: float
  collective_wait_s: float
  collective_stretch_s: float
  collective_alone_s: float
  collectives: int

  def __str__(self) -> str:
    return (
      f"compute slowed {self.compute_slowdown_s * 1e3:.3f} ms; {self.collectives} "
      f"collectives ({self.collective_alone_s * 1e3:.3f} ms alone) waited "
      f"{self.collective_wait_s * 1e3:.3f} ms for SMs and ran "
      f"{self.collective_stretch_s * 1e3:.3f} ms longer than alone"
    )


@dataclasses.dataclass
class RealizeResult:
  """Analysis estimate vs simulated step time under each policy.

  Attributes:
    analysis_s: the report's contention-free step time.
    ideal_s: the same critical path with the simulator's isolated kernel and collective
      times (no contention); ``makespan / ideal_s - 1`` is the cost of contention alone,
      without the difference between the report's roofline and the simulator's kernels.
    results: policy name -> SimResult.
    workload: the simulated workload.
    alone_s: each item's contention-free duration in the simulator (a kernel alone plus
      the launch gap before it, a collective alone).
  """

  analysis_s: float
  ideal_s: float
  results: dict
  workload: Workload
  alone_s: dict = dataclasses.field(default_factory=dict)

  def losses(self, policy: str = XLA_POLICY) -> ContentionLosses:
    """Where ``policy``'s step loses time to contention (see :class:`ContentionLosses`).

    Raises:
      KeyError: if ``policy`` was not simulated.
    """
    r = self._simulated("losses", policy)
    iso = r.isolated_s or {}
    compute = sum(
      max(t.duration_s - iso[t.name], 0.0)
      for t in r.timings
      if not t.is_collective and t.name in iso
    )
    colls = [t for t in r.timings if t.is_collective]
    alone = [self.alone_s.get(t.name, t.duration_s) for t in colls]
    return ContentionLosses(
      compute_slowdown_s=compute,
      collective_wait_s=sum(max(t.start_s - t.ready_s, 0.0) for t in colls),
      collective_stretch_s=sum(max(t.duration_s - a, 0.0) for t, a in zip(colls, alone)),
      collective_alone_s=sum(alone),
      collectives=len(colls),
    )

  def contention(self, policy: str = "concurrent") -> float:
    """Simulated over contention-free (simulator's own isolated times) step time, minus one.

    Raises:
      KeyError: if ``policy`` was not simulated.
    """
    return self._simulated("contention", policy).makespan_s / self.ideal_s - 1.0

  def gap(self, policy: str = "concurrent") -> float:
    """Simulated over analysis step time, minus one (how optimistic the analysis is).

    Raises:
      KeyError: if ``policy`` was not simulated.
    """
    return self._simulated("gap", policy).makespan_s / self.analysis_s - 1.0

  def _simulated(self, api: str, policy: str):
    """``policy``'s SimResult, or a KeyError naming the policies that were simulated."""
    if policy not in self.results:
      raise KeyError(
        f"RealizeResult.{api}: policy {policy!r} was not simulated; simulated: "
        f"{', '.join(self.results)}"
      )
    return self.results[policy]

  @property
  def best(self) -> str:
    return min(self.results, key=lambda p: self.results[p].makespan_s)

  def table(self) -> str:
    lines = [
      f"analysis (contention-free): {self.analysis_s * 1e3:.4f} ms",
      f"simulator, no contention:   {self.ideal_s * 1e3:.4f} ms",
    ]
    for p, r in self.results.items():
      mark = "  <- XLA's default" if p == XLA_POLICY else ""
      lines.append(
        f"{p:>18}: {r.makespan_s * 1e3:.4f} ms  ({self.gap(p):+.1%} vs analysis, "
        f"{self.contention(p):+.1%} over unlimited resources, compute slowdown "
        f"{r.compute_slowdown:.1%}){mark}"
      )
      if self.alone_s:
        lines.append(f"{'':>20}{self.losses(p)}")
    return "\n".join(lines)


def target_of(report) -> targets.Topology:
  """The report's topology: its ``topology`` object when it has one, else ``target``."""
  topo = getattr(report, "topology", None)
  if isinstance(topo, targets.Topology):
    return topo
  return engine.resolve_target(_attr(report, "target", "report"))


def realize(
  report,
  policy: str | Policy | Sequence[str | Policy] | None = None,
  *,
  constants: Constants | dict | None = None,
  channels: int | None = None,
):
  """Contention-aware step time of ``report``'s kernel sequence.

  Args:
    report: an analysis Report (``target``, ``kernels``, ``collectives``).
    policy: one policy (returns its SimResult inside a RealizeResult with one entry), a
      list of them, or None for all five.
    constants: model constants or overrides.
    channels: communication CTAs per collective (default: the target's), as
      ``NCCL_MIN_NCHANNELS``/``NCCL_MAX_NCHANNELS`` would set them. Each collective's
      analysis time is rescaled by the channel model: fewer channels take fewer SMs
      and move data at ``min(link, cta_copy_bandwidth x channels)``.

  Returns:
    A :class:`RealizeResult`.

  Example:
    >>> res = realize(report)  # doctest: +SKIP
    >>> print(res.table())     # doctest: +SKIP
  """
  topo = target_of(report)
  const = _constants(constants, topo)
  wl = workload_from_report(report, channels=channels, constants=const)
  if policy is None:
    pols = list(POLICIES)
  elif isinstance(policy, (str, Policy)):
    pols = [policy]
  else:
    pols = list(policy)
  results = {}
  for p in pols:
    pol = get_policy(p)
    results[pol.name] = simulate(wl, target=topo, policy=pol, constants=const)
  iso = ideal_durations(wl, next(iter(results.values())), topo, const)
  ideal = critical_path(wl, iso, persistent_kernels(wl, topo))
  return RealizeResult(analysis_step_time(report), ideal, results, wl, iso)
