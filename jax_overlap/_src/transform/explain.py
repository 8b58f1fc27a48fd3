"""What ``@overlap`` did to a step and why: :class:`Action` and :class:`Explanation`."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Action:
  """One thing the transform did (or left alone, with the reason)."""

  # "convert", "classify", "prefetch", "reduce_scatter", "collective_matmul",
  # "kept_gather", "weight_gradient", "annotate", "compiler_option", "left_alone"
  kind: str
  where: str
  detail: str


@dataclasses.dataclass
class Explanation:
  """What ``overlap`` rewrote and why."""

  actions: list[Action]
  xla_options: dict[str, Any]
  notes: list[str]
  candidates: list[tuple[str, float]] = dataclasses.field(default_factory=list)
  chosen: str = ""

  def of_kind(self, kind: str) -> list[Action]:
    return [a for a in self.actions if a.kind == kind]

  def __str__(self) -> str:
    lines = ["jax_overlap.overlap:"]
    for kind in (
      "convert",
      "classify",
      "prefetch",
      "reduce_scatter",
      "collective_matmul",
      "kept_gather",
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
