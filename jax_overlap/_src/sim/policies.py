"""The five execution policies and the public ``simulate`` entry point.

  sequential        every item on one stream in launch order (no overlap at all);
  concurrent        streams as given, equal priority, no shaping (what plain async
                    collectives on a side stream do);
  priority          communication streams (those carrying collectives and no compute
                    kernel, as XLA's async collective streams) get the highest priority:
                    their pending blocks are dispatched first whenever resources free
                    (never preempting); a collective run synchronously on the compute
                    stream keeps that stream's default priority;
  shaping           compute kernels that run beside a collective are padded with shared
                    memory so that fewer of their blocks fit per SM (occupancy shaping);
  priority+shaping  both controls (Cui & Pericas, arXiv 2606.09200).

A :class:`Policy` can also keep SMs free of compute blocks (``reserve_sms``): what CUDA green
contexts, or a library's SM-count target, would do for the communication kernels. The runtime
library does not apply it; the simulator says what it would buy. And it can put every stream
in one hardware queue (``single_queue``): what ``CUDA_DEVICE_MAX_CONNECTIONS=1`` does.

Default shaping (when no per-kernel setting is given): each GEMM or custom kernel in a
collective's overlap window is capped at the largest blocks-per-SM ``r`` that still leaves
room for one communication CTA beside it on an SM, by the runtime library's rule
(``residency.room_cap``: threads, registers per sub-partition, shared memory, blocks). When no
``r >= 1`` does (an NCCL channel needs most of a register file and 82 KB of shared memory),
the kernel is left alone, as the runtime library leaves it, and listed in
:func:`no_room`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
from collections.abc import Mapping

from jax_overlap._src import deprecations, targets
from jax_overlap._src.sim import engine
from jax_overlap._src.sim.gemm import gemm_config
from jax_overlap._src.sim.model import (
  Collective,
  Constants,
  Workload,
  constants_for,
  shaped_smem,
)
from jax_overlap._src.sim.model import residency as _residency

__all__ = [
  "POLICIES",
  "Policy",
  "get_policy",
  "policy_from_plan",
  "simulate",
  "default_shaping",
  "no_room",
  "comm_block",
  "compare",
]

POLICIES = ("sequential", "concurrent", "priority", "shaping", "priority+shaping")
# Kinds the default shaping pads: GEMMs and fused custom kernels (attention). Memory-bound
# fusions need their occupancy for latency hiding and are left alone.
_SHAPED_KINDS = ("gemm", "custom")


@dataclasses.dataclass(frozen=True)
class Policy:
  """How a workload is executed.

  Attributes:
    name: label.
    sequential: run everything on one stream.
    priority: give communication streams the highest priority.
    shaping: True for the default shaping, or kernel name -> blocks per SM (int) or
      {"blocks_per_sm": n} / {"padding_bytes": b}; None or False for none.
    reserve_sms: SMs on which no compute block is placed, for the whole step
      (communication blocks may use every SM).
    single_queue: every stream's kernels in one hardware queue, in launch order
      (``CUDA_DEVICE_MAX_CONNECTIONS=1``; the engine's docstring says what it does); with
      it stream priority decides nothing.
    gemm_sm_count_target: > 0: every persistent library GEMM holds at most this many SMs,
      as a runtime plan's ``library_gemms.sm_count_target`` asks cuBLAS to (assumes cuBLAS
      follows it, which is not measured).
  """

  name: str
  sequential: bool = False
  priority: bool = False
  shaping: Mapping[str, object] | bool | None = None
  reserve_sms: int = 0
  single_queue: bool = False
  gemm_sm_count_target: int = 0

  def __post_init__(self):
    r = self.reserve_sms
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
      raise ValueError(
        f"jax_overlap.sim: Policy.reserve_sms must be an int >= 0 (SMs kept free of compute "
        f"blocks), got {r!r}"
      )
    g = self.gemm_sm_count_target
    if isinstance(g, bool) or not isinstance(g, int) or g < 0:
      raise ValueError(
        f"jax_overlap.sim: Policy.gemm_sm_count_target must be an int >= 0 (0: every SM), got {g!r}"
      )
    if not isinstance(self.single_queue, bool):
      raise ValueError(
        f"jax_overlap.sim: Policy.single_queue must be True or False (one hardware queue, "
        f"CUDA_DEVICE_MAX_CONNECTIONS=1), got {self.single_queue!r}"
      )

  def __hash__(self):
    s = self.shaping
    if isinstance(s, Mapping):
      s = tuple(sorted((k, str(v)) for k, v in s.items()))
    return hash(
      (
        self.name,
        self.sequential,
        self.priority,
        s,
        self.reserve_sms,
        self.single_queue,
        self.gemm_sm_count_target,
      )
    )


def get_policy(policy: str | Policy) -> Policy:
  """A :class:`Policy` from one of ``POLICIES`` or a Policy."""
  if isinstance(policy, Policy):
    return policy
  if not isinstance(policy, str):
    raise TypeError(f"jax_overlap.sim: policy must be a name or a sim.Policy, got {policy!r}")
  p = policy.strip().lower()
  if p == "sequential":
    return Policy(p, sequential=True)
  if p == "concurrent":
    return Policy(p)
  if p == "priority":
    return Policy(p, priority=True)
  if p == "shaping":
    return Policy(p, shaping=True)
  if p in ("priority+shaping", "shaping+priority", "both"):
    return Policy("priority+shaping", priority=True, shaping=True)
  raise ValueError(f"jax_overlap.sim: unknown policy {policy!r}; choose one of {POLICIES}")


def policy_from_plan(plan, wl: Workload) -> Policy:
  """The :class:`Policy` a runtime plan (dict, JSON text or ``Plan``) applies to ``wl``.

  Kernel rules select kernels by glob (``match``) or regular expression (``regex``); the
  first rule that matches a kernel wins, as in the runtime library.

  Raises:
    ValueError: for a rule that matches no kernel of the workload, or a malformed plan.
  """
  from jax_overlap._src.runtime import plan as plan_lib

  if isinstance(plan, str):
    plan = json.loads(plan)
  if isinstance(plan, Mapping):
    # Read as the runtime reads it (unknown keys and bad values refused); the version may
    # be left out of a plan written for the simulator.
    plan = plan_lib.Plan.from_json({"version": plan_lib.PLAN_VERSION, **plan})
  if not isinstance(plan, plan_lib.Plan):
    raise TypeError(
      f"jax_overlap.sim: a plan must be a runtime.Plan, a dict or JSON text, got "
      f"{type(plan).__name__}"
    )
  names = [it.name for it in wl.items if not isinstance(it, Collective)]
  shaping: dict[str, object] = {}
  for i, rule in enumerate(plan.kernels):
    if rule.match is not None:
      hits = [n for n in names if fnmatch.fnmatchcase(n, rule.match)]
    else:
      rx = re.compile(rule.regex)
      hits = [n for n in names if rx.search(n)]
    if not hits:
      raise ValueError(
        f"jax_overlap.sim: plan kernels[{i}] ({rule.pattern!r}) names no kernel of workload "
        f"{wl.name!r}"
      )
    spec = {k: getattr(rule, k) for k in ("blocks_per_sm", "padding_bytes") if getattr(rule, k)}
    for n in hits:
      shaping.setdefault(n, spec)
  prio = plan.streams.priority
  target = plan.library_gemms.sm_count_target if plan.library_gemms is not None else 0
  return Policy("plan", priority=prio == "highest", shaping=shaping, gemm_sm_count_target=target)


def _comm_streams(wl: Workload) -> set[int]:
  """Streams that carry collectives and no compute kernel. A collective XLA runs
  synchronously sits on the compute stream, which keeps its default priority."""
  compute = {it.stream for it in wl.items if not isinstance(it, Collective)}
  return {c.stream for c in wl.collectives} - compute


def shaping_choices(
  wl: Workload, target, kernel_name: str, constants: Constants | None = None
) -> list[int]:
  """Blocks-per-SM settings that change a kernel's residency, from natural down to 1."""
  topo = engine.resolve_target(target)
  k = wl.item(kernel_name)
  return _choices(k, topo.gpu)


