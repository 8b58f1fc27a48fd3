"""The paper table and the sanity anchors, written to benchmarks/results/sim_paper.{md,json}.

Run: JAX_PLATFORMS=cpu python benchmarks/sim_paper.py
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import time

from jax_overlap import sim

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def anchors() -> dict:
  """The published observations of BACKGROUND section 2, as the model sees them."""
  out = {}
  seq = sim.simulate(sim.tail_effect(), target="h100x8", policy="sequential")
  con = sim.simulate(sim.tail_effect(), target="h100x8", policy="concurrent")
  out["h100_tail_effect_gemm_ratio"] = con.timing("gemm").duration_s / seq.timing("gemm").duration_s
  wl = sim.synthetic([(16384, 16384, 8192)], [("all-gather", 4 << 30)])
  for g in ("a100", "h100", "mi250x"):
    out[f"{g}_gemm_slowdown_beside_allgather"] = sim.simulate(
      wl, target=g, policy="concurrent"
    ).compute_slowdown
  for g in ("a100", "h100"):
    step = sim.transformer_step(2, d=8192, tokens=4096)
    s = sim.simulate(step, target=g, policy="sequential", baseline=False).makespan_s
    c = sim.simulate(step, target=g, policy="concurrent", baseline=False).makespan_s
    out[f"{g}_sequential_vs_overlapped"] = s / c - 1
  return out


def main() -> int:
  t0 = time.perf_counter()
  table = sim.paper_table(progress=False)
  anc = anchors()
  secs = time.perf_counter() - t0
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  machine = {
    "platform": platform.platform(),
    "python": platform.python_version(),
    "cpu_count": os.cpu_count(),
  }
  data = json.loads(table.to_json())
  data.update(
    date=date,
    machine=machine,
    anchors=anc,
    seconds=secs,
    config={
      "mixes": list(sim.paper_mixes()),
      "gpus": ["a40", "a100", "h100", "mi250x"],
      "constants": {g: sim.constants_for(g).__dict__ for g in ("a40", "a100", "h100", "mi250x")},
    },
  )
  with open(os.path.join(RESULTS, "sim_paper.json"), "w") as f:
    json.dump(data, f, indent=1, default=str)
  lines = [
    "# Paper table: five policies on A40, A100, H100, MI250X (simulated)",
    "",
    f"Date {date}; {machine['platform']}, Python {machine['python']}, "
    f"{machine['cpu_count']} CPUs; {secs:.1f} s. Produced by benchmarks/sim_paper.py "
    "(`jax-overlap simulate --paper` prints the same table).",
    "",
    table.markdown(),
    "",
    "## Sanity anchors (BACKGROUND section 2)",
    "",
    "| observation | published | model |",
    "|---|---|---|",
    f"| H100 132-block GEMM beside a 24-CTA all-gather | nearly doubles | "
    f"x{anc['h100_tail_effect_gemm_ratio']:.2f} |",
  ]
  for g in ("a100", "h100", "mi250x"):
    lines.append(
      f"| {g} GEMM slowdown beside an all-gather | 18.9% avg, max 40% "
      f"(arXiv 2507.03114) | {anc[f'{g}_gemm_slowdown_beside_allgather']:.1%} |"
    )
  for g in ("a100", "h100"):
    lines.append(
      f"| {g} sequential vs overlapped (2-layer FSDP step) | +10.2% avg, max 26.6% | "
      f"+{anc[f'{g}_sequential_vs_overlapped']:.1%} |"
    )
  lines += [
    "",
    "MI250X: RCCL's 256-thread CTAs fit beside the GEMM blocks, so the GEMM keeps its CUs and "
    "slows only through the CU throughput each resident CTA takes (`comm_sm_share`, assumed "
    f"{sim.constants_for('mi250x').comm_sm_share:g}; 16 channels on 110 CUs) and shared "
    "memory bandwidth, which this compute-bound GEMM barely uses: the model stays well below "
    "the published average, which no mechanism in it reaches on this part.",
  ]
  lines += [
    "",
    "## Calibration on published figures (sim.published_measurements)",
    "",
    "| gpu | records | RMS error before | after | fitted cta_copy_bandwidth | "
    "fitted gemm_efficiency |",
    "|---|---|---|---|---|---|",
  ]
  for g in ("a100", "h100"):
    c = sim.calibrate(sim.published_measurements(g), target=g)
    data.setdefault("calibration", {})[g] = {
      "before": c.error_before,
      "after": c.error_after,
      "params": c.params,
      "table": [dataclasses.asdict(r) for r in c.table],
    }
    lines.append(
      f"| {g} | {len(c.table)} | {c.error_before:.3f} | {c.error_after:.3f} | "
      f"{c.params['cta_copy_bandwidth'] / 1e9:.1f} GB/s | "
      f"{c.params['gemm_efficiency']:.3f} |"
    )
  from jax_overlap._src.sim import paper as paper_lib

  sens = paper_lib.sensitivity()
  changes = [dataclasses.asdict(c) for c in sens.changes()]
  data["sensitivity"] = {"changes": changes, "verdict": sens.verdict()}
  lines += [
    "",
    "## Sensitivity to the assumed constants (`jax-overlap simulate --paper --sensitivity`)",
    "",
    'Each assumed constant at both ends of its range (docs/runtime.md, "Simulator '
    "constants\"), tuner off; rows whose controls' reduction moves by more than one point:",
    "",
    sens.markdown(),
    "",
    sens.verdict(),
  ]
  with open(os.path.join(RESULTS, "sim_paper.json"), "w") as f:
    json.dump(data, f, indent=1, default=str)
  wl = sim.paper_mixes()["tp-attention"]
  for pol in ("concurrent", "priority+shaping"):
    r = sim.simulate(wl, target="h100x8", policy=pol, record=True)
    png = f"sim_timeline_h100_tp_attention_{pol.replace('+', '_')}.png"
    r.plot(os.path.join(RESULTS, png))
    lines.append(f"\n![{pol}]({png})")
  with open(os.path.join(RESULTS, "sim_paper.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
