"""The cost model's search among a selection's compiled variants.

A cheap first pass compiles one variant of each program (the step as written, rewritten,
its shard_map form, its loop bodies in batch parts...; GEMMs through Triton or cuBLAS; a
GSPMD step's shard_map form beside the step's first compile, :class:`Running`) and
recompiles the fastest of them with a latency profile at once, so that the rest are measured
against the best step a schedule has reached so far: a program whose compute alone is behind
it, or whose first variant is far behind it, is not compiled in its other variants. Then the
rest compile (a variant that combines two others' options only where each of them beat its
program's first variant), a few of the fastest again with a latency profile written from
their analysis (none far behind the best step; the first of them on threads the rest leave
idle), and the fastest by estimate is chosen. Variants that would compile the same program
with the same options are compiled once.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable

from jax_overlap._src.analysis import latency_profile
from jax_overlap._src.transform import combinations, compiles, explain, gspmd
from jax_overlap._src.transform.records import Candidate, Choice, Estimate

# Latency-profiled recompiles tried per step (the fastest variants by estimate).
PROFILED_VARIANTS = 3
PROFILED_SUFFIX = ", scheduled by the cost model's estimates"
# A program whose first variant's compute alone takes this many times the best step so far
# is not compiled in its other variants (options and orderings of the same operations,
# whose kernels differ little: the margin covers that).
BEHIND_FACTOR = 1.05
# A program whose first variant's step is this much behind the best step so far is not
# compiled in its other variants either (a heuristic: a bound on what they gain, not a
# proof): on the committed comparisons the options and orderings of one program, and a
# latency profile, gained at most 9.8% over its first variant (transform_fsdp.md, the GSPMD
# step's shard_map form on h100x8: 44.78 -> 40.41 ms).
FAR_BEHIND = 0.15


@dataclasses.dataclass(frozen=True)
class Running:
  """The first candidate's compile, running already (a GSPMD step's first compile, started
  while the step was converted), and the candidates its report adds right after it.

  Attributes:
    future: gives the first candidate's report (or raises as its compile did).
    more: ``more(report)``, the candidates the report adds (the step's compiler-option
      variants, found by compiling it).
  """

  future: concurrent.futures.Future
  more: Callable[[object], list[Candidate]]


def worth_profiling(
  times: list[float], reports: list, done: frozenset = frozenset(), most: int = PROFILED_VARIANTS
) -> list[int]:
  """The variants to recompile with a latency profile, at most ``most``, none of ``done``
  (those profiled already, or a profiled recompile themselves).

  A schedule can at best hide all of a variant's exposed communication: a variant whose
  compute alone takes longer than the best step so far cannot win and is not tried, nor
  one whose step is :data:`FAR_BEHIND` behind it (more than a latency profile gained on the
  committed comparisons).
  The fastest variant is tried first; the rest are those with the least compute (the
  most a better schedule can reach), skipping variants whose estimates equal one
  already picked (the same program compiled under options that changed nothing).
  """
  best = min(times, default=float("inf"))
  # Variants whose estimates equal one profiled already compile the same schedule again.
  seen = {(times[i], reports[i].compute_time_s) for i in done if times[i] < float("inf")}
  if most <= 0:
    return []
  finite = [
    i
    for i in range(len(times))
    if times[i] < float("inf")
    and i not in done
    and (times[i], reports[i].compute_time_s) not in seen
  ]
  if not finite:
    return []
  fastest = min(finite, key=lambda i: (times[i], i))
  rest = sorted(finite, key=lambda i: (reports[i].compute_time_s, times[i], i))
  picked = []
  for i in [fastest, *rest]:
    same = (times[i], reports[i].compute_time_s)
    if same in seen or reports[i].compute_time_s >= best or times[i] > (1 + FAR_BEHIND) * best:
      continue
    seen.add(same)
    picked.append(i)
    if len(picked) >= most:
      break
  return picked


def windowed_notes(candidates, reports) -> list[str]:
  """What XLA's windowed einsum decomposed, for each variant that asked for it, against the
  same program compiled as written (the first candidate)."""
  out = []
  for c, report in zip(candidates, reports):
    if (
      report is None
      or reports[0] is None
      or c.name.endswith(PROFILED_SUFFIX)
      or "xla_gpu_threshold_for_windowed_einsum_mib" not in c.options
    ):
      continue
    change = gspmd.decomposed(gspmd.found(reports[0]), gspmd.found(report))
    out.append(f"{c.name}: {change}")
  return out


def judged_notes(candidates, chosen: int, reports) -> list[str]:
  """Notes that judge the chosen variant a second time: the simulator's contention-aware
  estimate beside the analysis's, the same for the step as written where another variant
  was chosen (and a line saying so where the two models order them differently), and a
  mark where the analysis judged a schedule it wrote."""
  name, report = candidates[chosen].name, reports[chosen]
  if report is None:
    return []
  from jax_overlap._src.sim import realize as realize_lib

  def simulated(r):
    res = realize_lib.realize(r, realize_lib.XLA_POLICY)
    return res, res.results[realize_lib.XLA_POLICY].makespan_s

  out = []
  try:
    res, sim_s = simulated(report)
  except (ValueError, TypeError, RuntimeError) as e:
    return [f"chosen variant not simulated: {str(e).splitlines()[0][:200]}"]
  out.append(
    f"chosen variant judged twice: the analysis {report.step_time_s * 1e3:.3f} ms, "
    f"sim.realize (SM contention, XLA's stream priority) {sim_s * 1e3:.3f} ms"
  )
  base = _written_base(candidates, reports)
  if base is not None and not candidates[chosen].name.startswith("as written"):
    try:
      base_sim = simulated(reports[base])[1]
    except (ValueError, TypeError, RuntimeError):
      base_sim = None
    if base_sim is not None:
      w = reports[base]
      out.append(
        f"step as written ({candidates[base].name}) judged the same way: the analysis "
        f"{w.step_time_s * 1e3:.3f} ms, sim.realize {base_sim * 1e3:.3f} ms"
      )
      if base_sim < sim_s:
        losses = res.losses()
        out.append(
          "the two models disagree: the simulator estimates the step as written "
          f"{(sim_s - base_sim) * 1e3:.3f} ms faster than the chosen variant, whose "
          f"collectives wait {losses.collective_wait_s * 1e3:.2f} ms for SMs and run "
          f"{losses.collective_stretch_s * 1e3:.2f} ms beyond their time alone while its "
          f"kernels lose {losses.compute_slowdown_s * 1e3:.2f} ms to them; only a "
          "measurement on the GPUs settles which is right"
        )
  if name.endswith(PROFILED_SUFFIX):
    out.append(
      "self-judged: the chosen schedule came from a latency profile written by the same cost "
      "model that estimated it"
    )
  held = explain.held_notes([c.name for c in candidates], chosen, reports)
  return out + held + explain.environment_notes(report)


def select(
  settings,
  candidates: list[Candidate],
  make,
  args,
  kwargs,
  known=None,
  kernels=None,
  running: Running | None = None,
) -> tuple[Choice, list]:
  """The fastest candidate by the cost model (profiled recompiles appended) and the
  reports, by candidate (None where a variant did not compile); ``known``: reports already
  made, by candidate index; ``kernels``: the selection's shared kernel cache; ``running``:
  the first candidate's compile, running already (:class:`Running`): the first pass
  compiles the other programs' first variants beside it."""
  candidates, done = list(candidates), dict(known or {})
  failed: list[str] = []
  if running is None:
    candidates, done, failed = _unique(candidates, done)
  errors = (ValueError, RuntimeError, TypeError)
  profiling = (
    settings.schedule_from_estimates and latency_profile.OPTION not in settings.xla_options
  )

  learned: dict = {}  # the deviceless tiling fallback, once a variant needed it

  def compile_all(indices: list[int], busy=()) -> None:
    jobs = [candidates[i] for i in indices]
    reports = compiles.analyze_all(
      settings, jobs, make, args, kwargs, errors, kernels, learned, busy
    )
    for i, r in zip(indices, reports):
      done[i] = r

  def profiled_ones() -> frozenset:
    names = {c.name for c in candidates}
    return frozenset(
      i
      for i, c in enumerate(candidates)
      if c.name.endswith(PROFILED_SUFFIX) or c.name + PROFILED_SUFFIX in names
    )

  def so_far() -> tuple[list, list]:  # times and reports by candidate (inf, None: none)
    ok = {i: r for i, r in done.items() if r is not None and not isinstance(r, Exception)}
    times = [ok[i].step_time_s if i in ok else float("inf") for i in range(len(candidates))]
    return times, [ok.get(i) for i in range(len(candidates))]

  # A cheap first pass: the first variant of each program (the step as written, rewritten,
  # its shard_map form...; GEMMs through Triton or cuBLAS), the fastest of them again with a
  # latency profile, then the rest of the programs that can still win.
  if running is not None:
    # The first candidate compiles already: the other programs' first variants beside it
    # (a group's first is never a duplicate: those are left out once the rest are known),
    # then the variants its report adds, right after it.
    ask = threading.Thread(target=_spellings, args=(candidates,), daemon=True)
    ask.start()  # jaxlib asked how it spells the options meanwhile
    added: concurrent.futures.Future = concurrent.futures.Future()

    def add(f):  # the variants its report adds, found as soon as it is in
      try:
        added.set_result(running.more(f.result()))
      except Exception as e:  # noqa: BLE001 - raised below, where the selection waits
        added.set_exception(e)

    running.future.add_done_callback(add)
    firsts = [g[0] for g in _groups(candidates).values() if 0 not in g]
    compile_all([i for i in firsts if i not in done], busy=(running.future,))
    report = running.future.result()
    more = added.result()
    candidates = [candidates[0], *more, *candidates[1:]]
    done = {0: report, **{i + len(more): r for i, r in done.items() if i}}
    ask.join()
    candidates, done, notes = _unique(candidates, done)
    failed += notes
  groups = _groups(candidates)
  compile_all([g[0] for g in groups.values() if len(groups) > 1 and not set(g) & set(done)])
  if profiling and len(candidates) > 1:
    ok = [i for i, r in done.items() if not isinstance(r, Exception) and r is not None]
    if ok:
      fastest = min(ok, key=lambda i: (done[i].step_time_s, i))
      job = _profiled(candidates[fastest], done[fastest], failed)
      if job is not None:
        # Beside it, the other variants of its program (the fastest program is never
        # skipped), so that no thread idles while it compiles; where they are fewer than
        # the threads, the next first variants worth a latency profile (the profiles
        # tried at the end, tried now).
        (same,) = [g for g in groups.values() if fastest in g]
        rest = [i for i in same if i not in done]
        times, reports = so_far()
        idle = min(compiles.workers() - 1 - len(rest), PROFILED_VARIANTS - 1)
        bases = [fastest]
        more = []
        for i in worth_profiling(times, reports, frozenset({fastest}), idle):
          j = _profiled(candidates[i], done[i], failed)
          if j is not None:
            bases.append(i)
            more.append(j)
        jobs = [job] + [candidates[i] for i in rest] + more
        results = compiles.analyze_all(
          settings, jobs, make, args, kwargs, errors + (OSError,), kernels, learned
        )
        for i, r in zip(rest, results[1 : 1 + len(rest)]):
          done[i] = r
        for base, j, r in zip(bases, [job, *more], [results[0], *results[1 + len(rest) :]]):
          if _kept(j, r, failed):
            candidates.append(j)
            done[len(candidates) - 1] = r
            # The program's best step so far (what its other variants must come near).
            next(g for g in groups.values() if base in g).append(len(candidates) - 1)
  skipped, notes = _behind(candidates, groups, done)
  failed += notes
  rest = [i for i in range(len(candidates)) if i not in done and i not in skipped]
  # A variant that combines two others' options (a program's options tried one by one and
  # together) compiles after them, and only where each of them beat the program's first
  # variant (:mod:`.combinations`).
  combined = combinations.combined(candidates, groups, rest)
  rest = [i for i in rest if i not in combined]
  # Where the rest leave a thread idle in their last round (fewer of them than a multiple
  # of the threads), the first of the profiles tried at the end start there, chosen from
  # what is known now (so the choice does not depend on which compile ends first).
  spare = []
  if profiling and rest:
    times, reports = so_far()
    have = sum(c.name.endswith(PROFILED_SUFFIX) for c in candidates)
    slots = min(-len(rest) % compiles.workers(), PROFILED_VARIANTS - have)
    for i in worth_profiling(times, reports, profiled_ones(), slots):
      j = _profiled(candidates[i], done[i], failed)
      if j is not None:
        spare.append(j)
  jobs = [candidates[i] for i in rest] + spare
  results = compiles.analyze_all(
    settings, jobs, make, args, kwargs, errors + (OSError,) if spare else errors, kernels, learned
  )
  for i, r in zip(rest, results):
    done[i] = r
  for j, r in zip(spare, results[len(rest) :]):
    if _kept(j, r, failed):
      candidates.append(j)
      done[len(candidates) - 1] = r
  if combined:
    lost, notes = combinations.parts_lost(candidates, combined, done)
    failed += notes
    skipped |= lost
    compile_all([i for i in combined if i not in lost])
  if skipped:
    kept = [i for i in range(len(candidates)) if i not in skipped]
    candidates = [candidates[i] for i in kept]
    done = {new: done[old] for new, old in enumerate(kept)}
  times, reports = [], []
  for i, c in enumerate(candidates):
    r = done[i]
    if isinstance(r, Exception):
      failed.append(f"{c.name}: {str(r).splitlines()[0][:200]}")
      times.append(float("inf"))
      reports.append(None)
    else:
      times.append(r.step_time_s)
      reports.append(r)
  if all(t == float("inf") for t in times):
    raise done[len(candidates) - 1]
  # A few again, scheduled by XLA from the analysis' own costs (a latency profile)
  # instead of XLA's estimates, unless the user gave a profile (the first pass's fastest
  # variant already was).
  early = None
  if profiling:
    profiled = profiled_ones()
    jobs = []
    # PROFILED_VARIANTS in all, the first pass's included.
    most = PROFILED_VARIANTS - sum(c.name.endswith(PROFILED_SUFFIX) for c in candidates)
    for i in worth_profiling(times, reports, profiled, most):
      c = candidates[i]
      job = _profiled(c, reports[i], failed)
      if job is not None:
        jobs.append(job)
    if jobs:  # meanwhile, the best variant so far judged a second time (kept if it stays)
      ahead = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jax_overlap")
      first = min(range(len(times)), key=lambda i: (times[i], i))
      early = (first, len(candidates), ahead.submit(judged_notes, [*candidates], first, [*reports]))
      ahead.shutdown(wait=False)
    results = compiles.analyze_all(settings, jobs, make, args, kwargs, errors + (OSError,), kernels)
    for job, r in zip(jobs, results):
      if _kept(job, r, failed):
        candidates.append(job)
        times.append(r.step_time_s)
        reports.append(r)
  best = min(range(len(times)), key=lambda i: (times[i], i))
  if early is not None and _judged_alike(candidates, reports, early[:2], best):
    judged = early[2].result()
  else:
    judged = judged_notes(candidates, best, reports)
  judged += windowed_notes(candidates, reports)
  choice = Choice(
    tuple(candidates),
    best,
    tuple(Estimate(c.name, t) for c, t in zip(candidates, times)),
    failed=tuple(failed),
    judged=tuple(judged),
    how="cost_model",
  )
  return choice, reports