def _choices(k, gpu) -> list[int]:
  threads, regs, smem = _launch(k, gpu)
  nat = _residency(gpu, threads, regs, smem)
  out = []
  for r in range(nat, 0, -1):
    if _residency(gpu, threads, regs, shaped_smem(gpu, smem, r)) == r:
      out.append(r)
  return out or [nat]


def _launch(k, gpu):
  if k.grid is None or k.threads is None:
    cfg = gemm_config(gpu, *k.gemm_mnk, k.dtype)
    return cfg.threads, cfg.regs, cfg.smem
  return k.threads, k.regs, k.smem


def comm_block(c: Collective, const: Constants):
  """The launch footprint of one CTA of collective ``c`` (a ``plan.CommBlock``)."""
  from jax_overlap._src.runtime import plan

  return plan.CommBlock(
    int(c.threads or const.comm_threads),
    int(c.regs or const.comm_regs),
    int(const.comm_smem if c.smem is None else c.smem),
  )


def comm_blocks(wl: Workload, const: Constants) -> dict[str, set]:
  """Kernel name -> communication blocks of the collectives whose window it is in."""
  by_name = {it.name: it for it in wl.items}
  out: dict[str, set] = {}
  for cname, names in wl.overlap_windows().items():
    c = by_name[cname]
    assert isinstance(c, Collective)
    for n in names:
      out.setdefault(n, set()).add(comm_block(c, const))
  return out


