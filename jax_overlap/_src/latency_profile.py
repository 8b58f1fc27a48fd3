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
import tempfile

from jax_overlap._src import cache as cache_lib
from jax_overlap._src import report as report_lib

__all__ = ["OPTION", "profile_text", "write_profile"]

OPTION = "xla_gpu_pgle_profile_file_or_directory_path"


def profile_text(report: report_lib.Report) -> str:
  """The ``ProfiledInstructionsProto`` text of ``report``'s kernel and collective costs.

  Loop bodies appear once per iteration in a report (``name@i``); the profile
  names each instruction once.
  """
  lines, seen = [], set()
  for item in [*report.kernels, *report.collectives]:
    name = item.name.split("@")[0]
    if name in seen or not name:
      continue
    seen.add(name)
    lines.append(f'costs {{ name: "{name}" cost_us: {item.time_s * 1e6:.3f} }}')
  return "\n".join(lines) + "\n"


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
