"""Latency profiles for XLA's scheduler, written from jax_overlap's cost estimates.

XLA's latency-hiding scheduler decides how early to start each collective
from its own estimate of collective and kernel times. Where that estimate
differs from the roofline and alpha-beta costs the analysis uses, the
scheduler starts collectives too late (or holds memory too long) by the
analysis' account. XLA accepts measured per-instruction costs instead
(profile-guided latency estimation, ``xla_gpu_pgle_profile_file_or_directory_path``,
a ``ProfiledInstructionsProto``); this module writes such a profile from a
:class:`~jax_overlap.Report`, so a recompile of the same program is scheduled
by the costs the analysis reports. Instruction names are those of the
compiled module; a recompile with the same options keeps them. Instructions
the profile does not name keep XLA's own estimate.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile

from jax_overlap._src import cache as cache_lib
from jax_overlap._src.analysis import report as report_lib
from jax_overlap._src.compile import xla_log

__all__ = ["OPTION", "profile_text", "write_profile"]

OPTION = xla_log.PROFILE_OPTION


def profile_text(report: report_lib.Report) -> str:
  """The ``ProfiledInstructionsProto`` text of ``report``'s kernel and collective costs.

  Loop bodies appear once per iteration in a report (``name@i``); the profile
  names each instruction once, by the name XLA's scheduler knows it by. A
  ``conditional`` (a ``lax.cond``, ``lax.switch``) is one node of XLA's schedule: it
  costs what its branch the analysis counted (the most expensive) costs, the sum of that
  branch's kernels and collectives, a loop in it counted for one iteration; the other
  branches' instructions have their own costs too (``Report.uncounted_costs``: XLA
  schedules them, and warns of every instruction its scheduler costs that a profile
  leaves out).
  """
  costs: dict[str, float] = {}
  for item in [*report.kernels, *report.collectives]:
    name = item.name.split("@")[0]
    if name and name not in costs:
      costs[name] = item.time_s
  # The branches of a conditional the analysis does not count: XLA schedules them too.
  for name, t in report.uncounted_costs.items():
    costs.setdefault(name, t)
  costs.update(_conditional_costs(report, costs))
  pairs = _async_pairs(report.hlo_text or "")
  latencies = []
  for start, wrapped, ends in pairs:
    # The start and its done are asked their own cost (issuing them costs next to nothing)
    # and the time between them: that of the kernel they run.
    for n in (start, *ends):
      costs.setdefault(n, 0.0)
    latencies.append((start, ends[-1], costs.get(wrapped, 0.0)))
  # XLA's scheduler knows an instruction by the name it had then (``scheduling_name`` in
  # its metadata): XLA 0.11 turns a collective with nothing beside it into a synchronous
  # one after scheduling ("all-reduce.3", scheduled as "all-reduce-start").
  names = _scheduling_names(report.hlo_text or "")
  lines = [
    f'costs {{ name: "{names.get(n, n)}" cost_us: {t * 1e6:.3f} }}' for n, t in costs.items()
  ]
  lines += [
    f'latencies {{ source: "{names.get(a, a)}" target: "{names.get(b, b)}" '
    f"latency_us: {t * 1e6:.3f} }}"
    for a, b, t in latencies
  ]
  return "\n".join(lines) + "\n"


def _async_pairs(hlo_text: str) -> list[tuple[str, str, str]]:
  """``(start, wrapped, (update..., done))`` for each ``async-start`` of ``hlo_text`` that
  runs a kernel rather than a collective (from jaxlib 0.11 XLA issues some fusions so: a
  scan's dynamic-slice and dynamic-update-slice copies become ``fusion-start`` /
  ``fusion-done``). XLA's profile-guided estimator asks a cost of each start and done by
  name, and the latency between them by the start's name or the wrapped instruction's,
  warning of every one a profile leaves out."""
  from jax_overlap._src.analysis import hlo, schedule

  if "async-start" not in hlo_text:
    return []
  module = hlo.parse_module(hlo_text)
  out = []
  for comp in module.computations.values():
    users: dict[str, list] = {}
    for i in comp.instructions:
      for o in i.operands[:1]:
        users.setdefault(o, []).append(i)
    for instr in comp.instructions:
      if instr.opcode != "async-start":
        continue
      called = [module.computations[c] for c in instr.called if c in module.computations]
      inner = [i for c in called for i in c.instructions]
      if not called or any(i.opcode in schedule.COLLECTIVE_KINDS for i in inner):
        continue  # a collective: the report names it
      ends, at = [], instr.name
      while True:
        nxt = [u for u in users.get(at, []) if u.opcode in ("async-update", "async-done")]
        if not nxt:
          break
        at = nxt[0].name
        ends.append(at)
      root = called[0].root
      if ends and root is not None:
        out.append((instr.name, root.name, tuple(ends)))
  return out


_SCHEDULING_NAME = re.compile(r'^\s*(?:ROOT )?%([^\s=]+) = [^\n]*?scheduling_name="([^"]+)"', re.M)


def _scheduling_names(hlo_text: str) -> dict[str, str]:
  """Instruction name -> the name XLA's scheduler gave it, where the two differ."""
  return {a: b for a, b in _SCHEDULING_NAME.findall(hlo_text) if a != b}


def _conditional_costs(report: report_lib.Report, costs: dict[str, float]) -> dict[str, float]:
  """Each conditional of ``report``'s module: its costliest branch's instructions' costs
  (the analysis walks only that branch, so the others' are not in ``costs``)."""
  from jax_overlap._src.analysis import hlo

  if "conditional" not in (report.hlo_text or ""):
    return {}
  module = hlo.parse_module(report.hlo_text)

  def total(comp: str, seen: frozenset = frozenset()) -> float:
    if comp not in module.computations or comp in seen:
      return 0.0
    out = 0.0
    for instr in module.computations[comp].instructions:
      if instr.opcode in ("while", "call", "conditional"):
        inner = [total(c, seen | {comp}) for c in instr.called]
        out += max(inner, default=0.0) if instr.opcode == "conditional" else sum(inner)
      else:
        out += costs.get(instr.name, 0.0)
    return out

  return {
    i.name: max((total(c) for c in i.called), default=0.0)
    for comp in module.computations.values()
    for i in comp.instructions
    if i.opcode == "conditional"
  }


def _directory() -> str:
  return os.path.join(cache_lib.cache_dir(), "latency_profiles")


def write_profile(report: report_lib.Report, directory: str | None = None) -> str:
  """Writes :func:`profile_text` of ``report`` and returns the file's path.

  The file is named by its content, under ``directory`` (default: the
  jax_overlap cache directory, ``$JAX_OVERLAP_CACHE_DIR`` or
  ``~/.cache/jax_overlap``, else a temporary directory).

  Raises:
    ValueError: if the report has no kernels or collectives to write.
    OSError: if no directory can be written.
  """
  text = profile_text(report)
  if text.strip() == "":
    raise ValueError("write_profile: the report has no kernels or collectives")
  name = hashlib.sha1(text.encode()).hexdigest()[:16] + ".pbtxt"
  for d in (
    [directory] if directory else [_directory(), os.path.join(tempfile.gettempdir(), "jax_overlap")]
  ):
    path = os.path.join(d, name)
    try:
      cache_lib.write_text(path, text)
      return path
    except OSError:
      if directory:
        raise
  raise OSError("write_profile: no writable directory for the latency profile")
