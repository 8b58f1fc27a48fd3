"""What the runtime library adds to one kernel launch, against the test suite's fake driver.

A test program (``xla_patches/testing/fake_app.c``) launches one kernel many times through
a pointer from ``cuGetProcAddress`` (as the CUDA runtime and cuBLAS reach the driver): a
module's function (``cuModuleGetFunction``, as XLA's kernels) and a context-less kernel
(``cuLibraryGetKernel``, as the CUDA runtime of CUDA 12 and later launches its own and
cuBLAS's), each without the library, with the library but no plan, and with a plan that
shapes every launch (``blocks_per_sm 2``). Per configuration the best of ``--repeats``
runs of ``--launches`` launches, divided by the launches; the library's cost is the
difference to the run without it. The configurations' runs are interleaved. The fake driver checks and records each launch (a few
hundred nanoseconds), far less than a real ``cuLaunchKernel`` (microseconds), so the
differences, not the totals, are the figure. Process start is inside each run (a few
milliseconds over millions of launches).

  python benchmarks/runtime_launch_cost.py   # writes benchmarks/results/runtime_launch_cost.{json,md}
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import _common  # noqa: E402
from absl import app  # noqa: E402
from absl import flags as absl_flags  # noqa: E402
from fake_cuda import harness  # noqa: E402

from jax_overlap._src.runtime import library  # noqa: E402

FLAGS = absl_flags.FLAGS
absl_flags.DEFINE_integer("launches", 2_000_000, "Launches per run.")
absl_flags.DEFINE_integer("repeats", 7, "Runs per configuration (the best is kept).")

RULES = "version\t1\nkernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2\n"
HANDLES = {"module function": "launch", "context-less kernel (CUkernel)": "klaunch"}
SETUPS = {"no library": (False, None), "library, no plan": (True, None), "shaped": (True, RULES)}


def _seconds(fake: pathlib.Path, action: str, preload: bool, rules: str | None) -> float:
  """One run's wall time."""
  env = dict(os.environ, LD_LIBRARY_PATH=str(fake), FAKE_CUDA_FUNCS=harness.DEFAULT_FUNCS)
  env.pop("FAKE_CUDA_LOG", None)
  if preload:
    env["LD_PRELOAD"] = library.library_path()
  if rules:
    env["JAX_OVERLAP_RT_RULES"] = rules
  cmd = [str(fake / "fake_app"), "procaddr", f"{action}:gemm_fusion_1:256:0:{FLAGS.launches}"]
  t0 = time.perf_counter()
  r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
  elapsed = time.perf_counter() - t0
  if r.returncode != 0:
    sys.exit(f"runtime_launch_cost: {' '.join(cmd)} failed: {r.stderr[-500:]}")
  if rules and '"launches_shaped": 0' in r.stdout:
    sys.exit(f"runtime_launch_cost: the plan shaped no launch of {action}")
  return elapsed


def main(argv):
  del argv
  fake = harness.build(pathlib.Path(tempfile.mkdtemp(prefix="launch_cost_")))
  # Configurations interleaved, so that the machine's drift falls on all of them alike.
  runs: dict[tuple[str, str], list[float]] = {}
  for _ in range(FLAGS.repeats):
    for handle, action in HANDLES.items():
      for name, setup in SETUPS.items():
        runs.setdefault((handle, name), []).append(_seconds(fake, action, *setup))
  rows = []
  for handle in HANDLES:
    times = {name: min(runs[handle, name]) / FLAGS.launches for name in SETUPS}
    base = times["no library"]
    rows.append(
      {
        "handle": handle,
        "per_launch_ns": {k: v * 1e9 for k, v in times.items()},
        "added_ns": {k: (v - base) * 1e9 for k, v in times.items() if k != "no library"},
      }
    )
  md = [
    "# What the runtime library adds to a launch (fake driver)",
    "",
    f"`benchmarks/runtime_launch_cost.py`: best of {FLAGS.repeats} runs of "
    f"{FLAGS.launches:,} launches through `cuGetProcAddress`, per launch; added = against "
    "the same launches without the library. The fake driver's own work is in every total.",
    "",
    "| handle | no library (ns) | library, no plan: added (ns) | shaped: added (ns) |",
    "| --- | --- | --- | --- |",
  ]
  for r in rows:
    md.append(
      f"| {r['handle']} | {r['per_launch_ns']['no library']:.0f} | "
      f"{r['added_ns']['library, no plan']:.0f} | {r['added_ns']['shaped']:.0f} |"
    )
  _common.publish(
    "runtime_launch_cost",
    {"launches": FLAGS.launches, "repeats": FLAGS.repeats, "rules": RULES, "rows": rows},
    md,
  )


if __name__ == "__main__":
  app.run(main)