def _written_base(candidates, reports) -> int | None:
  """The fastest variant of the step as written (what :func:`judged_notes` judges beside
  another choice), or None."""
  written = [i for i, c in enumerate(candidates) if c.name.startswith("as written") and reports[i]]
  return min(written, key=lambda i: reports[i].step_time_s, default=None)


def _judged_alike(candidates, reports, early: tuple[int, int], best: int) -> bool:
  """Whether :func:`judged_notes` of the first ``n`` candidates with ``chosen`` chosen
  (``early``) judges what it judges of all of them with ``best`` chosen: the same choice,
  beside the same step as written."""
  chosen, n = early
  return chosen == best and _written_base(candidates[:n], reports[:n]) == _written_base(
    candidates, reports
  )


def _groups(candidates: list[Candidate]) -> dict[tuple, list[int]]:
  """The candidates by program, in order: those that compile the same program (as far as
  its kernels go) with GEMMs through the same emitter and loop bodies in as many batch
  parts; a group's first is compiled in the first pass."""
  groups: dict[tuple, list[int]] = {}
  for i, c in enumerate(candidates):
    gemms = c.options.get("xla_gpu_enable_triton_gemm")
    # A loop body in batch parts shares most kernels with the program (the kernel cache
    # keys by it) but not its step: its own group, compiled in the first pass.
    groups.setdefault((compiles.program(c.config), c.config.batch_parts, gemms), []).append(i)
  return groups


