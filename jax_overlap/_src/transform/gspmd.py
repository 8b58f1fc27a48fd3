"""Programs without shard_map (plain ``jax.jit`` over sharded arrays, pjit, GSPMD).

Their collectives do not exist in the jaxpr: XLA's SPMD partitioner inserts them while
compiling. ``@overlap`` therefore compiles the step once for the target as written, reads
the collectives of the partitioned, optimized HLO (:func:`found`), and chooses among
compiler-option variants built for what it found (:func:`variants`): how collectives are
combined, how many run at once, XLA's loop pipeliner, and XLA's own collective matmul
(windowed einsum), each also tried scheduled by the analysis's estimates. What XLA's
windowed einsum decomposed is read back from the compiled variant (:func:`decomposed`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from jax_overlap._src import flags as flags_lib
from jax_overlap._src.flags import aborts

__all__ = ["Found", "found", "variants", "left_out", "decomposed", "WINDOWED"]

# XLA's windowed einsum: the partitioner splits an all-gather or reduce-scatter beside a
# matmul into a ring of collective-permutes interleaved with partial matmuls.
WINDOWED = {
  "xla_gpu_threshold_for_windowed_einsum_mib": 0,
  "xla_gpu_multi_streamed_windowed_einsum": True,
}
_COMBINE = (
  "xla_gpu_all_gather_combine_threshold_bytes",
  "xla_gpu_reduce_scatter_combine_threshold_bytes",
  "xla_gpu_all_reduce_combine_threshold_bytes",
)
_IN_FLIGHT = "xla_gpu_experimental_parallel_collective_overlap_limit"
_PIPELINED = (
  "xla_gpu_enable_pipelined_all_gather",
  "xla_gpu_enable_pipelined_reduce_scatter",
  "xla_gpu_enable_pipelined_all_reduce",
)


@dataclasses.dataclass(frozen=True)
class Found:
  """The collectives the partitioner inserted, as one compiled step runs them.

  Attributes:
    counts: collective kind -> instances per step (loop bodies counted per iteration).
    bytes: collective kind -> bytes per device per step.
    largest: collective kind -> bytes of the largest instance.
    loops: while loops in the step.
    dots: kernels with a matmul.
  """

  counts: dict[str, int]
  bytes: dict[str, int]
  largest: dict[str, int]
  loops: int
  dots: int

  @property
  def total(self) -> int:
    return sum(self.counts.values())

  def summary(self) -> str:
    if not self.total:
      return "no collectives"
    parts = [
      f"{n} {kind}{'s' if n > 1 else ''} ({_size(self.bytes[kind])}"
      + (f", largest {_size(self.largest[kind])})" if n > 1 else ")")
      for kind, n in sorted(self.counts.items())
    ]
    loops = f" (the step has {self.loops} while loop(s))" if self.loops else ""
    return ", ".join(parts) + loops


def _size(n: int) -> str:
  for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= scale:
      return f"{n / scale:.1f} {unit}"
  return f"{n} B"


def found(report) -> Found:
  """The collectives of an analysis report of the compiled step."""
  counts: collections.Counter = collections.Counter()
  nbytes: collections.Counter = collections.Counter()
  largest: dict[str, int] = {}
  for c in report.collectives:
    counts[c.kind] += 1
    nbytes[c.kind] += int(c.bytes)
    largest[c.kind] = max(largest.get(c.kind, 0), int(c.bytes))
  dots = sum(1 for k in report.kernels if getattr(k, "gemm_mnk", None))
  return Found(dict(counts), dict(nbytes), largest, len(report.loops or ()), dots)


def _accepted(options: dict[str, Any]) -> dict[str, Any]:
  """The options the installed jaxlib takes (a stale flag is left out, never passed)."""
  return {k: v for k, v in options.items() if flags_lib.accepted_by_jaxlib(k, v)}


def _windowed(f: Found) -> tuple[dict[str, Any], dict[str, str]]:
  """XLA's windowed-einsum options for a step with the collectives ``f`` (none where it
  has no dot beside an all-gather or reduce-scatter), and those of them the installed XLA
  ends the process with compiling the step's loops (``{name: XLA's message}``, see
  :mod:`jax_overlap._src.flags.aborts`)."""
  gather_or_scatter = f.counts.get("all-gather", 0) + f.counts.get("reduce-scatter", 0)
  if not (f.dots and gather_or_scatter):
    return {}, {}
  options = _accepted(WINDOWED)
  return options, aborts.aborting(options) if f.loops else {}


def _pipeliner(on: bool) -> dict[str, Any]:
  """Options that switch XLA's loop pipeliner for every collective kind, in the spelling
  the installed jaxlib takes."""
  out: dict[str, Any] = {}
  for k in _PIPELINED:
    if flags_lib.accepted_by_jaxlib(k, on):
      out[k] = on
      continue
    new = flags_lib.REGISTRY[k].replacement
    if new and flags_lib.accepted_by_jaxlib(new, "on" if on else "off"):
      out[new] = "on" if on else "off"
  return out


def variants(f: Found, base: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
  """Named option sets for a partitioned step that has the collectives ``f``; the first is
  ``base`` (the recommended flags) itself."""
  out = [("as written, recommended flags", dict(base))]
  if not f.total:
    return out
  separate = _accepted({k: 0 for k in _COMBINE})
  if separate:
    out.append(("as written, one tensor per collective", {**base, **separate}))
  two = _accepted({_IN_FLIGHT: 2})
  if two:
    out.append(("as written, two collectives in flight", {**base, **two}))
  if f.loops:
    for on in (True, False):
      opts = _pipeliner(on)
      if opts:
        word = "on" if on else "off"
        out.append((f"as written, XLA's loop pipeliner {word}", {**base, **opts}))
  options, crashing = _windowed(f)
  windowed = {k: v for k, v in options.items() if k not in crashing}
  if windowed.get("xla_gpu_threshold_for_windowed_einsum_mib") == 0:
    out.append(("as written, XLA's windowed einsum", {**base, **windowed}))
    if two:
      out.append(
        (
          "as written, XLA's windowed einsum, two collectives in flight",
          {**base, **windowed, **two},
        )
      )
  return out


def left_out(f: Found) -> list[str]:
  """Why variants :func:`variants` would try for a step with the collectives ``f`` are not
  tried on the installed jaxlib (an option with which its XLA ends the process compiling
  the step), one sentence each."""
  _, crashing = _windowed(f)
  return [
    f"XLA's windowed einsum is not tried: the installed jaxlib's XLA ends the process "
    f"compiling a program with loops with {name}={WINDOWED[name]} ({message})"
    for name, message in crashing.items()
  ]


def decomposed(before: Found, after: Found) -> str:
  """What changed in the collectives between two compiles of one step, in words."""
  kinds = sorted(set(before.counts) | set(after.counts))
  changes = [
    f"{k} {before.counts.get(k, 0)} -> {after.counts.get(k, 0)}"
    for k in kinds
    if before.counts.get(k, 0) != after.counts.get(k, 0)
  ]
  if not changes:
    return "XLA decomposed nothing (the same collectives as without it)"
  return "collectives per step " + ", ".join(changes)
