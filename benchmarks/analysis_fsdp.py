"""Deviceless analysis of a Llama-style bf16 FSDP step: XLA defaults vs recommended flags.

8 layers, hidden 4096, MLP 11008, 32 heads, sequence 2048, one sequence per GPU,
unrolled and scanned, on h100x8 and a100x8. Also times the analysis of a
32-layer step. Writes benchmarks/results/analysis_fsdp.{json,md}.

  python benchmarks/analysis_fsdp.py [--layers 8] [--big_layers 32]
"""

from __future__ import annotations

import os
import sys
import time

from absl import app
from absl import flags as absl_flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import jax_overlap  # noqa: E402
from jax_overlap.examples import fsdp_transformer  # noqa: E402

FLAGS = absl_flags.FLAGS
absl_flags.DEFINE_integer("layers", 8, "Layers of the analysed step.")
absl_flags.DEFINE_integer("big_layers", 32, "Layers of the step whose analysis is timed.")
absl_flags.DEFINE_list("targets", ["h100x8", "a100x8"], "Targets.")


def main(argv):
  del argv
  cfg = dict(layers=FLAGS.layers, hidden=4096, mlp=11008, heads=32, seq=2048, batch_per_device=1)
  rows, tables = [], []
  for target in FLAGS.targets:
    for scan in (False, True):
      fn, args = fsdp_transformer.build(target, scan=scan, **cfg)
      form = "scan" if scan else "unrolled"
      variants = {
        "XLA defaults": None,
        "recommended flags": jax_overlap.flags.as_compiler_options(target=target, workload="fsdp"),
      }
      reports = {}
      for name, opts in variants.items():
        t0 = time.perf_counter()
        r = jax_overlap.analyze(fn, *args, target=target, xla_options=opts, name=name)
        r_time = time.perf_counter() - t0
        reports[name] = r
        rows.append(
          {
            **r.summary(),
            "variant": name,
            "form": form,
            "analysis_time_s": r_time,
            "exposed_fraction": r.exposed_fraction,
            "xla_options": opts or {},
          }
        )
      table = jax_overlap.compare(reports)
      tables.append(f"### {target}, {form}\n\n{table.to_markdown()}\n")
      print(f"\n{target} {form}\n{table}")
  # Timing: a 32-layer step, scanned and unrolled, on h100x8.
  timings = {}
  for scan in (False, True):
    fn, args = fsdp_transformer.build("h100x8", scan=scan, **{**cfg, "layers": FLAGS.big_layers})
    t0 = time.perf_counter()
    r = jax_overlap.analyze(
      fn, *args, target="h100x8", xla_options=jax_overlap.flags.as_compiler_options(target="h100x8")
    )
    timings["scan" if scan else "unrolled"] = {
      "analysis_time_s": time.perf_counter() - t0,
      "compile_time_s": r.compile_time_s,
      "kernels": len(r.kernels),
      "collectives": len(r.collectives),
    }
    print(
      f"{FLAGS.big_layers}-layer {'scan' if scan else 'unrolled'} analysis: {timings['scan' if scan else 'unrolled']}"
    )
  payload = {
    "config": cfg,
    "machine": _common.machine(),
    "rows": rows,
    "big_step_timing": timings,
    "big_layers": FLAGS.big_layers,
  }
  md = (
    f"# Deviceless analysis of a bf16 FSDP transformer step\n\n"
    f"Configuration: {cfg}. Machine: {payload['machine']}.\n\n"
    "Exposed % is the share of communication time not hidden under compute, as placed on "
    "XLA's schedule by the cost model (jax_overlap.analyze).\n\n"
    + "\n".join(tables)
    + f"\n### Analysis time of a {FLAGS.big_layers}-layer step (h100x8, recommended flags)\n\n"
    + "\n".join(
      f"- {k}: {v['analysis_time_s']:.1f} s ({v['kernels']} kernels, {v['collectives']} collectives; XLA compile {v['compile_time_s']:.1f} s)"
      for k, v in timings.items()
    )
    + "\n"
  )
  print("wrote", _common.write("analysis_fsdp", payload, md))


if __name__ == "__main__":
  app.run(main)
