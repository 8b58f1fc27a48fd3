"""What ``@overlap`` did to a step and why: :class:`Action` and :class:`Explanation`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from jax_overlap._src.transform.variants import Choice, Estimate


@dataclasses.dataclass(frozen=True)
class Action:
  """One thing the transform did (or left alone, with the reason)."""

  # "convert", "classify", "prefetch", "gather_timing", "reduce_scatter", "collective_matmul",
  # "kept_gather", "embedding", "weight_gradient", "annotate", "compiler_option", "left_alone"
  kind: str
  where: str
  detail: str


@dataclasses.dataclass(frozen=True)
class Explanation:
  """What ``overlap`` rewrote and why.

  Attributes:
    actions: what the transform did, and left alone, with the reasons.
    xla_options: the XLA options the step compiles with.
    notes: what the selection found and how it judged the variants.
    candidates: each compared variant's estimate by the cost model (``(name,
      step_time_s)`` records, :class:`~.variants.Estimate`); empty where there was one
      variant. Timings on the devices are in ``choice.measured``.
    chosen: the chosen variant's name.
    choice: the choice itself (:class:`~.variants.Choice`: the candidates with their
      programs and options, what failed, how it was made), None for explanations made by
      hand.
  """

  actions: list[Action]
  xla_options: dict[str, Any]
  notes: list[str]
  candidates: list[Estimate] = dataclasses.field(default_factory=list)
  chosen: str = ""
  choice: Choice | None = None

  def of_kind(self, kind: str) -> list[Action]:
    return [a for a in self.actions if a.kind == kind]

  def __str__(self) -> str:
    lines = ["jax_overlap.overlap:"]
    for kind in (
      "convert",
      "classify",
      "prefetch",
      "gather_timing",
      "reduce_scatter",
      "collective_matmul",
      "batch_parts",
      "kept_gather",
      "embedding",
      "weight_gradient",
      "annotate",
      "compiler_option",
      "left_alone",
    ):
      acts = self.of_kind(kind)
      if acts:
        lines.append(f"  {kind} ({len(acts)}):")
        lines.extend(f"    [{a.where}] {a.detail}" for a in acts)
    lines.extend(f"  note: {n}" for n in self.notes)
    return "\n".join(lines)


def held_notes(names: list[str], chosen: int, reports: list) -> list[str]:
  """What the dispatch rule of persistent GEMMs did to the variants (``reports[i]`` the
  analysis of variant ``names[i]``, None where it did not compile): on Hopper a collective
  that becomes ready beside a cuBLAS GEMM waits for its end (``CollectiveInfo.held_by``)."""
  held = [
    (name, [c for c in r.collectives if c.held_by])
    for name, r in zip(names, reports)
    if r is not None
  ]
  held = [(name, cs) for name, cs in held if cs]
  if not held:
    return []
  text = (
    "collectives ready beside one of cuBLAS's persistent GEMMs wait for its end on this "
    "GPU (measured on an H200), in " + "; ".join(f"{name} ({len(cs)})" for name, cs in held)
  )
  mine = dict(held).get(names[chosen], [])
  if mine:
    gemms = sorted({c.held_by for c in mine})
    text += f"; the chosen variant's wait behind {', '.join(gemms[:3])}" + (
      f" and {len(gemms) - 3} more" if len(gemms) > 3 else ""
    )
  return [text]


def environment_notes(report) -> list[str]:
  """The environment settings the simulator says pay on the chosen variant's step
  (``jax_overlap.flags.judge_environment``): they cannot be set per compile, so the user
  is told, with the figure (none: no note)."""
  from jax_overlap._src.flags import environment

  try:
    verdicts = environment.judge(report)
  except (ValueError, TypeError, RuntimeError) as e:
    return [f"environment settings not judged: {str(e).splitlines()[0][:200]}"]
  return [
    f"{v.why}; set it in the environment before JAX starts (it cannot be set per compile)"
    for v in environment.paying(verdicts)
  ]
