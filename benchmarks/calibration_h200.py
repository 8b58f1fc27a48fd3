"""Kernel-cost calibration fitted on some H200 programs and checked on others (no GPU).

Reads the committed model check of the tensor + sequence parallel step on an H200
(``results/model_check_nocb_nvidia_h200_2026-12-04.json``: command buffers off, so every
kernel, cuBLAS's included, carries its HLO instruction), fits the per-kind factors of
``jax_overlap.analysis.fit_calibration`` on the unrolled steps (hidden 8192 and 4096) and
checks them on the scanned, rematerialized step and on the same programs measured as XLA
runs them (command buffers on, ``..._2.json``; kernels matched by name, cuBLAS's left out).
Per program: the matched kernels' measured time, the cost model's estimate without and
with the calibration, and each ratio.

Writes benchmarks/results/calibration_h200.{json,md}.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from jax_overlap._src.analysis import calibration  # noqa: E402
from jax_overlap._src.analysis.cost_model import CostModel  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NOCB = "model_check_nocb_nvidia_h200_2026-12-04.json"
CB = "model_check_nvidia_h200_2026-12-04_2.json"
FIT = ("large", "medium")


def _rows(data: dict, program: str) -> list[dict]:
  p = data["programs"][program]
  return calibration.match(p["per_op_estimate"], p["per_op_measured_s"])["rows"]


def main() -> int:
  files = {name: json.load(open(os.path.join(RESULTS, name))) for name in (NOCB, CB)}
  data = files[NOCB]
  rows = [r for program in FIT for r in _rows(data, program)]
  cal = calibration.fit(
    rows, gpu="h200", device=data["device"], jaxlib=data["jaxlib"], programs=FIT
  )
  launch = CostModel().kernel_overhead_s
  table = []
  for name, d in files.items():
    for program in d["programs"]:
      matched = [r for r in _rows(d, program) if r["measured_s"] is not None]
      measured = sum(r["measured_s"] for r in matched)
      plain = sum(r["est_s"] for r in matched)
      fitted = sum(launch + (r["est_s"] - launch) * cal.factor(r["kind"]) for r in matched)
      table.append(
        {
          "file": name,
          "program": program,
          "role": "fit" if (name, program) in {(NOCB, p) for p in FIT} else "check",
          "kernels": len(matched),
          "measured_ms": measured * 1e3,
          "estimate_ms": plain * 1e3,
          "calibrated_ms": fitted * 1e3,
        }
      )
  result = {
    "machine": _common.machine(),
    "calibration": cal.to_dict(),
    "rows": table,
  }
  with open(os.path.join(RESULTS, "calibration_h200.json"), "w") as f:
    json.dump(result, f, indent=1)
  lines = [
    "# Kernel-cost calibration on an H200: fitted on some programs, checked on others",
    "",
    f"{cal.describe()}. Fitted on {', '.join(FIT)} of `{NOCB}` (command buffers off); "
    f"checked on the rest of it and on `{CB}` (command buffers on: kernels matched by "
    "name, cuBLAS's left out). Matched kernels only; times per step in ms, measured on "
    "the GPU, estimated by the cost model without and with the calibration. Produced by "
    "benchmarks/calibration_h200.py from the committed measurements (no GPU).",
    "",
    "| file | program | role | kernels | measured ms | estimate ms | estimate / measured "
    "| calibrated ms | calibrated / measured |",
    "|---|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in table:
    lines.append(
      f"| {r['file']} | {r['program']} | {r['role']} | {r['kernels']} | "
      f"{r['measured_ms']:.3f} | {r['estimate_ms']:.3f} | "
      f"{r['estimate_ms'] / r['measured_ms']:.3f} | {r['calibrated_ms']:.3f} | "
      f"{r['calibrated_ms'] / r['measured_ms']:.3f} |"
    )
  lines += ["", f"Machine: {result['machine']}"]
  with open(os.path.join(RESULTS, "calibration_h200.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
