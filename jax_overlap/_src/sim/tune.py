"""Search of occupancy shaping and stream priority that minimises the simulated makespan.

Search space: communication priority on or off, times one shaping setting per *group*:
either per kernel (``groups="kernel"``) or per overlap window (``groups="window"``: the
compute kernels that may run beside one collective, windows sharing kernels merged). A
group's setting is "unshaped" or a blocks-per-SM cap ``r``; a kernel whose natural residency
is at most ``r`` is left alone. Only caps that change some kernel's residency are tried.

Method: exhaustive when the space has at most ``max_evals`` points, else coordinate descent
(start from the best of {unshaped, default shaping} x {priority off, on}; then, group by
group, try every setting of that group with the others fixed; repeat until a pass brings no
gain). Every evaluation is one simulation.

The result is a :class:`jax_overlap.runtime.Plan`, in the runtime library's JSON form::

  {"version": 1, "target": "h100",
   "kernels": [{"match": "<kernel name>", "blocks_per_sm": 1}, ...],
   "streams": {"priority": "highest" | "default"}}

(its ``streams.priority`` promotes the communication streams; :mod:`.plans` writes it
from the choice). On other than NVIDIA targets there is no plan (the runtime library
shapes CUDA launches only); the result's ``policy`` holds the choice.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Literal

from jax_overlap._src import deprecations
from jax_overlap._src.runtime import plan as plan_lib
from jax_overlap._src.runtime import residency
from jax_overlap._src.sim import engine, gemm, plans
from jax_overlap._src.sim.model import Constants, Kernel, Workload
from jax_overlap._src.sim.policies import (
  Policy,
  _constants,
  _launch,
  comm_blocks,
  default_shaping,
  no_room,
  shaping_choices,
  simulate,
)

__all__ = ["Evaluation", "TuneResult", "tune", "search_space"]


@dataclasses.dataclass(frozen=True)
class Evaluation(deprecations.ReadAsDict):
  """One simulation of the tuner's search.

  Attributes:
    priority: the communication streams at the highest priority.
    shaping: workload kernel name -> blocks-per-SM cap (empty: nothing shaped).
    makespan_s: the simulated makespan with that choice.
  """

  priority: bool
  shaping: Mapping[str, int]
  makespan_s: float

  _was_dict = "sim.TuneResult.table rows"


@dataclasses.dataclass(frozen=True)
class TuneResult:
  """What :func:`tune` found.

  Attributes:
    plan: the choice as a :class:`jax_overlap.runtime.Plan` (validated; ``.to_json(path)``
      writes the file ``jax-overlap launch --plan`` reads; ``runtime.check_plan`` checks its
      rules against a compiled step). None where the target is not an NVIDIA GPU: the
      runtime library shapes CUDA launches only, and :attr:`policy` holds the choice.
    policy: the same choice as a :class:`Policy` for ``sim.simulate``.
    makespan_s: predicted makespan with the plan.
    baseline_s: predicted makespan under the baseline policy (``baseline``).
    sequential_s: predicted makespan with everything on one stream.
    gain: ``1 - makespan_s / baseline_s``.
    baseline: the policy the gain is measured against: ``"priority"`` (XLA's own: its
      async collective streams are created at the highest priority,
      ``xla_gpu_enable_highest_priority_async_stream``, on by default) or
      ``"concurrent"`` (equal priority, for programs that do not run that way).
    pruned: shaping rules dropped because the plan without each gained less than
      ``min_rule_gain`` less (kernel name -> cap it had).
    gemm_sm_count_target: the SM-count target chosen for the persistent library GEMMs
      (the plan's ``library_gemms``; 0: none). Chosen only among ``tune``'s
      ``gemm_sm_targets``: by default those measured to be followed, none yet.
    evaluations: simulations run.
    method: "exhaustive" or "coordinate".
    table: one :class:`Evaluation` per simulation, in the order they ran.
    unnamed: kernels left unshaped because the driver name of their kernel is not
      known (library calls such as cuBLAS GEMMs): no plan rule could select them.
    no_room: kernels beside a collective that no cap can make room beside for one
      communication CTA, with the limits in the way (``"registers"``...): the tuner
      does not cap them, as the runtime library would leave them alone.
  """

  plan: plan_lib.Plan | None
  policy: Policy
  makespan_s: float
  baseline_s: float
  sequential_s: float
  gain: float
  evaluations: int
  method: str
  table: tuple[Evaluation, ...]
  unnamed: tuple[str, ...] = ()
  no_room: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  baseline: Literal["priority", "concurrent"] = "priority"
  pruned: Mapping[str, int] = dataclasses.field(default_factory=dict)
  gemm_sm_count_target: int = 0

  @property
  def runtime_plan(self) -> plan_lib.Plan | None:
    """Deprecated: :attr:`plan` is the :class:`jax_overlap.runtime.Plan` now."""
    deprecations.warn("sim.TuneResult.runtime_plan", "use TuneResult.plan (a runtime.Plan)")
    return self.plan

  def format_table(self, top: int = 10) -> str:
    rows = sorted(self.table, key=lambda r: r.makespan_s)[:top]
    out = [f"{'makespan (ms)':>14}  priority  shaping"]
    for r in rows:
      sh = ", ".join(f"{k}={v}" for k, v in sorted(r.shaping.items())) or "-"
      out.append(f"{r.makespan_s * 1e3:14.4f}  {str(r.priority):8}  {sh}")
    return "\n".join(out)


def _groups(wl: Workload, mode: str) -> list[list[str]]:
  """Groups of kernels that share one shaping setting.

  Kernels a plan cannot name are left out. Kernels that launch under one name
  (one function: deduplicated fusions, loop iterations) are one group's, since
  the runtime library can only give a function one setting.
  """
  kinds = {it.name: it for it in wl.items}
  windows = [
    [n for n in names if isinstance(kinds[n], Kernel) and plans.launch_name(kinds[n])]
    for names in wl.overlap_windows().values()
  ]
  windows = [w for w in windows if w]
  if mode == "kernel":
    seen: list[str] = []
    for w in windows:
      seen.extend(n for n in w if n not in seen)
    windows = [[n] for n in seen]
  elif mode != "window":
    raise ValueError(f"sim.tune: groups must be 'window' or 'kernel', got {mode!r}")
  by_launch: dict[str, list[str]] = {}
  for it in wl.items:
    if isinstance(it, Kernel) and plans.launch_name(it):
      by_launch.setdefault(plans.launch_name(it), []).append(it.name)
  merged: list[set[str]] = []
  for w in windows:
    s = set(w)
    for n in w:
      s |= set(by_launch[plans.launch_name(kinds[n])])
    for m in [m for m in merged if m & s]:
      s |= m
      merged.remove(m)
    merged.append(s)
  order = {it.name: i for i, it in enumerate(wl.items)}
  return [sorted(m, key=order.__getitem__) for m in merged]


def search_space(
  wl: Workload, target, groups: str = "window", constants=None, make_room: bool = True
):
  """(groups, per-group settings, per-kernel choices) that :func:`tune` searches.

  A kernel's choices are its own residency and the caps below it that change it. With
  ``make_room`` only caps that leave room for the communication CTA of every collective
  the kernel overlaps (``residency.room_cap``, the runtime library's rule) are kept: a cap the
  library would lower or ignore is not searched.
  """
  topo = engine.resolve_target(target)
  const = _constants(constants, topo)
  gs = _groups(wl, groups)
  blocks = comm_blocks(wl, const)
  choices = {}
  for g in gs:
    for n in g:
      nat, *below = shaping_choices(wl, topo, n)
      threads, regs, smem = _launch(wl.item(n), topo.gpu)
      room = [
        r
        for r in below
        if not make_room
        or all(
          residency.room_cap(topo.gpu, cb, threads, max(int(regs), 1), int(smem), 0, r)[0] == r
          for cb in blocks.get(n, ())
        )
      ]
      choices[n] = [nat, *room]
  settings = []
  for g in gs:
    vals = sorted({r for n in g for r in choices[n][1:]})  # caps below natural
    settings.append([None, *vals])
  return gs, settings, choices


def _shaping_for(gs, setting, choices) -> dict[str, int]:
  out = {}
  for g, r in zip(gs, setting):
    if r is None:
      continue
    for n in g:
      if r in choices[n][1:]:
        out[n] = r
  return out


class _Progress:
  def __init__(self, total: int | None, enabled: bool | None, desc: str):
    tty = getattr(sys.stderr, "isatty", lambda: False)()
    self.on = tty if enabled is None else bool(enabled)
    self.bar = None
    self.n = 0
    self.total = total
    self.t0 = time.monotonic()
    self.last = self.t0
    self.desc = desc
    if self.on:
      try:
        from tqdm.auto import tqdm  # type: ignore[import-not-found]

        self.bar = tqdm(total=total, desc=desc, leave=False)
      except ImportError:
        self.bar = None

  def update(self, best: float):
    self.n += 1
    if not self.on:
      return
    if self.bar is not None:
      self.bar.update(1)
      self.bar.set_postfix(best_ms=f"{best * 1e3:.3f}")
      return
    now = time.monotonic()
    if now - self.last >= 2.0:
      self.last = now
      tot = f"/{self.total}" if self.total else ""
      print(
        f"{self.desc}: {self.n}{tot} evaluations, best {best * 1e3:.4f} ms",
        file=sys.stderr,
        flush=True,
      )

  def close(self):
    if self.bar is not None:
      self.bar.close()
    self.on = False


def _priority_on(priority) -> bool:
  """``sim.tune(priority=)``: the runtime plan's spelling; the earlier bool warns."""
  if isinstance(priority, bool):
    deprecations.warn(
      "jax_overlap.sim.tune",
      f"priority={priority} is spelled priority={'highest' if priority else 'default'!r} now "
      "(as in a runtime plan's streams.priority)",
    )
    return priority
  if priority not in ("highest", "default"):
    raise ValueError(
      f"sim.tune: priority must be 'highest', 'default' or None (search both), got {priority!r}"
    )
  return priority == "highest"


@deprecations.keyword_only("target", api="jax_overlap.sim.tune")
def tune(
  workload: Workload,
  *,
  target="h100x8",
  groups: Literal["window", "kernel"] = "window",
  method: Literal["auto", "exhaustive", "coordinate"] = "auto",
  max_evals: int = 256,
  priority: Literal["highest", "default"] | None = None,
  min_gain: float = 0.002,
  constants: Constants | Mapping[str, float] | None = None,
  progress: bool | None = None,
  make_room: bool = True,
  baseline: Literal["priority", "concurrent"] = "priority",
  min_rule_gain: float = 0.005,
  gemm_sm_targets: Sequence[int] | None = None,
) -> TuneResult:
  """Chooses shaping and priority for ``workload`` on ``target`` by simulation.

  Args:
    workload: the step to tune.
    target: topology or GPU name.
    groups: "window" (one setting per group of kernels overlapping a collective) or
      "kernel" (one per kernel).
    method: "auto" (exhaustive if the space fits ``max_evals``), "exhaustive" or
      "coordinate".
    max_evals: the largest space searched exhaustively under "auto".
    priority: fix the communication streams' priority, spelled as in a runtime plan's
      ``streams.priority``: ``"highest"`` or ``"default"``; None searches both.
      (``True``/``False`` still work for one release and warn.)
    min_gain: a plan that beats the baseline by less than this fraction is not worth
      turning the controls on for; the baseline's plan is returned instead.
    constants: model constants or overrides.
    progress: show progress (tqdm if installed, else a line every 2 s); None: only when
      stderr is a terminal.
    make_room: search only caps that leave room for a communication CTA beside the
      capped blocks (the runtime library's default rule; the plan states the CTA as its
      ``comm_block``). False also searches caps that cannot make room, such as one
      block per SM beside an NCCL channel that needs a whole register file: with
      priority, an SM that holds one block empties when it finishes and a waiting
      channel lands there ("drain"); such a plan has ``"comm_block": null`` so that the
      library applies its caps as written.
    baseline: ``"priority"`` (default: what XLA already does, its collective streams at
      the highest priority) or ``"concurrent"`` (equal priority).
    min_rule_gain: a shaping rule stays in the plan only if the plan without it is at
      least this fraction slower; the others are dropped (``TuneResult.pruned``).
    gemm_sm_targets: SM-count targets for the persistent library GEMMs (a plan's
      ``library_gemms``) tried on top of the chosen priority and shaping; one is kept where
      it gains ``min_gain`` more. None: :func:`sim.gemm.sm_count_targets`, those of GPUs
      where cuBLAS was measured to follow a target (none yet); given explicitly, the
      result assumes cuBLAS follows them (``TuneResult.gemm_sm_count_target``).

  Returns:
    A :class:`TuneResult` with the plan and its predicted gain over plain concurrency.

  Raises:
    ValueError: bad ``groups``/``method``, or anything :func:`sim.simulate` rejects.

  Example:
    >>> from jax_overlap import sim
    >>> wl = sim.synthetic([(4096, 4096, 4096)] * 2, [("all-gather", 64 << 20)])
    >>> res = sim.tune(wl, target="a100x8", progress=False)
    >>> res.plan.streams.priority in ("highest", "default")
    True
  """
  if not isinstance(workload, Workload):
    hint = (
      "; a jax_overlap.analyze Report becomes one with sim.workload_from_report(report)"
      if hasattr(workload, "kernels") and hasattr(workload, "collectives")
      else ""
    )
    raise TypeError(
      f"sim.tune: workload must be a sim.Workload, got {type(workload).__name__}{hint}"
    )
  if baseline not in ("priority", "concurrent"):
    raise ValueError(f"sim.tune: baseline must be 'priority' or 'concurrent', got {baseline!r}")
  if method not in ("auto", "exhaustive", "coordinate"):
    raise ValueError(
      f"sim.tune: method must be 'auto', 'exhaustive' or 'coordinate', got {method!r}"
    )
  topo = engine.resolve_target(target)
  const = _constants(constants, topo)
  gs, settings, choices = search_space(workload, topo, groups, const, make_room)
  prios = [False, True] if priority is None else [_priority_on(priority)]
  size = len(prios)
  for s in settings:
    size *= len(s)
  if method == "auto":
    method = "exhaustive" if size <= max_evals else "coordinate"
  cache: dict = {}
  table: list[Evaluation] = []
  best = [float("inf")]
  bar = _Progress(size if method == "exhaustive" else None, progress, f"tune {topo.name}")

  def evaluate(prio: bool, setting: tuple) -> float:
    shaping = _shaping_for(gs, setting, choices)
    key = (prio, tuple(sorted(shaping.items())))
    if key not in cache:
      pol = Policy("tuned", priority=prio, shaping=shaping)
      t = simulate(workload, target=topo, policy=pol, constants=const, baseline=False).makespan_s
      cache[key] = t
      table.append(Evaluation(prio, shaping, t))
      best[0] = min(best[0], t)
      bar.update(best[0])
    return cache[key]

  try:
    if method == "exhaustive":
      cands = [(evaluate(p, s), p, s) for p in prios for s in itertools.product(*settings)]
      t_best, p_best, s_best = min(cands, key=lambda c: c[0])
    else:
      default = default_shaping(workload, target=topo, constants=const)
      start = tuple(min((default[n] for n in g if n in default), default=None) for g in gs)
      starts = [(p, s) for p in prios for s in {tuple([None] * len(gs)), start}]
      t_best, p_best, s_best = min(((evaluate(p, s), p, s) for p, s in starts), key=lambda c: c[0])
      improved = True
      passes = 0
      while improved and passes < 4:
        improved = False
        passes += 1
        for p in prios:
          t = evaluate(p, s_best)
          if t < t_best * (1 - 1e-12):
            t_best, p_best, improved = t, p, True
        for gi in range(len(gs)):
          for v in settings[gi]:
            s = s_best[:gi] + (v,) + s_best[gi + 1 :]
            t = evaluate(p_best, s)
            if t < t_best * (1 - 1e-12):
              t_best, s_best, improved = t, s, True
  finally:
    bar.close()
  # Keep a shaping rule only if the plan without it is at least min_rule_gain slower.
  pruned: dict[str, int] = {}
  s_best = list(s_best)
  for gi in range(len(gs)):
    if s_best[gi] is None:
      continue
    without = tuple(s_best[:gi] + [None] + s_best[gi + 1 :])
    t = evaluate(p_best, without)
    if t <= t_best * (1 + min_rule_gain):
      pruned.update({n: s_best[gi] for n in gs[gi] if s_best[gi] in choices[n][1:]})
      s_best, t_best = list(without), t
  shaping = _shaping_for(gs, tuple(s_best), choices)
  base = simulate(
    workload, target=topo, policy=baseline, constants=const, baseline=False
  ).makespan_s
  seq = simulate(
    workload, target=topo, policy="sequential", constants=const, baseline=False
  ).makespan_s
  if t_best > base * (1 - min_gain):  # not worth turning the controls on
    p_best, shaping = baseline == "priority" if priority is None else prios[0], {}
    t_best = simulate(
      workload,
      target=topo,
      policy=Policy("tuned", priority=p_best),
      constants=const,
      baseline=False,
    ).makespan_s
  # cuBLAS's SM-count target on the persistent library GEMMs, on top of the choice.
  sm_target = 0
  tried = gemm.sm_count_targets(topo.gpu) if gemm_sm_targets is None else gemm_sm_targets
  for n in tried:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= topo.gpu.sm_count:
      raise ValueError(
        f"sim.tune: gemm_sm_targets must be SM counts from 1 to {topo.gpu.sm_count} "
        f"({topo.gpu.name}), got {n!r}"
      )
    pol = Policy("tuned", priority=p_best, shaping=shaping, gemm_sm_count_target=n)
    t = simulate(workload, target=topo, policy=pol, constants=const, baseline=False).makespan_s
    if t < t_best * (1 - min_gain):
      t_best, sm_target = t, n
  blocks = {cb for bs in comm_blocks(workload, const).values() for cb in bs}
  comm = max(blocks, key=lambda cb: (cb.regs_per_thread * cb.threads, cb.smem_bytes), default=None)
  plan = None
  if topo.gpu.vendor == "nvidia":
    data = plans.plan_json("sim.tune", topo, shaping, p_best, workload, comm)
    if not make_room:
      data["comm_block"] = None
    if sm_target:
      data["library_gemms"] = {"sm_count_target": sm_target}
    plan = plan_lib.Plan.from_json(data)
  return TuneResult(
    plan=plan,
    policy=Policy("tuned", priority=p_best, shaping=shaping, gemm_sm_count_target=sm_target),
    makespan_s=t_best,
    baseline_s=base,
    sequential_s=seq,
    gain=1.0 - t_best / base,
    evaluations=len(cache),
    method=method,
    table=tuple(table),
    unnamed=plans.unnamed_kernels(workload),
    no_room=no_room(workload, target=topo, constants=const),
    baseline=baseline,
    pruned=pruned,
    gemm_sm_count_target=sm_target,
  )
