"""What cuBLAS's SM-count target on its persistent GEMMs would buy, if cuBLAS follows it.

The simulator (``sim.Policy(gemm_sm_count_target=N)``, a plan's ``library_gemms``) on an
H200: cuBLAS's 8192^3 bf16 GEMM (1.41 ms alone, persistent: measured) launched first, an
NCCL-channel-sized copy launched behind it on a stream at the highest priority, at SM-count
targets from the device's 132 down; two copies: the GPU benchmark's (16 CTAs, 256 MiB,
0.378 ms alone: measured) and one of 24 CTAs moving 96 MiB (0.12 ms alone: assumed). Whether
cuBLAS's grid follows a target is not measured (benchmarks/gpu/gemm_dispatch.cu measures it):
every figure here assumes it does. Writes benchmarks/results/runtime_gemm_target.{json,md}.

  python benchmarks/runtime_gemm_target.py
"""

from __future__ import annotations

import dataclasses
import os
import sys

from absl import app

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from jax_overlap import sim  # noqa: E402

GEMM_S = 1.41e-3
COPIES = {
  "16 CTAs, 256 MiB": dict(channels=16, nbytes=256 << 20, time_s=0.378e-3),
  "24 CTAs, 96 MiB": dict(channels=24, nbytes=96 << 20, time_s=0.12e-3),
}
TARGETS = (0, 124, 120, 116, 108, 100)


def _workload(channels: int, nbytes: int, time_s: float) -> sim.Workload:
  gemm = dataclasses.replace(sim.Kernel.gemm("gemm", 8192, 8192, 8192), time_s=GEMM_S)
  copy = sim.Collective(
    "copy", "copy", float(nbytes), group_size=1, stream=1, channels=channels, threads=544,
    regs=96, smem=82240, time_s=time_s,
  )  # fmt: skip
  return sim.Workload((gemm, copy), "copy behind cuBLAS")


def main(argv):
  del argv
  rows = []
  for copy, spec in COPIES.items():
    wl = _workload(**spec)
    for target in TARGETS:
      pol = sim.Policy("priority", priority=True, gemm_sm_count_target=target)
      res = sim.simulate(wl, target="h200", policy=pol)
      c, g = res.timing("copy"), res.timing("gemm")
      rows.append(
        {
          "copy": copy,
          "sm_count_target": target,
          "copy_latency_s": c.end_s - c.ready_s,
          "gemm_s": g.duration_s,
          "gemm_slowdown": g.duration_s / GEMM_S - 1,
          "makespan_s": res.makespan_s,
        }
      )
    tuned = sim.tune(wl, target="h200", progress=False, gemm_sm_targets=TARGETS[1:])
    rows.append({"copy": copy, "tuner_choice": tuned.gemm_sm_count_target})
  md = [
    "# cuBLAS's SM-count target, simulated",
    "",
    __doc__.split("\n\n")[1].replace("\n", " "),
    "",
    "| copy | SM-count target | copy latency ms | GEMM ms | GEMM slower | makespan ms |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    if "tuner_choice" in r:
      continue
    md.append(
      f"| {r['copy']} | {r['sm_count_target'] or 'device (132)'} | {_common.ms(r['copy_latency_s'])} "
      f"| {_common.ms(r['gemm_s'])} | {r['gemm_slowdown']:+.1%} | {_common.ms(r['makespan_s'])} |"
    )
  md.append("")
  for r in rows:
    if "tuner_choice" in r:
      md.append(
        f"- sim.tune with these targets to assume, {r['copy']}: "
        f"{r['tuner_choice'] or 'none'} (the makespan it minimises)."
      )
  _common.publish("runtime_gemm_target", {"rows": rows}, md)


if __name__ == "__main__":
  app.run(main)