def _kept(job: Candidate, result, failed: list) -> bool:
  """Whether a profiled recompile's ``result`` is a report to keep (else its failure is
  noted in ``failed``)."""
  if isinstance(result, Exception):
    failed.append(f"{job.name}: {str(result).splitlines()[0][:200]}")
    return False
  return True


def _profiled(c: Candidate, report, failed: list) -> Candidate | None:
  """``c`` recompiled with a latency profile written from its ``report`` (None, with a note
  in ``failed``, where the profile cannot be written)."""
  label = c.name + PROFILED_SUFFIX
  try:
    profile = latency_profile.write_profile(report)
  except OSError as e:
    failed.append(f"{label}: {str(e).splitlines()[0][:200]}")
    return None
  return c.renamed(label, {**c.options, latency_profile.OPTION: profile})


def _spellings(candidates: list[Candidate]) -> None:
  """Asks jaxlib, once per process, how it spells the candidates' options (what
  :func:`_unique` compares them by)."""
  from jax_overlap._src.flags import per_compile

  for c in candidates:
    try:
      per_compile.spelled(c.options)
    except Exception:  # noqa: BLE001 - _unique compares them as given then
      pass


def _unique(candidates: list[Candidate], done: dict) -> tuple[list[Candidate], dict, list[str]]:
  """``candidates`` without those that compile the same program with the same options as
  one before them, spelled as this jaxlib takes them (an option variant that sets what the
  recommended flags already set),
  ``done`` renumbered, and a note for each left out."""
  from jax_overlap._src.flags import per_compile

  def spelled(options):  # as the compile takes them: "on" and an enum's name are one value
    try:
      return per_compile.spelled(options)
    except Exception:  # noqa: BLE001 - compared as given where jaxlib cannot be asked
      return options

  kept: list[int] = []
  notes = []
  options = [spelled(c.options) for c in candidates]
  for i, c in enumerate(candidates):
    same = next(
      (j for j in kept if candidates[j].config == c.config and options[j] == options[i]),
      None,
    )
    if same is None:
      kept.append(i)
    else:
      notes.append(f"{c.name}: the same program and options as {candidates[same].name!r}")
  return [candidates[i] for i in kept], {n: done[o] for n, o in enumerate(kept) if o in done}, notes


