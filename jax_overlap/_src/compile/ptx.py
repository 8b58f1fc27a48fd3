"""Registers and static shared memory of each kernel, read by ``ptxas`` from XLA's dumped PTX.

A deviceless compile with ``xla_dump_to`` writes each module's PTX; ``ptxas -v``
assembles it for the target architecture and reports, per ``.entry`` (the name
the driver reports for the kernel), the registers per thread and the static
shared memory, the two kernel resources that decide residency next to the
launch configuration from XLA's thunk listing.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess

__all__ = ["KernelResources", "kernel_resources", "parse_ptxas_log", "ptxas_arch"]

_ENTRY = re.compile(r"(?:Compiling entry function|Function properties for) '?(\w+)'?")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


@dataclasses.dataclass(frozen=True)
class KernelResources:
  """What ``ptxas`` reports for one kernel entry."""

  registers: int
  static_smem: int


def ptxas_arch(compute_capability: tuple[int, int]) -> str:
  """``ptxas -arch`` for a compute capability (``sm_90a`` on Hopper, as XLA emits)."""
  major, minor = compute_capability
  return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


def kernel_resources(
  dump_dir: str, compute_capability: tuple[int, int], *, ptxas: str | None = None
) -> dict[str, KernelResources]:
  """Per kernel entry of the PTX files in ``dump_dir``: registers and static shared memory.

  Args:
    dump_dir: an ``xla_dump_to`` directory of a GPU compile.
    compute_capability: the target's, e.g. ``(9, 0)``.
    ptxas: the assembler; default ``ptxas`` on ``PATH``.

  Returns:
    ``{entry name: KernelResources}``.

  Raises:
    FileNotFoundError: if ``ptxas`` is not installed, or the directory has no PTX.
    RuntimeError: if ``ptxas`` rejects a file, with its message.
  """
  exe = ptxas or shutil.which("ptxas")
  if exe is None:
    raise FileNotFoundError(
      "kernel_resources: ptxas is not on PATH (it comes with the CUDA toolkit, or the "
      "nvidia-cuda-nvcc wheel)"
    )
  files = sorted(glob.glob(os.path.join(dump_dir, "*.ptx")))
  if not files:
    raise FileNotFoundError(f"kernel_resources: no .ptx files in {dump_dir}")
  out: dict[str, KernelResources] = {}
  for path in files:
    if os.path.getsize(path) == 0:
      continue  # a module without kernels of its own
    proc = subprocess.run(
      [exe, f"-arch={ptxas_arch(compute_capability)}", "-v", path, "-o", os.devnull],
      capture_output=True,
      text=True,
    )
    if proc.returncode != 0:
      raise RuntimeError(f"kernel_resources: ptxas failed on {path}: {proc.stderr.strip()[-400:]}")
    out.update(parse_ptxas_log(proc.stderr))
  return out


def parse_ptxas_log(text: str) -> dict[str, KernelResources]:
  """Per entry function, the resources ``ptxas -v`` (or ``nvcc -Xptxas -v``) reported."""
  out: dict[str, KernelResources] = {}
  entry = None
  for line in text.splitlines():
    m = _ENTRY.search(line)
    if m:
      entry = m.group(1)
      continue
    m = _USED.search(line)
    if m and entry is not None:
      out[entry] = KernelResources(int(m.group(1)), int(m.group(2) or 0))
      entry = None
  return out
