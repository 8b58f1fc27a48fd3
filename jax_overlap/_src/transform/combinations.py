"""Variants that combine the options of two others of their program (one collective per
tensor, and XLA's loop pipeliner off, tried one by one and together): compiled after their
parts, and only where each part beat the program's first variant. Where the options'
effects add up, a combination cannot beat the better of its parts otherwise: a heuristic,
not a bound (options can interact), that the selection's notes name wherever it leaves a
combination out."""

from __future__ import annotations

from jax_overlap._src.transform.records import Candidate

__all__ = ["combined", "parts_lost"]


def _delta(c: Candidate, first: Candidate) -> dict:
  """The options ``c`` sets otherwise than ``first`` (the first variant of its program)."""
  keys = set(c.options) | set(first.options)
  return {k: c.options.get(k) for k in keys if c.options.get(k) != first.options.get(k)}


def combined(candidates: list[Candidate], groups: dict, rest: list[int]) -> dict:
  """Of the variants ``rest`` (left to compile), those that combine two other variants of
  their program (the same program, with the options each of them changes from its first
  variant, together), by index: ``{combination: (first, part, part)}``."""
  out = {}
  for members in groups.values():
    first = candidates[members[0]]
    same = [i for i in members[1:] if candidates[i].config == first.config]
    deltas = {i: _delta(candidates[i], first) for i in same}
    for i in same:
      if i not in rest or len(deltas[i]) < 2:
        continue
      for a in same:
        for b in same:
          if a < b and i not in (a, b) and deltas[a] and deltas[b]:
            if deltas[a].keys() & deltas[b].keys():
              continue
            if {**deltas[a], **deltas[b]} == deltas[i]:
              out.setdefault(i, (members[0], a, b))
  return out


def parts_lost(candidates: list[Candidate], combos: dict, done: dict) -> tuple[set, list]:
  """The combinations not worth compiling: one of whose parts did not beat the program's
  first variant (options whose effects add up cannot beat the better part then: a
  heuristic, not a bound), and a note for each."""

  def step(i):
    r = done.get(i)
    return float("inf") if r is None or isinstance(r, Exception) else r.step_time_s

  lost, notes = set(), []
  for i, (first, a, b) in combos.items():
    worse = [j for j in (a, b) if step(j) >= step(first)]
    if worse:
      lost.add(i)
      notes.append(
        f"{candidates[i].name}: not compiled: it combines the options of "
        f"{candidates[a].name!r} and {candidates[b].name!r}, and "
        + " and ".join(f"{candidates[j].name!r} ({step(j) * 1e3:.3f} ms)" for j in worse)
        + f" did not beat the program's first variant ({step(first) * 1e3:.3f} ms)"
      )
  return lost, notes
