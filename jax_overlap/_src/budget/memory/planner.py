"""The memory planner: remat policy x optimizer-state sharding x prefetch depth (x, when
asked, the cap on gathered parameters held ahead of first use) searched through a user step
builder, each candidate compiled, those within the budget ranked by estimated step time."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from absl import logging

from jax_overlap._src import deprecations
from jax_overlap._src.budget.memory.breakdown import (
  Breakdown,
  _fmt_bytes,
  breakdown,
)
from jax_overlap._src.transform import settings as settings_lib

_POLICY_ALIASES = {
  "nothing": "nothing_saveable",
  "dots": "dots_saveable",
  "dots_no_batch": "dots_with_no_batch_dims_saveable",
  "everything": "everything_saveable",
}


def remat_policy(name: str) -> Callable[..., Any]:
  """A ``jax.checkpoint_policies`` policy by name.

  Args:
    name: ``"nothing"``, ``"dots"``, ``"dots_no_batch"``, ``"everything"``, any
      attribute name of ``jax.checkpoint_policies`` (e.g. ``"nothing_saveable"``),
      or ``"names:a,b"`` for ``save_only_these_names("a", "b")`` (values tagged
      with ``jax.ad_checkpoint.checkpoint_name``).

  Returns:
    The policy callable for ``jax.checkpoint(..., policy=...)``.

  Raises:
    ValueError: for an unknown name.

  Example:
    >>> import jax
    >>> remat_policy("dots") is jax.checkpoint_policies.dots_saveable
    True
  """
  policies = jax.checkpoint_policies
  if not isinstance(name, str):
    raise TypeError(f"budget.memory.remat_policy: name must be a string, got {type(name).__name__}")
  if name.startswith("names:"):
    names = tuple(n.strip() for n in name[len("names:") :].split(",") if n.strip())
    if not names:
      raise ValueError(
        f"budget.memory.remat_policy: 'names:' needs at least one name, got {name!r}"
      )
    return policies.save_only_these_names(*names)
  attr = _POLICY_ALIASES.get(name, name)
  policy = getattr(policies, attr, None)
  if policy is None or attr.startswith("_") or attr in ("save_only_these_names",):
    known = sorted(_POLICY_ALIASES) + ["names:<a,b>"]
    raise ValueError(
      f"budget.memory.remat_policy: unknown policy {name!r}; use one of {known} or an attribute "
      "of jax.checkpoint_policies"
    )
  return policy


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One point of the plan's search space.

  Attributes:
    remat: remat policy name (see :func:`remat_policy`).
    shard_opt_state: whether the optimizer state is sharded over the data axis.
    prefetch: overlap prefetch depth: how many weight gathers may be in flight
      ahead of the compute that needs them (0: none, gathers are synchronous).
    prefetch_memory: the most bytes of gathered parameters held ahead of their first use
      (``overlap(prefetch_memory=...)``), None: no cap.
  """

  remat: str
  shard_opt_state: bool
  prefetch: int
  prefetch_memory: int | None = None

  def __post_init__(self):
    if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
      raise ValueError(
        f"budget.memory.plan: prefetch depths must be integers >= 0, got {self.prefetch!r}"
      )
    cap = settings_lib.byte_count(self.prefetch_memory, "budget.memory.plan: prefetch_memory")
    object.__setattr__(self, "prefetch_memory", cap)

  def describe(self) -> str:
    """``remat=... shard_opt_state=... prefetch=...`` (and ``prefetch_memory=``, if set)."""
    cap = "" if self.prefetch_memory is None else f" prefetch_memory={self.prefetch_memory}"
    return (
      f"remat={self.remat} shard_opt_state={self.shard_opt_state} prefetch={self.prefetch}{cap}"
    )


