"""CUDA_DEVICE_MAX_CONNECTIONS=1 and NCCL channel caps judged by the simulator.

For each target and workload, ``jax_overlap.flags.judge_environment`` on the workload's
representative step (what ``recommended`` sets from), and on deviceless compiles of real
steps: the tensor + sequence parallel step (medium size) as XLA compiles it and with XLA's
Triton GEMMs off (cuBLAS GEMMs, persistent on Hopper: collectives released beside them wait
for them unless launched first), and the 8-layer FSDP step under the recommended flags.
Every figure is the simulator's (XLA's stream priority as the baseline), not a measurement.
Writes benchmarks/results/flags_environment.{json,md}.

  python benchmarks/flags_environment.py [--targets h100x8,h200x8,a100x8,a40x8]
"""

from __future__ import annotations

import os
import sys

from absl import app
from absl import flags as absl_flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import jax_overlap  # noqa: E402
from jax_overlap.examples import fsdp_transformer, tp_sp  # noqa: E402

FLAGS = absl_flags.FLAGS
absl_flags.DEFINE_list("targets", ["h100x8", "h200x8", "a100x8", "a40x8"], "Targets.")
absl_flags.DEFINE_list("steps_on", ["h100x8", "a100x8"], "Targets of the real steps.")
absl_flags.DEFINE_integer("layers", 8, "Layers of the FSDP step.")


def _rows(verdicts, target: str, workload: str, step: str, held=None) -> list[dict]:
  return [
    {
      "target": target,
      "workload": workload,
      "step": step,
      "held": held,
      "setting": f"{v.name}={v.value}",
      "baseline_s": v.baseline_s,
      "step_s": v.step_s,
      "gain": v.gain,
      "recommended": v.recommended,
    }
    for v in verdicts
  ]


def _real_steps(target: str):
  """(name, workload, report) of the real steps compiled for ``target``."""
  fn, args = tp_sp.build(target, **_common.TP_SIZES["medium"])
  yield (
    "tp_sp medium, XLA defaults",
    "tensor_parallel",
    jax_overlap.analyze(fn, *args, target=target),
  )
  yield (
    "tp_sp medium, cuBLAS GEMMs",
    "tensor_parallel",
    jax_overlap.analyze(
      fn, *args, target=target, xla_options={"xla_gpu_enable_triton_gemm": False}
    ),
  )
  cfg = dict(layers=FLAGS.layers, hidden=4096, mlp=11008, heads=32, seq=2048, batch_per_device=1)
  fn, args = fsdp_transformer.build(target, **cfg)
  opts = jax_overlap.flags.as_compiler_options(target=target, workload="fsdp")
  name = f"FSDP {FLAGS.layers} layers, recommended flags"
  yield name, "fsdp", jax_overlap.analyze(fn, *args, target=target, xla_options=opts)


def main(argv):
  del argv
  rows = []
  for target in FLAGS.targets:
    for workload in ("fsdp", "tensor_parallel", "data_parallel"):
      verdicts = jax_overlap.flags.judge_environment(target=target, workload=workload)
      rows += _rows(verdicts, target, workload, "representative")
  for target in FLAGS.steps_on:
    for name, workload, report in _real_steps(target):
      held = sum(1 for c in report.collectives if c.held_by)
      rows += _rows(jax_overlap.flags.judge_environment(report), target, workload, name, held)
  md = [
    "# Environment settings judged by the simulator",
    "",
    "`jax_overlap.flags.judge_environment`: each setting simulated against XLA's own policy "
    "(collective streams at the highest priority) on the workload's representative step "
    "(`flags.environment.representative`: a 4-layer FSDP or data-parallel transformer step, "
    "width 4096; six 8192^3 GEMMs with reduce-scatters for tensor parallel) and on deviceless "
    "compiles of real steps. CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware queue "
    "(`sim.Policy(single_queue=True)`); NCCL_MAX_CTAS=c: each collective on at most c "
    "channels. A setting is recommended from 2% faster. All figures are the simulator's, "
    "not measurements. 'held': the step's collectives that become ready beside a persistent "
    "cuBLAS GEMM and wait for it in the analysis (`CollectiveInfo.held_by`).",
    "",
    "| target | workload | step | held | setting | step ms | with it ms | change | recommended |",
    "|---|---|---|---:|---|---:|---:|---:|---|",
  ]
  for r in rows:
    held = "-" if r["held"] is None else r["held"]
    md.append(
      f"| {r['target']} | {r['workload']} | {r['step']} | {held} | {r['setting']} | "
      f"{_common.ms(r['baseline_s'])} | {_common.ms(r['step_s'])} | {-r['gain']:+.1%} | "
      f"{'yes' if r['recommended'] else 'no'} |"
    )
  paying = [r for r in rows if r["recommended"]]
  md += [
    "",
    f"Settings that pay: {len(paying)} of {len(rows)}"
    + (
      ": " + "; ".join(f"{r['target']} {r['step']} {r['setting']}" for r in paying)
      if paying
      else "."
    ),
  ]
  _common.publish("flags_environment", {"rows": rows}, md)


if __name__ == "__main__":
  app.run(main)