def _behind(candidates: list[Candidate], groups: dict, done: dict) -> tuple[set[int], list[str]]:
  """The variants that cannot win, not worth compiling: the rest of a program whose first
  variant's compute alone (what a schedule can at best leave of its step) takes longer
  than :data:`BEHIND_FACTOR` times the best step so far, or whose first variant's step is
  :data:`FAR_BEHIND` behind it; the others differ from it only in XLA options or in the
  order of the same operations. A note for each program."""
  reports = {i: r for i, r in done.items() if r is not None and not isinstance(r, Exception)}
  if not reports:
    return set(), []
  fastest = min(r.step_time_s for r in reports.values())
  skipped, notes = set(), []
  for members in groups.values():
    seen = [i for i in members if i in reports]
    rest = [i for i in members if i not in done]
    if not seen or not rest:
      continue
    first = min(seen, key=lambda i: reports[i].compute_time_s)
    compute = reports[first].compute_time_s
    step = min(reports[i].step_time_s for i in seen)
    if compute > BEHIND_FACTOR * fastest:
      skipped.update(rest)
      notes.append(
        f"{len(rest)} variant(s) of the program of {candidates[first].name!r} skipped: its "
        f"compute alone takes {compute * 1e3:.3f} ms, more than the best step so far "
        f"({fastest * 1e3:.3f} ms)"
      )
    elif step > (1 + FAR_BEHIND) * fastest:
      skipped.update(rest)
      notes.append(
        f"{len(rest)} variant(s) of the program of {candidates[first].name!r} skipped: its "
        f"step takes {step * 1e3:.3f} ms, {100 * (step / fastest - 1):.0f}% behind the best "
        f"step so far ({fastest * 1e3:.3f} ms), more than the other variants of one program "
        f"(options and orderings) gain over its first ({100 * FAR_BEHIND:.0f}% allowed)"
      )
  return skipped, notes
