"""Discrete-event simulation of a GPU's block dispatcher.

(Over 500 lines: this description of the model, and one event loop whose dispatch, rate
and completion steps share its state. What a simulation returns is in :mod:`.results`;
the dispatcher's state and each item compiled for the loop, in :mod:`.dispatch_state`.)

State: the SMs (CUs) of one device, each with its thread, register, shared-memory and
block limits (catalogue); kernels and collectives from a :class:`Workload` on streams with
priorities.

Dispatch (whenever resources free or a kernel becomes ready): pending kernels are visited
in order of (stream priority, higher first; then the time they became ready). Each places as
many of its remaining blocks as fit on the SMs' free resources, breadth first (one block per
SM, then a second, ...), as the hardware work distributor does. Dispatch is in order: while a
kernel still has blocks it could not place, no kernel after it places blocks on the SMs it
may use, even where they would fit (SMs kept for communication stay open to communication
kernels behind a waiting compute kernel). Running blocks are never preempted: priority only
orders dispatch. Measured on an H200 (``benchmarks/results/runtime_nvidia_h200_*``): an
NCCL-channel-sized copy launched after a many-wave kernel at equal priority starts only
when that kernel's last blocks are placed, also where a cap leaves room for it beside
every block; launched first, or at higher priority, it starts at once.

The items that wait for nothing become dispatchable one ``launch_overhead_s`` apart in
launch order (the host issues them one by one), so a kernel launched first has placed its
blocks before a collective launched after it on another stream arrives, whatever their
priorities. A kernel becomes dispatchable ``launch_overhead_s`` after its stream predecessor
completed, and ``event_latency_s`` after each item of another stream it waits for
(``after``, a CUDA event) completed. Cross-stream events resolve more
slowly than back-to-back launches on one stream, so the next compute kernel usually reaches
the dispatcher before a collective that waited on the previous one.

One hardware queue (``single_queue``, what ``CUDA_DEVICE_MAX_CONNECTIONS=1`` does): every
stream's items enter one queue in launch order, and an item reaches the dispatcher only when
it is ready and everything launched before it has reached it. An item waiting for its stream
predecessor or an event holds back everything launched after it, on any stream, and stream
priority decides nothing (the queue offers its grids in order). A collective launched before
a GEMM therefore reaches the SMs first even where both waited for the same kernel, and one
launched after a kernel starts only when that kernel's last blocks are placed. Measured on an
H200 (a copy behind an fp32 cuBLAS GEMM of 2.73 ms): 1.0 ms on its own queue at higher
priority, 2.9 ms with one queue.

Rates (processor sharing, recomputed whenever the set of resident blocks changes):
  * compute block of kernel k alone on a full SM: ``T0_k = block_overhead + max(F_b / (eff_k *
    R_sm), M_b / (sm_bandwidth_factor * B / n_sm))`` with ``R_sm = peak / n_sm`` (tensor peak
    of the dtype for "gemm" and "custom" kernels, FP32 peak otherwise), ``F_b`` and
    ``M_b`` the block's flops and DRAM bytes, ``B`` the device memory bandwidth;
  * a kernel needs ``sat_k = min(natural residency, ceil(saturating_threads / threads))``
    resident blocks to saturate an SM (1 for GEMM tiles). Block weight ``w_k = 1 / sat_k``; an
    SM with total compute weight ``W`` delivers the fraction ``min(1, W) ** gamma`` of its
    throughput (``gamma = occupancy_exponent``: latency hiding grows sub-linearly with
    resident warps), shared in proportion to ``w``: a block progresses at
    ``w_k / W * min(1, W) ** gamma / T0_k`` blocks per second. Shaping a kernel below
    ``sat_k`` therefore costs it throughput;
  * each communication CTA resident on an SM takes ``comm_sm_share`` of the SM's compute
    throughput (issue and load/store slots) from the compute blocks there, so a GEMM slows
    next to an all-gather even when DRAM is not the limit;
  * communication CTAs progress as in :mod:`.collectives`;
  * DRAM delivers ``memory_efficiency * B`` (the analysis's roofline figure). When the
    blocks' demands ``rate * M_b`` exceed it, it is shared max-min fairly: blocks asking less
    than the fair level keep their rate (a compute-bound block is not slowed by others'
    traffic), the others are throttled to that level. This is how memory-bound kernels and
    collectives slow each other.

Durations: an item with ``time_s`` (every item of a workload built from an analysis report)
has its block work scaled so that, alone on the device, it takes exactly ``time_s``
(:func:`work_scale`); the rules above then only redistribute that work.

Persistent kernels (cuBLAS's GEMMs on Hopper, :mod:`.gemm`) run as their tiles, and a
finished tile's slot takes the kernel's next tile on the same SM before anything is
dispatched, so no other kernel, of any priority, gets an SM the kernel holds until its tiles
run out; SMs it never got (held by a collective launched before it) it takes as they free,
in dispatch order. Measured on an H200: a copy launched behind cuBLAS's persistent GEMM
waited for the whole GEMM at the highest priority.

An SM-count target on library GEMMs (``gemm_sm_target``, what cuBLAS's
``cublasSetSmCountTarget`` asks for; whether cuBLAS's persistent grid follows it is not
measured yet) lets a persistent kernel hold at most that many SMs: its further tiles wait
for its own slots, and the SMs it leaves are open to everything else.

Blocks of one kernel placed on an SM at the same moment are given works spread by
``block_jitter`` (mean preserved), so they finish a little apart, as on hardware, where block
times vary by a few percent. Without it an SM holding several blocks of one kernel would
empty completely at every wave, which real SMs rarely do; with it an SM only drains at the
kernel's tail, or when it holds one block at a time (occupancy shaping).

Speed: identical SMs are kept as one *group* (same resident batches, same progress), so a
wave of a kernel over 132 SMs is one event, not 132 x blocks_per_sm. Groups split when
blocks land on part of them and merge again when their states coincide: empty groups at
every event, identical busy groups whenever there are more than ``_FULL_MERGE_ABOVE``.
Every loop iteration completes at least one batch of blocks or makes a kernel ready, so the
loop ends after at most (blocks + kernels) iterations; a guard raises if it ever would not.
While one kernel runs alone its waves repeat, and whole periods of them are skipped
(:mod:`.steady`).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import operator
from collections.abc import Mapping

import numpy as np

from jax_overlap._src import targets
from jax_overlap._src.analysis import cost_model
from jax_overlap._src.sim import steady
from jax_overlap._src.sim.dispatch_state import _Batch, _Compiled, _Group
from jax_overlap._src.sim.model import (
  Constants,
  Kernel,
  Workload,
  constants_for,
)
from jax_overlap._src.sim.results import KernelTiming, SimResult

__all__ = ["KernelTiming", "SimResult", "run", "resolve_target", "isolated_time", "work_scale"]

_EPS = 1e-9
_MEMORY_EFFICIENCY = cost_model.CostModel.memory_efficiency
_FULL_MERGE_ABOVE = 12  # groups; below this only empty groups are merged
_first = operator.itemgetter(0)
# Skip the repeated waves of a kernel running alone (:mod:`.steady`); off when the loop
# records occupancy or checks its invariants at every event.
_SKIP_PERIODS = True


def resolve_target(target) -> targets.Topology:
  """A Topology from a name ("h100", "h100x8"), a Gpu or a Topology, with a clear error."""
  if isinstance(target, (targets.Topology, targets.Gpu)):
    return targets.get(target)
  if not isinstance(target, str):
    raise TypeError(
      f"jax_overlap.sim: target must be a name such as 'h100x8', a Gpu or a Topology, got "
      f"{type(target).__name__}"
    )
  try:
    return targets.get(target)
  except ValueError as e:
    raise ValueError(f"jax_overlap.sim: target: {e}") from None


def run(
  wl: Workload,
  target,
  *,
  priorities: Mapping[int, int] | None = None,
  shaping: Mapping[str, object] | None = None,
  constants: Constants | None = None,
  policy_name: str = "custom",
  record: bool = False,
  check: bool = False,
  baseline: bool = True,
  reserved_sms: int = 0,
  single_queue: bool = False,
  gemm_sm_target: int = 0,
) -> SimResult:
  """Simulates ``wl`` on one device of ``target``.

  Args:
    wl: the workload.
    target: topology name, Gpu or Topology.
    priorities: stream -> priority (higher dispatches first); default all 0.
    shaping: kernel name -> blocks per SM (int) or {"blocks_per_sm": n} /
      {"padding_bytes": b}.
    constants: model constants (default: ``constants_for(target)``).
    policy_name: recorded in the result.
    record: record per-SM occupancy over time.
    check: verify invariants at every event (slow; for tests).
    baseline: compute each compute kernel's isolated duration (for compute_slowdown).
    reserved_sms: the last SMs of the device, on which no compute block is placed
      (communication blocks may use every SM); isolated durations stay on all SMs.
    single_queue: one hardware work queue for every stream (``CUDA_DEVICE_MAX_CONNECTIONS=1``;
      module docstring).
    gemm_sm_target: > 0: every persistent kernel (a library GEMM) holds at most this many
      SMs, as under cuBLAS's SM-count target (module docstring).

  Returns:
    A :class:`SimResult`.
  """
  if not isinstance(wl, Workload):
    raise TypeError(f"jax_overlap.sim: workload must be a sim.Workload, got {type(wl).__name__}")
  topo = resolve_target(target)
  if (
    not isinstance(reserved_sms, int)
    or isinstance(reserved_sms, bool)
    or not (0 <= reserved_sms < topo.gpu.sm_count)
  ):
    raise ValueError(
      f"jax_overlap.sim: reserved_sms must be an int in [0, {topo.gpu.sm_count}), got "
      f"{reserved_sms!r}"
    )
  const = constants if constants is not None else constants_for(topo.gpu)
  cp = _Compiled(wl, topo, const, dict(priorities or {}), shaping, _scales(topo, const))
  out = _loop(
    wl,
    topo,
    const,
    cp,
    record=record,
    check=check,
    reserved_sms=reserved_sms,
    single_queue=single_queue,
    gemm_sm_target=gemm_sm_target,
  )
  iso = None
  if baseline:
    iso = {
      it.name: isolated_time(_strip(it), topo, const) for it in wl.items if isinstance(it, Kernel)
    }
  timings, events, occ_t, occ, log = out
  makespan = max(t.end_s for t in timings)
  return SimResult(topo.name, policy_name, makespan, timings, events, occ_t, occ, iso, log)


def _strip(k: Kernel) -> Kernel:
  return dataclasses.replace(k, name="k", stream=0, after=())


def _scales(topo, const):
  """Each item's work factor (computed as the item is compiled, after its checks)."""

  def scale_of(i, it) -> float:
    return work_scale(it, topo, const) if it.time_s is not None else 1.0

  return scale_of