@dataclasses.dataclass(frozen=True)
class PlanRow:
  """A compiled candidate: its memory, whether it fits, and its estimated step time."""

  candidate: Candidate
  total_bytes: int | None
  fits: bool
  step_time_s: float | None
  breakdown: Breakdown | None = None
  error: str | None = None


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """The chosen candidate and the whole table (``str(plan)`` prints it).

  Attributes:
    budget_bytes: the per-device budget.
    target: the target name.
    choice: the fastest row that fits.
    rows: every candidate, fitting ones first by step time, then the rest by memory.
  """

  budget_bytes: int
  target: str
  choice: PlanRow
  rows: tuple[PlanRow, ...]

  def __str__(self) -> str:
    head = (
      f"memory plan for {self.target}, budget {_fmt_bytes(self.budget_bytes)} per device: "
      f"choose {self.choice.candidate.describe()}"
    )
    capped = any(r.candidate.prefetch_memory is not None for r in self.rows)

    def cap(c: Candidate) -> tuple[str, ...]:
      if not capped:
        return ()
      return ("-" if c.prefetch_memory is None else _fmt_bytes(c.prefetch_memory),)

    cols = (
      "remat",
      "opt_shard",
      "prefetch",
      *(("pf_memory",) if capped else ()),
      "total",
      "weights",
      "opt_state",
      "activ",
      "gathered",
      "grad+coll",
      "temp+other",
      "step_ms",
      "fits",
    )
    w0 = max([len(cols[0])] + [len(r.candidate.remat) for r in self.rows])
    fmt = lambda cells: " ".join([f"{cells[0]:<{w0}}"] + [f"{x:>10}" for x in cells[1:]])
    lines = [head, fmt(cols)]
    for row in self.rows:
      c = row.candidate
      if row.breakdown is None:
        lines.append(
          fmt((c.remat, str(c.shard_opt_state), str(c.prefetch), *cap(c))) + f"  error: {row.error}"
        )
        continue
      b = row.breakdown.categories
      cells = (
        c.remat,
        str(c.shard_opt_state),
        str(c.prefetch),
        *cap(c),
        _fmt_bytes(row.total_bytes or 0),
        _fmt_bytes(b["weights"]),
        _fmt_bytes(b["optimizer_state"]),
        _fmt_bytes(b["activations"]),
        _fmt_bytes(b["gathered_weights"]),
        _fmt_bytes(b["collective_buffers"] + b["gradients"]),
        _fmt_bytes(
          b["temporaries"] + b["fragmentation"] + b["outputs"] + b["inputs"] + b["other_arguments"]
        ),
        "-" if row.step_time_s is None else f"{1e3 * row.step_time_s:.3f}",
        ("*" if row is self.choice else "") + ("yes" if row.fits else "no"),
      )
      lines.append(fmt(cells))
    return "\n".join(lines)


def _estimate(
  estimator: Callable[..., float] | None, fn: Any, args: tuple, b: Breakdown, target: str
) -> float:
  if estimator is not None:
    return float(estimator(fn, *args, target=target))
  # The analysis of the HLO this candidate was just compiled to (no second compile).
  from jax_overlap._src.analysis import analyze as analysis

  return float(analysis.analyze_hlo(b.hlo_text, target=target).step_time_s)


def _progress(items: list, enabled: bool) -> Iterable:
  if not enabled:
    return items
  try:
    from tqdm.auto import tqdm
  except ImportError:
    return _LogProgress(items)
  return tqdm(items, desc="budget.memory.plan", unit="candidate")


class _LogProgress:
  def __init__(self, items):
    self.items = items

  def __iter__(self):
    for i, item in enumerate(self.items):
      logging.info("budget.memory.plan: candidate %d/%d: %s", i + 1, len(self.items), item)
      yield item


