"""The dump settings of jax_overlap's own compiles, whatever ``XLA_FLAGS`` holds, and
reading the dump back.

The analysis reads XLA's dump of each compile it makes (``xla_dump_to``, a folder of its
own): the scheduled HLO, the thunk sequence, the buffer assignment. Dump settings in
``XLA_FLAGS`` apply to every compile of the process and can hide those files (MaxText,
for one, sets ``--xla_dump_hlo_module_re=jit_train_step`` when ``XLA_FLAGS`` is unset) or
bury them (per-pass dumps, other formats); set per compile, the settings here win. Where a
file is still missing, :func:`missing_dump` names the setting in ``XLA_FLAGS`` that can
hide it. :func:`read` and :func:`debug_options` read a dump's files;
:func:`check_compiled_for_gpu` tells a compile XLA made for the host's CPU from one for the
target.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from typing import Any

from jax_overlap._src.flags import per_compile, syntax

__all__ = [
  "DUMP_SETTINGS",
  "check_compiled_for_gpu",
  "debug_options",
  "dump_settings",
  "missing_dump",
  "read",
  "with_dump_settings",
]

# The dump settings the analysis reads its files by, set on every compile jax_overlap dumps
# for itself whatever XLA_FLAGS holds (set there, they apply to every compile of the
# process: MaxText, for one, sets a module filter when XLA_FLAGS is unset).
DUMP_SETTINGS: dict[str, Any] = {
  # A module filter the step's name does not match: no file at all.
  "xla_dump_hlo_module_re": ".*",
  # Per-pass dumps: thousands of files more for each compile.
  "xla_dump_hlo_pass_re": "",
  # The text files read back; with another format alone XLA writes no text.
  "xla_dump_hlo_as_text": True,
  "xla_dump_hlo_as_long_text": True,
  "xla_dump_hlo_as_proto": False,
  "xla_dump_hlo_as_dot": False,
  "xla_dump_hlo_as_html": False,
  "xla_dump_hlo_as_url": False,
  "xla_dump_hlo_snapshots": False,
  "xla_dump_fusion_visualization": False,
  # A count of the whole process's modules: once reached, no compile writes any file.
  "xla_dump_max_hlo_modules": -1,
  # Instruction metadata (op names, source lines) is read from the text.
  "xla_dump_disable_metadata": False,
  "xla_dump_large_constants": False,
  "xla_dump_include_timestamp": False,
  "xla_dump_module_metadata": False,
  # Every kernel's LLVM and Triton IR: a compile ten times slower (see _ptx_dump_options).
  "xla_dump_emitter_re": "",
}


# Those of them that, set otherwise in XLA_FLAGS, keep XLA from writing a file read back:
# a filter, a count, or a format chosen alone (XLA then writes no text).
_HIDING = (
  "xla_dump_hlo_module_re",
  "xla_dump_max_hlo_modules",
  "xla_dump_hlo_as_text",
  "xla_dump_hlo_as_proto",
  "xla_dump_hlo_as_dot",
  "xla_dump_hlo_as_html",
  "xla_dump_hlo_as_url",
)


def dump_settings() -> dict[str, Any]:
  """:data:`DUMP_SETTINGS`, those the installed jaxlib takes per compile (asked once per
  jaxlib version: :func:`.per_compile.accepted`)."""
  verdicts = per_compile.accepted(list(DUMP_SETTINGS.items()))
  return {k: v for k, v in DUMP_SETTINGS.items() if verdicts[(k, v)][0]}


def with_dump_settings(options: Mapping[str, Any]) -> dict[str, Any]:
  """``options`` with :func:`dump_settings` where they dump (``xla_dump_to``): the settings
  win over the caller's, but for ``xla_dump_emitter_re`` and ``xla_dump_hlo_pass_re``,
  which jax_overlap sets itself per compile to dump PTX and the module after XLA's config
  assigner (:mod:`.gemm_configs`)."""
  if "xla_dump_to" not in options:
    return dict(options)
  fixed = dump_settings()
  for own in ("xla_dump_emitter_re", "xla_dump_hlo_pass_re"):
    if own in options:
      fixed.pop(own, None)
  return {**options, **fixed}


def missing_dump(api: str, what: str) -> ValueError:
  """The error for a compile whose dump lacks ``what`` (e.g. "optimised HLO"): the settings
  in ``XLA_FLAGS`` that can hide it, named with their values (they stay as ``XLA_FLAGS``
  sets them where the installed jaxlib does not take them per compile); else a hint that
  the function may compute nothing."""
  set_there = syntax.parse_xla_flags(os.environ.get("XLA_FLAGS", ""))[0]
  named = [f"{k}={set_there[k]}" for k in _HIDING if k in set_there]
  if named:
    why = f"XLA_FLAGS sets {', '.join(named)}, which can keep XLA from writing it"
  else:
    why = "check that the function has any computation"
  return ValueError(f"{api}: XLA wrote no {what} for this compile; {why}")


def read(pattern: str, prefer: str | None = None) -> str:
  """The file matching ``pattern`` that holds the main module (the largest; a dump may also
  hold small helper modules), among those whose name holds ``prefer`` where any does; ""
  where none matches."""
  files = sorted(glob.glob(pattern), key=os.path.getmtime)
  if prefer:
    preferred = [f for f in files if prefer in os.path.basename(f)]
    files = preferred or files
  if not files:
    return ""
  best = max(files, key=os.path.getsize)
  with open(best) as f:
    return f.read()


def debug_options(text: str) -> dict[str, str]:
  """XLA's ``*.debug_options`` dump (``name: value`` lines) as a dict of strings."""
  out = {}
  for line in text.splitlines():
    if ":" in line:
      k, v = line.split(":", 1)
      out[k.strip()] = v.strip().strip('"')
  return out


def check_compiled_for_gpu(dump_dir: str, topo, api_name: str) -> None:
  """Raises where XLA compiled the program for the host's CPU instead of ``topo``: its dump
  holds a CPU module (``*cpu_after_optimizations.txt``) and no GPU one. ``jax.jit`` places a
  program by its arguments' devices; one without array arguments runs on the default
  device."""
  if glob.glob(os.path.join(dump_dir, "*gpu_after_optimizations.txt")):
    return
  if glob.glob(os.path.join(dump_dir, "*cpu_after_optimizations.txt")):
    raise ValueError(
      f"{api_name}: the function was compiled for the host's CPU, not for {topo.name}: "
      "jax.jit places a program on its arguments' devices, and none of its arguments is an "
      "array that could be placed on the target's. Pass the arrays the step computes on as "
      "arguments (jax.ShapeDtypeStruct, with a NamedSharding where they are sharded) "
      "instead of creating or capturing them inside the function"
    )