def _alone(item, topo: targets.Topology, const: Constants, scale: float) -> float:
  """First dispatch to last block of ``item`` alone on the device, its work times ``scale``."""
  wl = Workload((item,), name="alone")
  cp = _Compiled(wl, topo, const, {}, None, lambda i, it: scale)
  timing = _loop(wl, topo, const, cp, record=False, check=False)[0][0]
  return timing.end_s - timing.start_s


@functools.lru_cache(maxsize=8192)
def _work_scale(item, topo: targets.Topology, const: Constants) -> float:
  scale = 1.0
  for _ in range(6):
    ratio = item.time_s / _alone(item, topo, const, scale)
    scale *= ratio
    if abs(ratio - 1.0) < 1e-4:
      break
  return scale


@functools.lru_cache(maxsize=65536)
def work_scale(item, topo: targets.Topology, const: Constants) -> float:
  """The factor on ``item``'s per-block (per-channel) work that makes it take its
  ``time_s`` alone on the device (the fixed point of a few multiplicative corrections: the
  duration is proportional to the factor except where DRAM bandwidth caps it).

  One kernel-time model: durations come from whoever set ``time_s`` (the analysis's
  roofline and alpha-beta costs); the block model only says how the work is spread over
  blocks and SMs, so residency, priority, shaping and contention change it and nothing
  else does.
  """
  if item.time_s is None:
    return 1.0
  return _work_scale(dataclasses.replace(item, name="k", stream=0, after=()), topo, const)