def _room(wl: Workload, target, constants: Constants | None):
  """(kernel -> cap with room, kernel -> limits when none) for kernels beside collectives."""
  from jax_overlap._src.runtime import residency

  topo = engine.resolve_target(target)
  gpu = topo.gpu
  const = constants or constants_for(gpu)
  caps: dict[str, int] = {}
  blocked: dict[str, tuple[str, ...]] = {}
  for name, blocks in comm_blocks(wl, const).items():
    k = wl.item(name)
    if k.kind not in _SHAPED_KINDS:
      continue
    threads, regs, smem = _launch(k, gpu)
    nat = _residency(gpu, threads, regs, smem)
    for cb in blocks:
      r, why = residency.room_cap(gpu, cb, threads, max(int(regs), 1), int(smem), 0, nat)
      if r == 0:
        blocked[name] = tuple(sorted(set(blocked.get(name, ())) | set(why)))
      else:
        caps[name] = min(caps.get(name, r), r)
  for name in blocked:
    caps.pop(name, None)
  return caps, blocked


@deprecations.keyword_only("target", "constants", api="jax_overlap.sim.default_shaping")
def default_shaping(wl: Workload, *, target, constants: Constants | None = None) -> dict[str, int]:
  """Default per-kernel blocks-per-SM for kernels in a collective's overlap window.

  Kernels for which no cap leaves room for a communication CTA are left out (see
  :func:`no_room`).
  """
  return _room(wl, target, constants)[0]


@deprecations.keyword_only("target", "constants", api="jax_overlap.sim.no_room")
def no_room(
  wl: Workload, *, target, constants: Constants | None = None
) -> dict[str, tuple[str, ...]]:
  """Kernels beside a collective that no cap can make room beside, with the limits in the way.

  Example:
    >>> from jax_overlap import sim
    >>> wl = sim.synthetic([(8192, 8192, 8192)], [("all-gather", 256 << 20)])
    >>> sim.no_room(wl, target="h100x8")
    {'gemm.0': ('registers', 'shared_memory')}
  """
  return _room(wl, target, constants)[1]