@deprecations.keyword_only("target", api="jax_overlap.budget.memory.plan")
def plan(
  step_builder: Callable[..., Any],
  budget_bytes: int,
  *,
  target: str = "h100x8",
  remat_policies: Sequence[str] = ("nothing", "dots", "everything"),
  shard_opt_state: Sequence[bool] = (False, True),
  prefetch: Sequence[int] = (0, 1, 2),
  prefetch_memory: Sequence[int | str | None] = (None,),
  estimator: Callable[..., float] | None = None,
  arg_kinds: Sequence[str | None] | None = None,
  progress: bool = True,
  cache: dict | None = None,
) -> MemoryPlan:
  """Searches remat policy x optimizer-state sharding x prefetch depth for a memory budget.

  Each candidate is built by ``step_builder(remat_policy=<policy callable>,
  shard_opt_state=<bool>, prefetch=<int>)``, which returns ``(fn, args)``:
  a (jitted) step and its arguments as ``jax.ShapeDtypeStruct`` with shardings
  on the target's compile-only mesh. The step compiles deviceless, its
  :func:`breakdown` is taken, candidates within ``budget_bytes`` per device
  are ranked by estimated step time (ties: less memory), and the fastest is
  chosen. Given ``prefetch_memory`` caps, the builder is also passed
  ``prefetch_memory=<bytes or None>`` and the caps are searched too (with each
  prefetch depth >= 1: at depth 0 nothing is gathered ahead); a builder that
  decorates with ``jax_overlap.overlap`` passes both on to it.

  Args:
    step_builder: builds a candidate, see above.
    budget_bytes: memory budget per device, in bytes (> 0).
    target: target name, e.g. ``"h100x8"``.
    remat_policies: policy names for :func:`remat_policy`.
    shard_opt_state: optimizer-state sharding choices.
    prefetch: prefetch depths.
    prefetch_memory: caps on the bytes of gathered parameters held ahead of their first
      use (ints, strings such as ``"256MiB"``, or None for no cap); the default
      ``(None,)`` searches none and does not pass the keyword to the builder.
    estimator: ``estimator(fn, *args, target=...) -> seconds``; default: the
      step time :func:`jax_overlap.analyze` gives the candidate's optimized HLO
      (read from the compile that measured its memory).
    arg_kinds: passed to :func:`breakdown`.
    progress: show a progress bar over candidates (tqdm if installed, else
      absl log lines).
    cache: a dict reused across calls (e.g. for several budgets) so each
      candidate compiles once.

  Returns:
    A :class:`MemoryPlan`.

  Raises:
    ValueError: for a budget that is not a positive number, for no candidates, for a
      prefetch_memory that is not a size, or when no candidate fits (stating the smallest
      need and its candidate).
    RuntimeError: when every candidate failed to build or compile.

  Example:
    >>> def build(remat_policy, shard_opt_state, prefetch):  # doctest: +SKIP
    ...   return jax.jit(make_step(remat_policy, shard_opt_state, prefetch)), args
    >>> p = plan(build, 40 * 2**30, target="h100x8")  # doctest: +SKIP
    >>> print(p)  # doctest: +SKIP
    >>> def build(remat_policy, shard_opt_state, prefetch, prefetch_memory):  # doctest: +SKIP
    ...   step = jax_overlap.overlap(make_step(remat_policy, shard_opt_state), target="h100x8",
    ...                              prefetch=prefetch, prefetch_memory=prefetch_memory)
    ...   return step, args
    >>> p = plan(build, 40 * 2**30, prefetch_memory=(None, "1GiB"))  # doctest: +SKIP
  """
  if (
    isinstance(budget_bytes, bool)
    or not isinstance(budget_bytes, (int, float))
    or not (budget_bytes > 0)
    or math.isinf(budget_bytes)
  ):
    raise ValueError(
      f"budget.memory.plan: budget_bytes must be a positive number of bytes per device, got "
      f"{budget_bytes!r}"
    )
  caps = list(prefetch_memory)
  searched = any(c is not None for c in caps)
  candidates = list(
    dict.fromkeys(  # a cap is dropped at depth 0 (nothing gathered ahead): one such row
      Candidate(str(r), bool(s), int(p), cap if int(p) > 0 else None)
      for r in remat_policies
      for s in shard_opt_state
      for p in prefetch
      for cap in caps
    )
  )
  if not candidates:
    raise ValueError(
      "budget.memory.plan: the search space is empty (no remat policy, "
      "opt-state sharding or prefetch choice given)"
    )
  for name in {c.remat for c in candidates}:
    remat_policy(name)  # fail fast on unknown names
  cache = {} if cache is None else cache
  evaluated: list[tuple[Candidate, Breakdown | None, float | None, str | None]] = []
  for cand in _progress(candidates, progress):
    key = (target, cand)
    if key not in cache:
      try:
        kw = {"prefetch_memory": cand.prefetch_memory} if searched else {}
        built = step_builder(
          remat_policy=remat_policy(cand.remat),
          shard_opt_state=cand.shard_opt_state,
          prefetch=cand.prefetch,
          **kw,
        )
        fn, args = built[0], tuple(built[1])
        b = breakdown(fn, *args, target=target, arg_kinds=arg_kinds)
        t = _estimate(estimator, fn, args, b, target)
        cache[key] = (b, t, None)
      except Exception as e:  # a candidate that does not build or compile is reported, not fatal
        logging.warning("budget.memory.plan: candidate %s failed: %s", cand, e)
        cache[key] = (None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
    evaluated.append((cand, *cache[key]))
  rows = [
    PlanRow(c, b.total_bytes if b else None, bool(b and b.total_bytes <= budget_bytes), t, b, err)
    for c, b, t, err in evaluated
  ]
  ok = [r for r in rows if r.breakdown is not None]
  if not ok:
    raise RuntimeError(
      "budget.memory.plan: every candidate failed to build or compile; first error: "
      f"{rows[0].error}"
    )
  fitting = sorted((r for r in ok if r.fits), key=lambda r: (r.step_time_s, r.total_bytes))
  if not fitting:
    smallest = min(ok, key=lambda r: r.total_bytes)
    raise ValueError(
      f"budget.memory.plan: no candidate fits {_fmt_bytes(budget_bytes)} per device on "
      f"{target}; the smallest needs {_fmt_bytes(smallest.total_bytes)} ({smallest.total_bytes} "
      f"bytes) with {smallest.candidate.describe()}"
    )
  rest = sorted(
    (r for r in rows if not r.fits), key=lambda r: (r.total_bytes is None, r.total_bytes or 0)
  )
  return MemoryPlan(int(budget_bytes), str(target), fitting[0], tuple(fitting + rest))