@functools.lru_cache(maxsize=4096)
def isolated_time(kernel: Kernel, topo: targets.Topology, const: Constants) -> float:
  """Duration of one compute kernel alone on the device, unshaped (cached)."""
  wl = Workload((_strip(kernel),), name="isolated")
  cp = _Compiled(wl, topo, const, {}, None, _scales(topo, const))
  timings = _loop(wl, topo, const, cp, record=False, check=False)[0]
  return timings[0].end_s - timings[0].start_s


def _loop(
  wl,
  topo,
  const,
  cp: _Compiled,
  *,
  record: bool,
  check: bool,
  reserved_sms: int = 0,
  single_queue: bool = False,
  gemm_sm_target: int = 0,
):
  gpu = topo.gpu
  n_sm = gpu.sm_count
  THR, REG, SMEM, BLK = (
    gpu.max_threads_per_sm,
    gpu.regs_per_sm,
    gpu.smem_per_sm,
    gpu.max_blocks_per_sm,
  )
  # DRAM delivers what the analysis's roofline assumes (one kernel-time model).
  bw_total = gpu.memory_bandwidth * _MEMORY_EFFICIENCY
  n = len(wl.items)
  grid, thr, regs, smem = cp.grid, cp.thr, cp.regs, cp.smem
  t0, w, mem, comm = cp.t0, cp.w, cp.mem, cp.comm
  lat, chbytes, linkbw, ctabw, prio = cp.lat, cp.chbytes, cp.linkbw, cp.ctabw, cp.prio
  persistent = cp.persistent
  launch = const.launch_overhead_s
  jitter = const.block_jitter
  gamma = const.occupancy_exponent
  comm_share = const.comm_sm_share

  # Dependencies: the stream predecessor and every `after`.
  index = {it.name: i for i, it in enumerate(wl.items)}
  waits = [0] * n
  succ: list[list[int]] = [[] for _ in range(n)]
  last_on_stream: dict[int, int] = {}
  for i, it in enumerate(wl.items):
    deps = {index[a] for a in it.after}
    if it.stream in last_on_stream:
      deps.add(last_on_stream[it.stream])
    last_on_stream[it.stream] = i
    waits[i] = len(deps)
    for d in deps:
      succ[d].append(i)

  event_lat = const.event_latency_s
  # The host issues the items that wait for nothing one launch apart, in launch order.
  ready_at = [launch] * n
  first = [i for i in range(n) if waits[i] == 0]
  for j, i in enumerate(first):
    ready_at[i] = launch * (1 + j)
  heap: list[tuple[float, int]] = [(ready_at[i], i) for i in first]
  heapq.heapify(heap)
  ready = [math.nan] * n
  # SMs a persistent library GEMM may hold under an SM-count target (0: every SM).
  slots = [gemm_sm_target * cp.res[i] if gemm_sm_target and persistent[i] else 0 for i in range(n)]
  # One hardware queue (single_queue): items reach the dispatcher in launch order, each once
  # it is ready and everything launched before it has reached it.
  arrived = [False] * n
  head = 0
  start = [math.nan] * n
  end = [math.nan] * n
  remaining = list(grid)
  running = [0] * n
  pending: list[tuple[int, int, int]] = []  # (-priority, ready order, k)
  order = 0
  groups = [_Group(list(range(n_sm - reserved_sms)))]
  if reserved_sms:
    groups.append(_Group(list(range(n_sm - reserved_sms, n_sm)), reserved=True))
  done = 0
  t = 0.0
  events = 0
  max_events = 4 * (sum(grid) + n) + 1000
  occ_t: list[float] = []
  occ_rows: list[np.ndarray] = []
  log: list | None = [] if check else None
  periods = steady.Periods(comm) if _SKIP_PERIODS and not (check or record) else None

  def fit(g, k):
    if g.reserved and not comm[k]:
      return 0
    f = min((THR - g.thr) // thr[k], (REG - g.regs) // regs[k], BLK - g.blk)
    if smem[k]:
      f = min(f, (SMEM - g.smem) // smem[k])
    return f

  def add(g, k, cnt):
    g.thr += cnt * thr[k]
    g.regs += cnt * regs[k]
    g.smem += cnt * smem[k]
    g.blk += cnt
    if cnt == 1 or comm[k] or jitter == 0.0:
      g.batches.append(_Batch(k, cnt, 1.0, t))
    else:
      # Blocks placed together on one SM finish a little apart (see the module docstring).
      mid = (cnt - 1) / 2
      for j in range(cnt):
        g.batches.append(_Batch(k, 1, 1.0 + jitter * (j - mid) / cnt, t))

  def split(g, m):
    """Splits the first m SMs of g into a new group (a copy of g's state)."""
    ng = _Group(
      g.sms[:m],
      g.thr,
      g.regs,
      g.smem,
      g.blk,
      [_Batch(b.k, b.cnt, b.rem, b.t0) for b in g.batches],
      g.reserved,
    )
    g.sms = g.sms[m:]
    groups.append(ng)
    return ng

  def dispatch():
    nonlocal pending
    keep = []
    # In order: a kernel that keeps blocks it could not place closes the SMs it may use to
    # every kernel after it (see the module docstring).
    closed = closed_reserved = False
    for i, item in enumerate(pending):
      if closed and (closed_reserved or not reserved_sms):
        keep.extend(pending[i:])  # every SM closed: nothing behind can place a block
        break
      k = item[2]
      # A persistent library GEMM under an SM-count target holds at most that many SMs:
      # its blocks beyond them wait for its own slots, closing nothing behind it.
      beyond = max(0, remaining[k] - (slots[k] - running[k])) if slots[k] else 0
      r = remaining[k] - beyond
      if r <= 0 and beyond:
        keep.append(item)
        continue
      cands = []
      cap = 0
      for g in groups:
        if closed_reserved if g.reserved else closed:
          continue
        f = fit(g, k)
        if f > 0:
          cands.append((g, f))
          cap += len(g.sms) * f
      if cands:
        if math.isnan(start[k]):
          start[k] = t
        if r >= cap:
          for g, f in cands:
            add(g, k, f)
          r -= cap
        else:
          maxf = max(f for _, f in cands)
          level = 0
          used = 0
          while level < maxf:
            c = sum(len(g.sms) for g, f in cands if f > level)
            if used + c > r:
              break
            used += c
            level += 1
          left = r - used
          for g, f in cands:
            base = min(f, level)
            if f > level and left > 0:
              m = min(len(g.sms), left)
              left -= m
              if m < len(g.sms):
                ng = split(g, m)
                add(ng, k, base + 1)
                if base:
                  add(g, k, base)
              else:
                add(g, k, base + 1)
            elif base:
              add(g, k, base)
          r = 0
        running[k] += remaining[k] - beyond - r
        remaining[k] = r + beyond
      if r > 0:
        keep.append(item)
        closed = True
        closed_reserved = closed_reserved or comm[k]
      elif beyond:
        keep.append(item)
    pending = keep

  while done < n:
    events += 1
    if events > max_events:
      raise RuntimeError(
        f"jax_overlap.sim: the event loop did not terminate after {max_events} events "
        f"(workload {wl.name!r}); this is a bug in the simulator"
      )
    while heap and heap[0][0] <= t * (1 + 1e-12) + 1e-18:
      _, k = heapq.heappop(heap)
      if not single_queue:
        ready[k] = t
        pending.append((-prio[k], order, k))
        order += 1
        continue
      arrived[k] = True
      while head < n and arrived[head]:
        ready[head] = t
        pending.append((0, head, head))
        head += 1
    if pending:
      pending.sort()
      dispatch()
    if periods is not None:
      skip = periods.skip(
        groups, pending, remaining, running, t, events, heap[0][0] if heap else None
      )
      if skip is not None:
        k, dt_skip, blocks, skipped = skip
        t += dt_skip
        remaining[k] -= blocks
        events += skipped
        for g in groups:
          for b in g.batches:
            b.t0 += dt_skip
    if check:
      _check_state(groups, cp, gpu, pending, fit, lambda k: slots[k] and running[k] >= slots[k])
    if record:
      row = np.zeros(n_sm)
      for g in groups:
        row[g.sms] = max(g.thr / THR, g.regs / REG, g.smem / SMEM, g.blk / BLK)
      occ_t.append(t)
      occ_rows.append(row)
    # Rates.
    batches = [(g, b) for g in groups for b in g.batches]
    if not batches:
      if heap:
        t = max(t, heap[0][0])
        continue
      stuck = [wl.items[k].name for k in range(n) if math.isnan(end[k])]
      raise RuntimeError(
        f"jax_overlap.sim: nothing can run but {stuck[:5]} have not finished; this is a bug"
      )
    n_comm: dict[float, int] = {}
    for g, b in batches:
      if comm[b.k]:
        n_comm[linkbw[b.k]] = n_comm.get(linkbw[b.k], 0) + len(g.sms) * b.cnt
    demand = 0.0
    loaded = 0
    loads = []
    for g in groups:
      wsum = 0.0
      ncomm = 0
      for b in g.batches:
        if comm[b.k]:
          ncomm += b.cnt
        else:
          wsum += b.cnt * w[b.k]
      scale = 1.0 / wsum if wsum >= 1.0 else (wsum**gamma) / wsum if wsum > 0 else 1.0
      # Resident communication CTAs take issue and load/store slots from compute blocks.
      scale *= max(0.0, 1.0 - comm_share * ncomm)
      ng = len(g.sms)
      for b in g.batches:
        k = b.k
        if comm[k]:
          bw = min(ctabw[k], linkbw[k] / n_comm[linkbw[k]])
          b.rate = 1.0 / (lat[k] + chbytes[k] / bw)
        else:
          b.rate = w[k] * scale / t0[k]
        if mem[k] > 0.0 and b.rate > 0.0:
          d = b.rate * mem[k]
          c = ng * b.cnt
          demand += c * d
          loaded += c
          loads.append((d, c, b))
    if demand > bw_total:
      _share_dram(loads, loaded, bw_total)
    dt = math.inf
    finishing = None
    for _, b in batches:
      x = b.rem / b.rate
      if x < dt:
        dt, finishing = x, b
    if heap and heap[0][0] - t < dt:
      dt = max(heap[0][0] - t, 0.0)
      finishing = None
    t += dt
    freed = False
    refills = []
    for g, b in batches:
      b.rem -= b.rate * dt
      if b is finishing or b.rem <= _EPS:
        k = b.k
        g.batches.remove(b)
        g.thr -= b.cnt * thr[k]
        g.regs -= b.cnt * regs[k]
        g.smem -= b.cnt * smem[k]
        g.blk -= b.cnt
        freed = True
        nb = len(g.sms) * b.cnt
        running[k] -= nb
        if log is not None:
          log.append((k, nb, b.cnt, tuple(g.sms), b.t0, t))
        if persistent[k] and remaining[k] > 0:
          refills.append((g, k, b.cnt))
        elif running[k] == 0 and remaining[k] == 0:
          end[k] = t
          done += 1
          for s in succ[k]:
            waits[s] -= 1
            delay = launch if cp.stream[s] == cp.stream[k] else event_lat
            ready_at[s] = max(ready_at[s], t + delay)
            if waits[s] == 0:
              heapq.heappush(heap, (ready_at[s], s))
    # A persistent kernel's blocks that finished take its next blocks where they were,
    # before anything else is dispatched (every block state above is already advanced).
    for g, k, cnt in refills:
      left = min(remaining[k], len(g.sms) * cnt)
      level, extra = divmod(left, len(g.sms))
      if extra:
        add(split(g, extra), k, level + 1)
      if level:
        add(g, k, level)
      remaining[k] -= left
      running[k] += left
    if freed:
      _merge(groups)

  timings = [
    KernelTiming(
      name=it.name,
      kind=it.kind,
      stream=it.stream,
      priority=prio[i],
      ready_s=ready[i],
      start_s=start[i],
      end_s=end[i],
      blocks=grid[i],
      blocks_per_sm=cp.res[i],
      threads=thr[i],
      smem=cp.smem_user[i],
      is_collective=comm[i],
    )
    for i, it in enumerate(wl.items)
  ]
  occ_times = np.asarray(occ_t) if record else None
  occ = np.vstack(occ_rows) if record and occ_rows else None
  return timings, events, occ_times, occ, log


def _share_dram(loads: list, blocks: int, bw_total: float) -> None:
  """Max-min fair DRAM sharing: blocks that ask for less than the fair level keep their
  rate (compute-bound blocks are not slowed by memory traffic); the others are throttled to
  the level at which the total demand meets ``bw_total``. ``loads``: (bytes/s per block,
  blocks, batch); ``blocks``: their total."""
  loads.sort(key=_first)
  left = bw_total
  level = 0.0
  for d, c, _ in loads:
    if d * blocks <= left:
      left -= d * c
      blocks -= c
    else:
      level = left / blocks
      break
  else:
    return
  for d, _, b in loads:
    if d > level:
      b.rate *= level / d


def _merge(groups: list) -> None:
  """Merges groups whose states coincide (same batches, same progress).

  Empty groups are merged at every call; the full comparison runs only when there are many
  groups (it is an optimisation: identical groups evolve identically).
  """
  if len(groups) <= _FULL_MERGE_ABOVE:
    for reserved in (False, True):
      empty = [g for g in groups if not g.batches and g.reserved is reserved]
      if len(empty) > 1:
        for g in empty[1:]:
          empty[0].sms.extend(g.sms)
        groups[:] = [g for g in groups if g.batches or g.reserved is not reserved or g is empty[0]]
    return
  seen: dict = {}
  out = []
  for g in groups:
    key = (g.reserved, tuple(sorted([(b.k, b.cnt, int(b.rem * 1e9)) for b in g.batches])))
    h = seen.get(key)
    if h is None:
      seen[key] = g
      out.append(g)
    else:
      h.sms.extend(g.sms)
  if len(out) != len(groups):
    groups[:] = out


def _check_state(groups, cp, gpu, pending, fit, at_target) -> None:
  """Invariants (tests): resources within limits; in-order dispatch leaves nothing placeable
  (``at_target(k)``: a library GEMM holding every SM its SM-count target allows waits
  without closing anything)."""
  sms = []
  for g in groups:
    sms.extend(g.sms)
    thr = sum(b.cnt * cp.thr[b.k] for b in g.batches)
    regs = sum(b.cnt * cp.regs[b.k] for b in g.batches)
    smem = sum(b.cnt * cp.smem[b.k] for b in g.batches)
    blk = sum(b.cnt for b in g.batches)
    if (thr, regs, smem, blk) != (g.thr, g.regs, g.smem, g.blk):
      raise AssertionError("group bookkeeping out of sync")
    if (
      thr > gpu.max_threads_per_sm
      or regs > gpu.regs_per_sm
      or smem > gpu.smem_per_sm
      or blk > gpu.max_blocks_per_sm
    ):
      raise AssertionError(f"SM over a limit: threads={thr} regs={regs} smem={smem} blocks={blk}")
  if sorted(sms) != list(range(gpu.sm_count)):
    raise AssertionError("groups do not partition the SMs")
  # In order: each pending kernel fits nowhere that the kernels before it left open.
  closed = closed_reserved = False
  for _, _, k in pending:
    if at_target(k):
      continue
    for g in groups:
      if not (closed_reserved if g.reserved else closed) and fit(g, k) > 0:
        raise AssertionError(f"kernel {cp.names[k]} left pending although a block fits")
    closed = True
    closed_reserved = closed_reserved or cp.comm[k]