def apply(policy, wl: Workload, target, constants: Constants | None = None):
  """(workload, priorities, shaping) that realise ``policy`` for ``wl``."""
  pol = _resolve(policy, wl)
  topo = engine.resolve_target(target)
  if pol.sequential:
    items = tuple(dataclasses.replace(it, stream=0, after=()) for it in wl.items)
    return Workload(items, wl.name), {}, {}
  priorities = {s: 1 for s in _comm_streams(wl)} if pol.priority else {}
  if pol.shaping is True:
    shaping = default_shaping(wl, target=topo, constants=constants)
  elif isinstance(pol.shaping, Mapping):
    shaping = dict(pol.shaping)
  elif pol.shaping in (None, False):
    shaping = {}
  else:
    raise TypeError(
      f"jax_overlap.sim: Policy.shaping must be a dict or a bool, got {pol.shaping!r}"
    )
  return wl, priorities, shaping


@deprecations.keyword_only("target", "policy", api="jax_overlap.sim.simulate")
def simulate(
  workload: Workload,
  *,
  target: str | targets.Topology | targets.Gpu = "h100x8",
  policy: str | Policy | Mapping = "concurrent",
  constants: Constants | Mapping[str, float] | None = None,
  record: bool = False,
  check: bool = False,
  baseline: bool = True,
) -> engine.SimResult:
  """Simulates ``workload`` on one device of ``target`` under ``policy``.

  Args:
    workload: a :class:`~jax_overlap._src.sim.model.Workload`.
    target: topology name ("h100x8"), GPU name ("h100"), Gpu or Topology.
    policy: one of ``POLICIES``, a :class:`Policy`, or a runtime plan (dict, JSON text or
      ``Plan``, see :func:`policy_from_plan`).
    constants: model constants, or overrides of the target's defaults.
    record: keep per-SM occupancy over time (for plots).
    check: verify invariants at every event (tests).
    baseline: compute isolated kernel times (for ``compute_slowdown``).

  Returns:
    A SimResult with makespan, per-kernel timings and occupancy.

  Raises:
    ValueError: unknown target or policy, kernels that cannot fit, bad shaping.

  Example:
    >>> from jax_overlap import sim
    >>> wl = sim.synthetic([(4096, 4096, 4096)], [("all-gather", 64 << 20)])
    >>> r = sim.simulate(wl, target="h100x8", policy="priority+shaping")
    >>> r.makespan_s > 0
    True
  """
  topo = engine.resolve_target(target)
  const = _constants(constants, topo)
  pol = _resolve(policy, workload)  # a plan is read once
  wl2, prios, shaping = apply(pol, workload, topo, const)
  if pol.reserve_sms >= topo.gpu.sm_count:
    raise ValueError(
      f"jax_overlap.sim: Policy.reserve_sms={pol.reserve_sms} leaves no SM for compute on "
      f"{topo.gpu.name} ({topo.gpu.sm_count} SMs); reserve fewer"
    )
  return engine.run(
    wl2,
    topo,
    priorities=prios,
    shaping=shaping,
    constants=const,
    policy_name=pol.name,
    record=record,
    check=check,
    baseline=baseline,
    reserved_sms=pol.reserve_sms,
    single_queue=pol.single_queue,
    gemm_sm_target=min(pol.gemm_sm_count_target, topo.gpu.sm_count),
  )


def _resolve(policy, wl: Workload) -> Policy:
  if isinstance(policy, (str, Policy)):
    return get_policy(policy)
  return policy_from_plan(policy, wl)


def _constants(constants, topo) -> Constants:
  if constants is None:
    return constants_for(topo.gpu)
  if isinstance(constants, Constants):
    return constants
  if isinstance(constants, Mapping):
    return constants_for(topo.gpu, constants)
  raise TypeError(
    f"jax_overlap.sim: constants must be a sim.Constants or a dict, got {constants!r}"
  )


@deprecations.keyword_only("target", "policies", api="jax_overlap.sim.compare")
def compare(workload: Workload, *, target="h100x8", policies=POLICIES, **kwargs) -> dict:
  """Makespan of ``workload`` under each policy: {policy: SimResult}."""
  return {
    get_policy(p).name: simulate(workload, target=target, policy=p, **kwargs) for p in policies
  }
